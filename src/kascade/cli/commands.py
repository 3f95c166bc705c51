"""The four commands: for each, its options (``add_<command>``, every help says what the option means and its
default) and what it runs (``run_<command>``, from the parsed options)."""

from __future__ import annotations

import argparse

from .types import csv_of, device, file, integer, method, model_args, number, plan_arg, positive, rule  # noqa: F401


def run_demo(args) -> int:
    from .. import demo

    r = demo.run(tokens=args.tokens, max_new_tokens=args.max_new_tokens, compare_last=args.compare_last,
                 device=args.device, model_path=args.model, plan=args.plan, seed=args.seed)
    print()
    print(demo.report(r))
    return 0


def add_demo(sub) -> None:
    from ..plan import SHIPPED_VARIANTS
    d = sub.add_parser(
        "demo",
        help="answer a needle question over a long prompt, densely and with Kascade, and compare",
        description="Builds a long prompt from Python's own documentation (pydoc_data.topics) with a needle fact "
        "in the middle and a question about it, then runs the model densely and with Kascade (--plan, else the shipped "
        "calibrated plan for the model, else an uncalibrated uniform plan): prints both greedy answers, the "
        "teacher-forced top-1 agreement and KL between the two on the prompt's last positions, and wall times. "
        "Writes no files.",
    )
    d.add_argument("--tokens", type=positive(), default=4096,
                   help="prompt length in tokens, haystack, needle and question included, within a few tokens (the haystack's "
                   "halves are re-tokenised around the needle) (default: 4096)")
    d.add_argument("--max-new-tokens", type=positive(), default=24,
                   help="tokens of each greedy answer (default: 24)")
    d.add_argument("--compare-last", type=positive(), default=512,
                   help="the teacher-forced comparison scores this many last prompt positions (default: 512)")
    d.add_argument("--plan", default=None, type=plan_arg, metavar="FILE|NAME",
                   help="a Kascade plan JSON, as kascade calibrate writes, or the name of a plan shipped for the model "
                   f"({', '.join(SHIPPED_VARIANTS)}) (default: the shipped plan for the model, else a uniform one)")
    d.add_argument("--seed", type=integer(0), default=0,
                   help="which window of the evaluation text is the haystack (default: 0)")
    model_args(d)
    d.set_defaults(func=run_demo, parser=d)


def run_calibrate(args) -> int:
    from ..calibrate import pipeline

    settings = pipeline.Settings(
        out=args.out, model=args.model, device=args.device, data=args.data, text_field=args.text_field,
        seq_len=args.seq_len, samples=args.samples, anchors=args.anchors, target_agreement=args.target_agreement,
        target_speedup=args.target_speedup, speedup_mode=args.speedup_mode, cost_shape=args.cost_shape,
        cost_table=args.cost_table,
        holdout=args.holdout, max_anchors=args.max_anchors, k=args.k, ratio=args.ratio, k_min=args.k_min,
        tile=args.tile, rolling=not args.no_rolling, seed=args.seed, method=args.method, rule=args.rule,
        lengths=args.lengths, search_windows=args.search_windows, search_evals=args.search_evals,
        joint_span=args.joint_span, tensor_parallel=args.tensor_parallel)
    r = pipeline.run(settings)
    print()
    print(pipeline.report(r))
    return 0


def add_calibrate(sub) -> None:
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
    c.set_defaults(func=run_calibrate, parser=c)


def run_eval(args) -> int:
    from ..eval import runner
    from ..eval.results import ROWS

    settings = runner.Settings(
        out=args.out, model=args.model, device=args.device, strategies=args.strategies, tasks=args.tasks,
        lengths=args.lengths, samples=args.samples, seed=args.seed, plan=args.plan, ratio=args.ratio,
        k_min=args.k_min, omnikv_layer=args.omnikv_layer, longbench=args.longbench,
        longbench_limit=args.longbench_limit, data=args.data, text_field=args.text_field, skip_texts=args.skip_texts)
    r = runner.evaluate(settings)
    print()
    print(r["markdown"])
    print("wrote " + ", ".join(str(f) for f in r["files"]) + f" ({len(r['rows'])} rows in "
          f"{settings.out}/{ROWS})")
    return 0


def add_eval(sub) -> None:
    from ..plan import SHIPPED_VARIANTS
    from ..eval.results import ROWS
    from ..eval.runner import MIN_RULER_LENGTH, TASKS
    from ..eval.strategies import STRATEGIES

    e = sub.add_parser(
        "eval",
        help="accuracy of Kascade against dense, the oracle and other sparse methods at the same budget",
        description="Runs each strategy on each task through the same attention path and budget. Tasks: "
        "'fidelity' (teacher-forced top-1 agreement, KL and NLL against dense on held-out pydoc_data windows, or "
        "on your own text with --data; score = agreement) and RULER-style generated tasks (needle in a haystack: "
        "single number / word, multikey, multivalue, multiquery; variable tracking; common and frequent words "
        "extraction; score = RULER string match), plus LongBench-format files (--longbench). Strategies: dense; "
        "oracle (every layer selects its own top-k); kascade (the calibrated plan); kascade-faithful (the paper's "
        "method as shipped for the model); kascade-no-headmap; kascade-shared (one index set for all heads); "
        "streamingllm (4 sinks + recent window); quest (16-key pages by query-aware min/max bounds); omnikv (one "
        "selection layer reused by all later layers). The attended fraction of keys is measured from the "
        f"selections made. Every finished row is appended to {ROWS} in --out as it is made, and results.json, "
        "results.csv (per sample) and summary.md are rewritten after every sample (scores.png at the end): an "
        "interrupted run keeps what it finished, and the same command with the same --out resumes it, skipping the "
        "rows already there. Every argument and the output folder are checked before the model's weights are loaded.",
    )
    e.add_argument("--strategies", type=csv_of("strategy", STRATEGIES), default=None,
                   help=f"comma-separated strategies, or 'all' (default: every one that runs on the model: "
                   f"kascade-faithful needs a shipped plan); from: {', '.join(STRATEGIES)}")
    e.add_argument("--tasks", type=csv_of("task", TASKS), default=None,
                   help="comma-separated tasks, or 'all' (default: fidelity,niah_single_number; fidelity alone with "
                   f"--data; none with --longbench); from: {', '.join(TASKS)}")
    e.add_argument("--lengths", type=positive(), nargs="+", default=[2048],
                   help="prompt lengths in tokens: fidelity windows are exactly this long, RULER prompts about this "
                   f"long (at least {MIN_RULER_LENGTH}) (default: 2048)")
    e.add_argument("--samples", type=positive(), default=2,
                   help="samples per task and length: windows of the fidelity text, generated RULER prompts "
                   "(default: 2)")
    e.add_argument("--seed", type=integer(0), default=0,
                   help="which pydoc_data windows and generated samples (default: 0)")
    e.add_argument("--plan", default=None, type=plan_arg, metavar="FILE|NAME",
                   help="the plan of the kascade strategies: a Kascade plan JSON, as kascade calibrate writes, or the "
                   f"name of a plan shipped for the model ({', '.join(SHIPPED_VARIANTS)}) (default: the shipped plan "
                   "for the model, else a uniform one)")
    e.add_argument("--ratio", type=number(0.0, 1.0), default=None,
                   help="the budget's fraction of keys, for every strategy, in (0, 1] (default: each plan's own); "
                   "a plan with per-layer budgets (the default model's shipped plan) scales it per layer, so its "
                   "layers keep more or fewer: the 'attended' column measures what each strategy read")
    e.add_argument("--k-min", type=positive(), default=None,
                   help="the budget's least number of keys, for every strategy (default: each plan's own); a plan "
                   "with per-layer budgets scales the budget per layer, this floor included")
    e.add_argument("--omnikv-layer", type=positive(), default=2,
                   help="the layer whose selection the omnikv strategy reuses in every later layer; below the "
                   "model's layer count (default: 2)")
    e.add_argument("--longbench", default=None, type=file, metavar="FILE",
                   help="a LongBench-format JSONL file: one record per line with context, input, answers (a string "
                   "or a list of strings) and dataset (which picks the metric: a LongBench dataset's name, or for one of your own "
                   "qa_f1, rouge_l, classification or code_sim; others are refused); its records run after the tasks, "
                   "each at its own length")
    e.add_argument("--longbench-limit", type=positive(), default=None,
                   help="use the first this many LongBench records (default: all)")
    e.add_argument("--data", default=None, type=file, metavar="FILE",
                   help="your own text for the fidelity task instead of pydoc_data.topics: a JSONL file (the text "
                   "under --text-field) or a plain-text file, as kascade calibrate --data takes; windows of each "
                   "--lengths are cut one after another from its texts (a window lies within one text), after the "
                   "first --skip-texts")
    e.add_argument("--skip-texts", type=integer(0), default=0, metavar="N",
                   help="with --data: leave out the first N texts of the file. kascade calibrate --data FILE takes "
                   "its texts from the start of FILE and prints how many it used: give that number to evaluate on "
                   "windows disjoint from the ones the plan was calibrated on (default: 0)")
    e.add_argument("--text-field", default="text",
                   help="with a JSONL --data: the field holding the text (default: text)")
    e.add_argument("--out", default="kascade-eval", metavar="DIR",
                   help=f"output folder, created if missing; a folder holding {ROWS} of the same settings is resumed, "
                   "one of other settings refused (default: ./kascade-eval)")
    model_args(e)
    e.set_defaults(func=run_eval, parser=e)


def run_bench(args) -> int:
    from .. import bench

    return bench.main_args(args)


def batch_by_length(value: str) -> tuple[int, int]:
    """An argparse type: ``BxL``, a batch size and a prompt length (positive integers)."""
    try:
        b, n = (int(x) for x in value.lower().split("x"))
    except ValueError:
        b = n = 0
    if b < 1 or n < 1:
        raise argparse.ArgumentTypeError(f"a configuration is BATCHxLENGTH of positive integers (e.g. 1x32768), "
                                         f"got {value!r}")
    return b, n


def add_bench(sub) -> None:
    from ..plan import SHIPPED_VARIANTS
    from ..bench import MODELS, Settings
    from ..bench.settings import DECODE_MODES

    dflt = Settings()
    b = sub.add_parser(
        "bench",
        help="end-to-end time to first token and inter-token latency, dense vs Kascade",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="""\
Measures, for every model x batch size x prompt length (a configuration), in one run and on the same weights and
random prompt (seeded token ids):
  TTFT   time to first token: the prompt through model(..., use_cache=True, logits_to_keep=1) into a fresh
         cache, plus the argmax; synchronised before and after; median of --repeats after one warm-up
  ITL    inter-token latency: mean time per greedy decode step over --decode-steps steps after the prefill and
         untimed warm-up steps. --decode graph (default on CUDA): a static cache and one CUDA-graph replay per
         step, how serving engines decode; --decode eager: a DynamicCache and a Python-driven forward per step
  through generate (--decode-modes eager,compiled): TTFT and ITL of transformers' model.generate, what users
         call, for dense and Kascade: eager (its DynamicCache) and compiled (cache_implementation="static" and its
         compile config: torch.compile, fullgraph, mode="reduce-overhead": a CUDA graph per step), from
         per-token stamps (CUDA events): TTFT from generate's start to its first token, ITL the mean step after
         warm-up steps; in a table of their own, each row naming its mode
  peak   torch.cuda.max_memory_allocated (weights included), reset before each mode
  attention share   1 - t(no-op attention) / t(dense), prefill and decode: the same forward with a temporary
         attention implementation that returns zeros (the model's own implementation is restored afterwards)
for dense (eager: the model's own attention, SDPA; graph: SDPA with cuDNN first for the prefill and a dense
split-K Triton kernel for decode, since SDPA over a static cache attends its whole capacity) and Kascade (kascade.enable(model, plan, backend=--backend)), with
speedups dense / Kascade. Before each configuration its memory (weights + KV cache + prefill activations + Kascade's
selections) is estimated; one that cannot fit, or is predicted to overrun --time-budget, is skipped with the reason;
out-of-memory errors are caught per configuration and recorded.

Models (--models):
  default  --model (a .gguf file or a local model folder), else the embedded SmolLM2-135M-Instruct; plan: --plan,
           else the shipped calibrated plan for its shape (else uniform). SmolLM2 is trained for 8K tokens: longer
           lengths measure speed only.
  llama8b  Llama-3.1-8B shapes (hidden 4096, 32 layers, 32 query / 8 KV heads, head_dim 128, vocab 128256) with
           random weights built on --device, nothing downloaded; plan: uniform 5 anchors of 32 layers.
  tiny     a tiny random Llama (4 layers, hidden 64) for tests and dry runs; plan: uniform 2 anchors.

Writes bench.json (machine, versions, settings, every measurement and skip reason), bench.md (the table) and
bench.png (TTFT and ITL against context length) into --out after every configuration, and prints the table.""",
    )
    b.add_argument("--models", type=csv_of("model", MODELS), default=["default", "llama8b"],
                   help=f"comma-separated models, or 'all' (default: default,llama8b); from: {', '.join(MODELS)}")
    b.add_argument("--lengths", type=positive("length"), nargs="+", default=list(dflt.lengths),
                   help=f"prompt lengths in tokens (default: {' '.join(map(str, dflt.lengths))})")
    b.add_argument("--batches", type=positive("batch size"), nargs="+", default=list(dflt.batches),
                   help=f"batch sizes (default: {' '.join(map(str, dflt.batches))})")
    b.add_argument("--configs", type=batch_by_length, nargs="+", default=None, metavar="BxL",
                   help="(batch, length) configurations to run instead of every --batches x --lengths, e.g. "
                   "1x32768 1x131072 2x32768")
    b.add_argument("--repeats", type=positive(), default=dflt.repeats,
                   help=f"timed prefills per mode after one warm-up; TTFT is their median (default: {dflt.repeats})")
    b.add_argument("--decode-steps", type=positive(), default=dflt.decode_steps,
                   help=f"greedy decode steps averaged into ITL (default: {dflt.decode_steps})")
    b.add_argument("--decode", choices=("graph", "eager"), default=None,
                   help="how decode steps run: graph (static cache + CUDA graph replay; the default on CUDA) or eager "
                   "(DynamicCache, one Python-driven forward per step; the default elsewhere)")
    b.add_argument("--decode-modes", type=csv_of("decode mode", DECODE_MODES), default=None,
                   help="comma-separated, or 'all': eager (generate, eagerly), compiled (generate with a static cache "
                   "and torch.compile), graph (GraphDecoder's CUDA-graph replays, for the main columns; without it "
                   "they come from the eager Python loop); e.g. eager,compiled,graph. Instead of --decode")
    b.add_argument("--compile-backend", default=dflt.compile_backend, metavar="NAME",
                   help=f"torch.compile backend of the compiled mode (default: {dflt.compile_backend}; aot_eager "
                   "traces without generating code)")
    b.add_argument("--prefill-chunk", type=integer(0), default=0,
                   help="feed the prompt this many tokens at a time through the cache (bounds activation memory for "
                   "big batches; dense then runs transformers' masked SDPA for the later chunks); 0: whole prompt "
                   "(default: 0)")
    b.add_argument("--backend", default=dflt.backend, choices=("auto", "triton", "reference"),
                   help=f"passed to kascade.enable: auto (Triton on CUDA where supported, else the reference), "
                   f"triton or reference (default: {dflt.backend})")
    b.add_argument("--plan", default=None, type=plan_arg, metavar="FILE|NAME",
                   help="a Kascade plan JSON used for every selected model (it must match each one's shape), or the "
                   f"name of a shipped plan ({', '.join(SHIPPED_VARIANTS)}; only the default model has shipped plans)")
    b.add_argument("--seed", type=integer(0), default=0, help="seed of the random prompt token ids (default: 0)")
    b.add_argument("--memory-limit", type=number(0.0), default=None,
                   help="GB a configuration may use, weights included (default: the GPU's free memory plus what this "
                   "process holds; no check on CPU)")
    b.add_argument("--time-budget", type=number(0.0, low_open=False), default=dflt.time_budget_s,
                   help="seconds for the whole run, model loading included: a configuration predicted to overrun it "
                   "is skipped (from the previous one's measurements: the attention share of its prefills scaled "
                   "by length squared, the rest linearly, all by batch; its compile and capture time once); 0: no "
                   "limit "
                   f"(default: {dflt.time_budget_s:.0f})")
    b.add_argument("--out", default="kascade-bench", metavar="DIR",
                   help="output folder, created if missing; checked before any model is loaded (default: "
                   "./kascade-bench)")
    model_args(b)
    b.set_defaults(func=run_bench, parser=b)
