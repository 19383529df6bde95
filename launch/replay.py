"""Replay a trace over gloo. See ``moonep_sim.experiments.ranks.replay_rank`` and docs/gloo.md.

    python launch/replay.py --nproc 4 --trace T --strategy moonep --backward --json out.json

starts 4 local ranks itself (rendezvous store and gloo bound to loopback) and exits with the
failing rank's status and one error line (2 bad input, 1 a failed collective, 130 on Ctrl-C).
Under torchrun (``torchrun --nproc_per_node 4 launch/replay.py ...``) it runs as one rank; a
failure then also gets torchrun's own report.

Ctrl-C at any moment -- even while torch is still being imported, before any rank exists -- ends
with exit status 130 and the one line ``moonep-sim: interrupted`` (the launcher kills the ranks it
started; see ``moonep_sim.gloo.launcher``).
"""

import sys


def _interrupted() -> None:
    print("moonep-sim: interrupted", file=sys.stderr, flush=True)
    sys.exit(130)


if __name__ == "__main__":
    try:
        from moonep_sim.errors import interrupts_deferred
        with interrupts_deferred():  # Ctrl-C inside numpy's or torch's import would become their ImportError
            from moonep_sim.experiments.ranks.replay_rank import main  # imports torch: a second or more
        main()
    except KeyboardInterrupt:
        _interrupted()
