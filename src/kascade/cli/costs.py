"""`kascade costs`: measure the kernel times of the cost model on this GPU (:mod:`kascade.costs_measure`)."""

from __future__ import annotations

from .types import device, number, positive


def run(args) -> int:
    from .. import costs_measure as cm

    cm.check_out(args.out)  # before the model's config or any tensor is read
    shape = cm.model_shape(args.model) if args.model else cm.shape_named(args.shape or "llama-3.1-8b")
    cm.measure(args.out, shape, modes=tuple(dict.fromkeys(args.modes)), batches=args.batches,
               lengths=tuple(args.lengths), ratio=args.ratio, k_min=args.k_min, device=args.device,
               backend=args.backend)
    print(f"\nwrote {args.out}; use it with: kascade calibrate --cost-table {args.out} --target-speedup X ...")
    return 0


def add(sub) -> None:
    from .. import costs
    from ..costs_measure import DEFAULT_LENGTHS

    c = sub.add_parser(
        "costs",
        help="measure the attention kernel times that model --target-speedup, on this GPU",
        description="Times one attention layer of each kind with random inputs on --device: dense (the faster of "
        "torch SDPA and Kascade's dense kernel), layer 0 (dense + selection), an anchor (selection + sparse "
        "attention) and a reuse layer (sparse attention), for every --modes, --batches and --lengths, at the "
        "--ratio budget, and writes them to --out in the format of the shipped H200 table (the costs table of "
        "kascade/results/h200.json). kascade calibrate --cost-table FILE --target-speedup X then models the "
        "speedup with them. The output file "
        "is checked before anything runs, every configuration prints one line, and the file is rewritten after "
        "each one, so an interrupted run keeps what it measured. A configuration that does not fit the free "
        "memory is skipped and its reason recorded. On a CPU the times are for testing only (the file says so).",
    )
    c.add_argument("--out", required=True, metavar="FILE",
                   help="the JSON file to write (its folder is made; an existing file is replaced)")
    g = c.add_mutually_exclusive_group()
    g.add_argument("--model", default=None, metavar="PATH",
                   help="measure the attention shape (query heads, KV heads, head dim) of this local transformers "
                   "model folder, read from its config.json (default: --shape)")
    g.add_argument("--shape", default=None, metavar="NAME",
                   help=f"the attention shape to measure instead of a --model's: one of {', '.join(costs.shapes())} "
                   f"or HQ,H,D, e.g. 32,8,128 (default: {costs.DEFAULT_SHAPE})")
    c.add_argument("--modes", nargs="+", default=list(costs.MODES), choices=costs.MODES,
                   help=f"decode (one query per sequence), prefill (a whole prompt) or both (default: "
                   f"{' '.join(costs.MODES)})")
    c.add_argument("--batches", nargs="+", type=positive(), default=None, metavar="B",
                   help="sequences per call (default: decode 32, prefill 1: what --target-speedup models)")
    c.add_argument("--lengths", nargs="+", type=positive(), default=list(DEFAULT_LENGTHS), metavar="N",
                   help="context lengths in tokens; --target-speedup models 131072, else the longest measured "
                   f"(default: {' '.join(map(str, DEFAULT_LENGTHS))})")
    c.add_argument("--ratio", type=number(0.0, 1.0), default=0.1,
                   help="the budget the sparse kernels are timed at: fraction of the keys each query attends, in "
                   "(0, 1]; other budgets are modelled in proportion (default: 0.1)")
    c.add_argument("--k-min", type=positive(), default=128,
                   help="the budget's floor on the keys attended (default: 128)")
    c.add_argument("--device", default="cuda", type=device,
                   help="where to measure: cuda / cuda:N (bf16), or cpu (fp32, for testing) (default: cuda)")
    c.add_argument("--backend", default="auto", choices=("auto", "reference", "triton"),
                   help="Kascade's ops: triton (the kernels), reference (pure PyTorch) or auto (triton on CUDA "
                   "where it can run, else reference) (default: auto)")
    c.set_defaults(func=run, parser=c)
