"""`kascade calibrate`: a plan for a model from development text (:mod:`kascade.calibrate.pipeline`)."""

from __future__ import annotations

from .settings import build
from .types import file, integer, method, model_args, number, positive, rule


def settings(args):
    """The pipeline's :class:`~kascade.calibrate.pipeline.Settings` from the options (``rolling`` is ``not
    --no-rolling``; every other field is the option of its name)."""
    from ..calibrate import pipeline

    return build(pipeline.Settings, args, {"rolling": not args.no_rolling})


def run(args) -> int:
    from ..calibrate import pipeline

    r = pipeline.run(settings(args))
    print()
    print(pipeline.report(r))
    return 0


def add(sub) -> None:
    from .. import costs
    from ..calibrate import target
    from ..calibrate.pipeline import Settings as CalibrationSettings
    from ..calibrate.stats import min_window_tokens

    c = sub.add_parser(
        "calibrate",
        help="choose anchor layers and head map for a model from development text",
        description="Runs the model densely over development windows, streams the cross-layer similarity of "
        "top-k index sets (minimum over query tiles, averaged over windows) and each layer's importance, then "
        "picks the anchors by an exact dynamic program and each reuse head's anchor head by argmax (--method "
        "chooses other ways). Writes plan.json (use it with kascade.enable or --plan), stats.json, objective.csv (DP "
        "objective per number of anchors) and two PNG plots into --out. With --data, the windows come from the "
        "start of the file and the command prints how many texts it used, for kascade eval --skip-texts. Every "
        "argument and the output folder are checked before the model's weights are loaded.",
    )
    cal = CalibrationSettings()
    c.add_argument("--data", default=None, type=file, metavar="FILE",
                   help="development texts: a JSONL file (.jsonl or .json: one object per line, the text under "
                   "--text-field) or a plain-text file (one text). Windows of --seq-len tokens are cut one after "
                   "another from the texts in file order, as kascade eval --data cuts them (a long text gives several; "
                   "none spans two texts): --samples windows for the statistics, then --holdout, then, from the texts "
                   "after theirs, --search-windows (default: the development split of Python's pydoc_data.topics)")
    c.add_argument("--text-field", default=cal.text_field,
                   help=f"with a JSONL --data: the field holding the text (default: {cal.text_field})")
    c.add_argument("--seq-len", type=positive(), default=cal.seq_len,
                   help="tokens per development window; at least one whole --tile after --k keys (--k rounded up "
                   f"to tiles), {min_window_tokens(cal.k, cal.tile)} at the defaults (default: {cal.seq_len})")
    c.add_argument("--samples", type=positive(), default=cal.samples,
                   help=f"development windows the statistics are averaged over (default: {cal.samples})")
    g = c.add_mutually_exclusive_group()
    g.add_argument("--anchors", type=positive(), default=cal.anchors,
                   help="number of anchor layers, layer 0 included; at most the model's layer count "
                   f"(default: {cal.anchors})")
    g.add_argument("--target-agreement", type=number(0.0, 1.0), default=None,
                   help="instead of --anchors: the fastest plan (by modelled speedup, see --speedup-mode: the fewest "
                   "anchors, 2 to --max-anchors) whose teacher-forced top-1 agreement with dense on --holdout "
                   "held-out development windows reaches this value, in (0, 1]")
    g.add_argument("--target-speedup", type=float, default=None, metavar="X",
                   help="instead of --anchors: the most accurate plan (most anchors by the DP) whose modelled "
                   "model-average attention speedup over dense is at least X (H200 kernel times at 128K tokens, "
                   "decode at batch 32, prefill at batch 1; see --speedup-mode, --cost-shape, --cost-table). With "
                   "--method measured the number of anchors and the per-layer budgets are searched together (see "
                   "--joint-span). A target beyond the fastest plan is refused before the model is loaded")
    c.add_argument("--speedup-mode", default=cal.speedup_mode, choices=target.SPEEDUP_MODES,
                   help="which attention --target-speedup bounds, and which speedup orders the plans --target-"
                   f"agreement tries (both: the slower of the two) (default: {cal.speedup_mode})")
    c.add_argument("--cost-shape", default=None, choices=tuple(costs.shapes()),
                   help="whose measured kernel times model the speedup (default: the model's own shape if measured, "
                   f"else {costs.DEFAULT_SHAPE}, or a --cost-table's first shape when it lacks that one; the report "
                   "names the shape used)")
    c.add_argument("--cost-table", default=None, type=file, metavar="FILE",
                   help="model the speedup with the kernel times of this file, measured on your GPU by kascade "
                   "costs, instead of the shipped H200 times (128K tokens where measured, else its longest length)")
    c.add_argument("--holdout", type=positive(), default=cal.holdout,
                   help=f"with --target-agreement: held-out development windows (default: {cal.holdout})")
    c.add_argument("--max-anchors", type=positive(), default=cal.max_anchors,
                   help="the largest number of anchors in objective.csv and tried by --target-agreement "
                   f"(default: {cal.max_anchors})")
    c.add_argument("--k", type=positive(), default=cal.k,
                   help=f"keys per query tile whose top-k sets are compared across layers to measure their "
                   f"similarity (default: {cal.k}, as the authors)")
    c.add_argument("--ratio", type=number(0.0, 1.0), default=cal.ratio,
                   help=f"plan budget: fraction of the keys each query attends, in (0, 1] (default: {cal.ratio:.2f})")
    c.add_argument("--k-min", type=positive(), default=cal.k_min,
                   help=f"plan budget: at least this many keys (default: {cal.k_min})")
    c.add_argument("--tile", type=positive(), default=cal.tile,
                   help=f"query tile: prefill queries select keys in groups of this many (default: {cal.tile})")
    c.add_argument("--no-rolling", action="store_true",
                   help="plan budget: every prefill tile keeps the budget of the whole prompt, instead of one that "
                   "grows with the tile's position (the default)")
    c.add_argument("--seed", type=integer(0), default=cal.seed,
                   help=f"which development windows of pydoc_data.topics; no effect with --data (default: {cal.seed})")
    c.add_argument("--method", default=cal.method, type=method,
                   help="which plan to write: faithful (the paper's method, default), a reuse rule (any-anchor, "
                   "union2, sinks, layer-budget, or several joined by '+'), length (one sub-plan per "
                   "--lengths, chosen from N at run time), search (anchors by measured KL on other dev windows) or "
                   "measured (the shipped default's method: search, then per-layer budgets from each layer's measured "
                   "sensitivity on those windows; about 30 + 3 x layers plan evaluations)")
    c.add_argument("--rule", default=None, type=rule,
                   help="with --method length / search: the reuse rule of the sub-plans (default: faithful)")
    c.add_argument("--lengths", type=positive(), nargs="+", default=None,
                   help="with a --method other than faithful: calibration lengths in tokens, each with its own "
                   "statistics (length: one sub-plan per length; search: one search per length; measured: all "
                   "together; a reuse rule: the longest) (default: --seq-len)")
    c.add_argument("--search-windows", type=positive(), default=cal.search_windows,
                   help="with --method search / measured: development windows per length that plans are scored on, "
                   f"other than the statistics' (default: {cal.search_windows})")
    c.add_argument("--search-evals", type=positive(), default=cal.search_evals,
                   help="with --method search / measured: how many plans the anchor search scores (per length for "
                   f"search) (default: {cal.search_evals})")
    c.add_argument("--joint-span", type=integer(0), default=cal.joint_span, metavar="N",
                   help="with --method measured and --target-speedup: besides the most anchors that meet the target, "
                   "try up to N fewer, each spending the time it saves on larger per-layer budgets, and keep the "
                   "plan of lowest KL on the search windows (each count costs about 30 + 3 x layers plan "
                   f"evaluations) (default: {cal.joint_span})")
    c.add_argument("--tensor-parallel", type=positive(), default=None, metavar="N",
                   help="make the plan shard-local for N tensor-parallel ranks (the KV heads split evenly over them): "
                   "a reuse head that would follow an anchor head of another rank follows the most similar anchor "
                   "head of its own rank instead. N must divide the model's KV heads (default: no tensor "
                   "parallelism: any head may follow any head)")
    c.add_argument("--out", default=str(cal.out), metavar="DIR",
                   help=f"output folder, created if missing; an existing plan.json there is replaced "
                   f"(default: ./{cal.out})")
    model_args(c)
    c.set_defaults(func=run, parser=c)
