"""`kascade eval`: sparse-attention strategies against dense at the same budget, on the same attention path.

:mod:`.strategies` (Kascade's plans and the baselines as (plan, selector) pairs), :mod:`.ruler` (RULER-style
generated tasks), :mod:`.needle` (needle retrieval in the demo's chat format, which small models answer densely),
:mod:`.longbench` (LongBench-format files and metrics), :mod:`.runner` (the run), :mod:`.results` (its files, the
scores' confidence intervals).
Teacher-forced fidelity against dense comes from :mod:`kascade.fidelity`.
"""
