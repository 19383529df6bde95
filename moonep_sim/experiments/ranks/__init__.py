"""The rank programs the experiments launch: what each spawned process runs.

:mod:`~.replay_rank` (the gloo replay: every rank binds the strategies to the gloo executor;
``launch/replay.py``, ``torchrun -m moonep_sim.experiments.ranks.replay_rank``, or
``run_replay`` through ``moonep_sim.gloo.launcher``) and :mod:`~.calibrate_measure` (the
local-gloo calibration's measurements, one spawned process per rank). The Hugging Face training
rank program is ``moonep_sim.integrations.train``, beside the model integration it drives.
"""
