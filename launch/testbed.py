"""Emulated multi-node testbed (root, Linux): ``python launch/testbed.py run --nodes 2 ...``.

A thin wrapper around ``moonep-sim testbed`` (see ``moonep_sim/testbed/``); same arguments.
"""

import sys

from moonep_sim.cli import main

if __name__ == "__main__":
    sys.exit(main(["testbed", *sys.argv[1:]]))
