"""Integrations of the gloo executor with model libraries (above ``moonep_sim.gloo``, below experiments).

- :mod:`moonep_sim.integrations.hf`: expert parallelism for Hugging Face transformers MoE models
  (:func:`~moonep_sim.integrations.hf.expert_parallel`); transformers is an optional extra, imported
  only when a model is built or wrapped.
- :mod:`moonep_sim.integrations.tiny`: tiny random-initialised models of each MoE family, built offline.
- :mod:`moonep_sim.integrations.train`: the rank program of ``launch/train_hf.py`` (training steps,
  the single-process check, generate, routing record, step timings).
"""

from __future__ import annotations

__all__ = ["hf", "tiny", "train"]
