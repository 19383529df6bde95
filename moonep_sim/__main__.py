import sys

from moonep_sim.cli import main

sys.exit(main())
