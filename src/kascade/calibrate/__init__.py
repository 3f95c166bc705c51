"""Calibration: from dense runs on development text to a plan (anchors, head map, reuse rule, budgets).

One algorithm per module:

- :mod:`.stats`:    streamed statistics of dense forwards (cross-layer similarity of top-k sets, layer importance):
                    ``collect_stats``, ``StatsRecorder`` (an attention runtime for ``integration.hf.attach``).
- :mod:`.dp`:       the anchor DP over those statistics and the argmax head map: ``plan_from_stats`` (the paper's
                    method), ``dp_anchors``, ``objective_table``.
- :mod:`.rules`:    reuse rules on the DP's anchors (any-anchor, union2, sinks, layer-budget) and length-aware plans:
                    ``plan_for_rule``, ``length_plan``.
- :mod:`.search`:   anchors by measured KL against dense on development windows: ``search_anchors``, ``searched_plan``.
- :mod:`.budgets`:  per-layer budgets from each layer's measured sensitivity: ``layer_sensitivity``,
                    ``allocate_factors``, ``measured_budget_plan``.
- :mod:`.pipeline`: `kascade calibrate`: windows, statistics, one plan per method, the files written.
- :mod:`.plots`:    the similarity heatmap and the importance curve.

    stats = collect_stats(model, windows)            # streaming, one dense forward per window
    plan = plan_from_stats(model, stats, num_anchors=6)

Measured scores come from :mod:`kascade.fidelity` (teacher-forced comparison against dense).
"""

from .. import _renamed
from ..text import load_texts
from .budgets import (
    MEASURED_GRID,
    allocate_factors,
    layer_sensitivity,
    measured_budget_plan,
    monotone_costs,
)
from .dp import (
    choose_anchors,
    dp_anchors,
    head_maps,
    layer_weights,
    objective_table,
    plan_from_stats,
)
from .pipeline import METHODS, Settings, dev_windows, plan_from_method
from .rules import (
    ALPHA,
    RECENT,
    RULES,
    SINKS,
    layer_factors,
    length_plan,
    plan_for_rule,
    ranked_sources,
)
from .search import search_anchors, searched_plan
from .stats import (
    DEFAULT_K,
    CalibrationStats,
    StatsRecorder,
    collect_stats,
    min_window_tokens,
)

__all__ = [
    "ALPHA", "DEFAULT_K", "MEASURED_GRID", "METHODS", "RECENT", "RULES", "SINKS", "CalibrationStats", "Settings",
    "StatsRecorder", "allocate_factors", "choose_anchors", "collect_stats", "dev_windows", "dp_anchors", "head_maps",
    "layer_factors", "layer_sensitivity", "layer_weights", "length_plan", "load_texts", "measured_budget_plan",
    "min_window_tokens", "monotone_costs", "objective_table", "plan_for_rule", "plan_from_method", "plan_from_stats",
    "ranked_sources", "search_anchors", "searched_plan",
]


__getattr__ = _renamed.module_getattr(__name__, _renamed.FACTOR, allocate_scales="allocate_factors",
                                     layer_scales="layer_factors")
