"""Result analysis: what the figures of a run say, computed from the figures alone.

Between the step model and the experiments: it reads the report dicts the experiments assemble
(and the planners' and simulator's vocabularies), and runs nothing. Modules: :mod:`~.verdict`
(winner, margin, confidence and the mechanism of every comparison), :mod:`~.measured_verdict`
(the same from a real replay's measured phases), :mod:`~.flags` (the assumptions a figure rests
on), :mod:`~.ranking` (which strategy orders the measurements resolve), :mod:`~.winner` (the
winner map over a sweep), :mod:`~.stepstats` (per-step aggregates and batch weights).
"""
