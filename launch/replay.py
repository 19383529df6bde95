"""Replay a trace over gloo. See ``moonep_sim.experiments.replay_rank`` and docs/gloo.md.

    python launch/replay.py --nproc 4 --trace T --strategy moonep --backward --json out.json

starts 4 local ranks itself (rendezvous store and gloo bound to loopback) and exits with the
failing rank's status and one error line (2 bad input, 1 a failed collective, 130 on Ctrl-C).
Under torchrun (``torchrun --nproc_per_node 4 launch/replay.py ...``) it runs as one rank; a
failure then also gets torchrun's own report.
"""

from moonep_sim.experiments.replay_rank import main

if __name__ == "__main__":
    main()
