"""``python -m moonep_sim``: the ``moonep-sim`` command. Ctrl-C at any moment, even while the
package is still being imported, ends with exit status 130 and the one line ``moonep-sim: interrupted``."""

import sys

from moonep_sim.errors import interrupts_deferred

try:
    with interrupts_deferred():
        from moonep_sim.cli import main
    code = main()
except KeyboardInterrupt:
    print("moonep-sim: interrupted", file=sys.stderr, flush=True)
    code = 130
sys.exit(code)
