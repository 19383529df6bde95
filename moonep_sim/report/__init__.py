"""Reports that put traces, strategies and both executors together.

- :mod:`~moonep_sim.report.calibrate`: measure this machine (gloo all-to-all, CPU SwiGLU) and fit
  the ``local-gloo`` topology constants.
- :mod:`~moonep_sim.report.compare`: every strategy on one routing, simulated (and replayed for real).
- :mod:`~moonep_sim.report.sweep`: layer time versus imbalance, EP size or a topology parameter.
- :mod:`~moonep_sim.report.fidelity`: simulated versus measured, error per case, rank agreement.
- :mod:`~moonep_sim.report.tables` / :mod:`~moonep_sim.report.plots`: terminal tables and PNG plots.
"""
