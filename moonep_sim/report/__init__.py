"""Rendering only: the report dicts that :mod:`moonep_sim.experiments` builds, as terminal tables
(:mod:`~moonep_sim.report.tables`) and PNG plots (:mod:`~moonep_sim.report.plots`). Nothing here
plans, simulates or replays (no imports of gloo, sim or strategies; a test checks it).
"""
