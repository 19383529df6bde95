"""torchrun entry point: replay a trace over gloo. See ``moonep_sim.gloo.replay`` and docs/gloo.md.

    torchrun --nproc_per_node 4 launch/replay.py --trace T --strategy moonep --backward --json out.json
"""

from moonep_sim.gloo.replay import main

if __name__ == "__main__":
    main()
