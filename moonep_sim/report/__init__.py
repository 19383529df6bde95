"""Rendering only: the report dicts that :mod:`moonep_sim.experiments` builds, as terminal tables
(:mod:`~moonep_sim.report.tables`), PNG plots (:mod:`~moonep_sim.report.plots`,
:mod:`~moonep_sim.report.winner`, :mod:`~moonep_sim.report.steps`), one self-contained HTML
report (:mod:`~moonep_sim.report.html`) and a result's folder (:mod:`~moonep_sim.report.save`).
Nothing here plans, simulates or replays (no imports of gloo, sim, strategies or experiments; a
test checks it).
"""
