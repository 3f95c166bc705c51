"""`kascade eval`: accuracy of Kascade against dense and other sparse methods (:mod:`kascade.eval.runner`)."""

from __future__ import annotations

from .settings import build
from .types import csv_of, file, integer, model_args, number, plan_arg, positive


def settings(args):
    """The evaluation's :class:`~kascade.eval.runner.Settings` from the options: every field is the option of its
    name."""
    from ..eval import runner

    return build(runner.Settings, args)


def run(args) -> int:
    from ..eval import runner
    from ..eval.results import ROWS

    s = settings(args)
    r = runner.evaluate(s)
    print()
    print(r["markdown"])
    print("wrote " + ", ".join(str(f) for f in r["files"]) + f" ({len(r['rows'])} rows in "
          f"{s.out}/{ROWS})")
    return 0


def add(sub) -> None:
    from ..plan import SHIPPED_VARIANTS
    from ..eval.results import ROWS
    from ..eval import needle
    from ..eval.runner import MIN_RULER_LENGTH, SAMPLES, TASKS
    from ..eval.strategies import STRATEGIES

    e = sub.add_parser(
        "eval",
        help="accuracy of Kascade against dense, the oracle and other sparse methods at the same budget",
        description="Runs each strategy on each task through the same attention path and budget. Tasks: "
        "'fidelity' (teacher-forced top-1 agreement, KL and NLL against dense on held-out pydoc_data windows, or "
        "on your own text with --data; score = agreement) and RULER-style generated tasks (needle in a haystack: "
        "single number / word, multikey, multivalue, multiquery; variable tracking; common and frequent words "
        "extraction; score = RULER string match; small models fail them even densely), the needle tasks in "
        "kascade demo's chat format, which the default model answers densely at 2K and 4K tokens (needle_passkey: "
        "a five-digit passphrase; needle_fact: a person's home city; needle_multikey: two people's home cities, one "
        "asked, the other's in the answer scores 0; sample i's needle at depth (i mod 5) / 4 of the haystack, "
        "jittered; haystacks from pydoc_data's evaluation split; score = the value found in the answer), plus "
        "LongBench-format files (--longbench). Every score is reported with its 95% confidence interval (Wilson for "
        "pass / fail scores, the normal approximation for fractional ones) and dense's score beside every strategy's. "
        "Strategies: dense; "
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
                   f"long, needle prompts (chat-formatted) at most this long (at least {MIN_RULER_LENGTH}) "
                   "(default: 2048)")
    e.add_argument("--samples", type=positive(), default=None,
                   help="samples per task and length: windows of the fidelity text, generated prompts (default: "
                   f"{needle.SAMPLES} for the needle tasks, a confidence interval at most about +-0.1 wide, "
                   f"{SAMPLES} for the others)")
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
    e.add_argument("--mass", type=number(0.0, 1.0), default=None,
                   help="keep keys by attention mass, for every strategy: each row (KV head and query tile, or "
                   "decode query) keeps the fewest of its best keys holding this share of its pooled attention, in "
                   "(0, 1], at least --k-min and at most --ratio's count (default: each plan's own: by count); runs "
                   "on the reference backend")
    e.add_argument("--score-dtype", choices=("fp8", "int8"), default=None,
                   help="how the anchor layers score keys to rank them, for every strategy: fp8 rounds each query "
                   "and key vector to e4m3 (8-bit floats) with a power-of-two scale of its own, int8 to 8-bit "
                   "integers with a scale of its own (max|x| / 127), before the scores whose pooled probabilities "
                   "pick the keys; layer 0 and every attention output stay exact (default: each plan's own: exact "
                   "scores)")
    e.add_argument("--dense-tail", type=int, default=None, metavar="TOKENS",
                   help="in every prefill, the prompt's last TOKENS queries attend every key in every layer, for "
                   "every strategy (the question and the chat template's turn marks; 32 is one tile); >= 0 "
                   "(default: each plan's own, 0 for the shipped plans)")
    e.add_argument("--backend", choices=("auto", "reference", "triton"), default="auto",
                   help="Kascade's implementation for every strategy: auto (the Triton kernels on CUDA where they "
                   "serve the model and the budget, else the PyTorch reference), reference (the specification, any "
                   "device) or triton (refused before the weights are read where it cannot run); each generated row "
                   "records the one that ran (default: auto)")
    e.add_argument("--batch-size", type=positive(), default=1, metavar="N",
                   help="answer up to N generated samples of one task and length at once, left-padded in one batch "
                   "(much faster on a GPU, where one sample's decoding waits on the host); each answer is the one "
                   "the sample gets alone, up to the rounding of the batch's arithmetic (bf16 on a GPU), and a "
                   "row's attended fraction is its batch's (default: 1)")
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
    e.set_defaults(func=run, parser=e)
