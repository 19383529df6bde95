"""Train a Hugging Face MoE model with expert parallelism over gloo; check it; simulate the same steps.

    python launch/train_hf.py --model tiny-qwen2-moe --nproc 4 --strategy moonep --steps 4 --check
    python launch/train_hf.py --model tiny-mixtral --nproc 4 --strategy alltoall,deepep,moonep \\
        --steps 16 --compare-sim --json out.json
    torchrun --nproc_per_node 4 launch/train_hf.py --model cfg.json --strategy moonep --record r.safetensors

``--nproc N`` starts N local ranks itself (the project's launcher: rendezvous store and gloo on
loopback, the failing rank's one error line and status), with a progress bar on a terminal (rank
0's check and training steps; none when piped or with ``--quiet``). Under torchrun every process is one rank.
``--compare-sim`` simulates the measured steps (same model shape, same recorded routing, same
strategies) on the ``local-gloo`` topology and prints measured against simulated step times
(``moonep_sim.experiments.hf_step``). Exit status: 0; 3 when ``--check`` found a difference; 2 bad
input; 1 a failed collective; 130 on Ctrl-C (at any moment after the interpreter has started: one line,
the ranks stopped). Everything that can be checked -- the model's config, --nproc against its experts,
the strategies, the outputs -- is checked before any rank starts. See docs/hf.md.
"""

import os
import sys


def main(argv=None) -> int:
    from moonep_sim.errors import exit_status

    return exit_status(_main, sys.argv[1:] if argv is None else list(argv))


def _main(argv) -> int:
    import json
    import tempfile

    from moonep_sim.errors import interrupts_deferred, require
    with interrupts_deferred():  # torch and numpy load here: Ctrl-C is raised once they have
        from moonep_sim.integrations import train
    from moonep_sim.io import write_text_atomic

    a = train.build_parser().parse_args(argv)
    train.check_args(a)
    if "RANK" in os.environ:            # one rank under torchrun
        require(not a.compare_sim or a.record, "--compare-sim (without --record) must be given --record TRACE "
                                                "under torchrun: the simulation reads the recorded routing")
        code, rep = train.rank_main(argv)
        if code or rep is None:
            return code
        if a.compare_sim:
            rep["compare_sim"] = _compare(rep)
    else:
        require(a.nproc >= 1, f"--nproc ({a.nproc}) must be >= 1 (or run under torchrun)")
        with tempfile.TemporaryDirectory(prefix="train-hf-") as tmp:
            run_argv = list(argv)
            if a.compare_sim and not a.record:
                run_argv += ["--record", os.path.join(tmp, "routing.safetensors")]
            from moonep_sim.progress import followed, tracker

            with tracker(f"train_hf on {a.nproc} ranks", show=False if a.quiet else None) as cb, \
                    followed(os.path.join(tmp, "progress"), cb):  # rank 0 reports, the bar is drawn here
                rep = train.launch(a.nproc, run_argv, timeout_s=max(600.0, 20 * a.timeout))
            if a.compare_sim:
                rep["compare_sim"] = _compare(rep)
    if a.json:
        write_text_atomic(a.json, json.dumps(rep, indent=1, sort_keys=True), what="--json")
    if not a.quiet:
        print(train.summary(rep))
        if "compare_sim" in rep:
            from moonep_sim.experiments.hf_step import summary_lines
            print("\n".join(summary_lines(rep["compare_sim"])))
    return 0 if rep.get("check_ok", True) else 3


def _compare(rep):
    from moonep_sim.experiments.hf_step import compare_steps
    return compare_steps(rep)


if __name__ == "__main__":
    try:
        code = main()
    except KeyboardInterrupt:  # Ctrl-C before the package's own handler is in place
        print("moonep-sim: interrupted", file=sys.stderr, flush=True)
        code = 130
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)   # under torchrun: no process-group destructors after a failed collective
