"""Record what the runtime computes, so that a change to it can be shown to change nothing.

    python -m benchmarks.runtime_equivalence record --out before.pt [--device cpu|cuda] [--dtypes fp32 bf16]
                                                    [--backend reference|triton|auto]
    python -m benchmarks.runtime_equivalence compare before.pt after.pt [--atol X]

``record`` runs the default model (SmolLM2-135M-Instruct) through ``kascade.enable`` with every shipped plan, the
uncalibrated uniform plan, a smaller ``k_min`` (so that the ratio, not the floor, sets the budget), plans with each
reuse variant (sources from any anchor, a union of two, sinks + recent, a length-aware plan) and the evaluation
baselines (Quest, StreamingLLM, OmniKV-style, shared selection), on fixed inputs from the evaluation split of
pydoc_data.topics:

- prefill: one 600-token window, logits of every position;
- chunked prefill: the same window as 400 + 200 tokens through one cache, logits of the second chunk;
- decode: after the prefill, 4 teacher-forced decode steps (fixed next tokens), logits of each;
- left-padded batch: windows of 600 and 450 tokens, left-padded, prefill + 2 decode steps.

- greedy generation: 8 new tokens by ``model.generate`` (dynamic cache) and, on CUDA, by
  :class:`~kascade.integration.graphs.GraphDecoder` (static cache, CUDA-graph replay), for the shipped plans.

Per case it stores a SHA-256 of the logits' bytes (bit-identity), their argmax at every position and the full
logits of the last 8 positions (the size of a difference); for generation, the tokens. Several dtypes are recorded
from one load of the model (``--dtypes``). ``compare`` prints, per case, whether the bytes are
equal, the argmax agreement and the largest absolute difference of the stored logits, and exits 1 on a
difference beyond ``--atol`` (0: bit-identical).
"""

from __future__ import annotations

import argparse
import hashlib
import sys

import torch

PREFILL, CHUNK = 600, 400
SHORT = 450
DECODE_STEPS = 4
KEEP = 8


def _digest(x: torch.Tensor) -> dict:
    x = x.detach().float().cpu().contiguous()
    return dict(sha=hashlib.sha256(x.numpy().tobytes()).hexdigest(), argmax=x.argmax(-1),
                tail=x.reshape(-1, x.shape[-1])[-KEEP:].clone(), shape=tuple(x.shape))


def _plans(model):
    """``{name: (plan, selector)}``: every plan and strategy the runtime must serve unchanged."""
    from kascade import KascadePlan, ModelFingerprint
    from kascade.eval.strategies import make_strategy
    from kascade.plan import shipped_plan

    fp = ModelFingerprint.from_model(model)
    searched = shipped_plan(model, "searched")
    base = searched.to_dict()
    H, n = fp.num_kv_heads, fp.num_layers

    def variant(**fields):
        d = {**base, **fields, "format": "kascade-plan/2"}
        return KascadePlan.from_dict(d)

    anchors = list(searched.anchors)
    one, two = [], []  # sources: any earlier anchor's head (one), or the union of two
    for layer in range(n):
        if layer in anchors:
            one.append([[[layer, h]] for h in range(H)])
            two.append([[[layer, h]] for h in range(H)])
            continue
        earlier = [a for a in anchors if a < layer]
        one.append([[[earlier[(layer + h) % len(earlier)], (h + layer) % H]] for h in range(H)])
        two.append([[[earlier[-1], h], [earlier[0], (h + 1) % H]] for h in range(H)])
    short = dict(base, anchors=[0, 3, 9, 15, 21, 27], head_map=[list(range(H))] * n, format="kascade-plan/1")
    plans = {
        "default": (shipped_plan(model, "default"), None),
        "searched": (searched, None),
        "faithful": (shipped_plan(model, "faithful"), None),
        "uniform": (KascadePlan.uniform(fp, 6), None),
        "default-kmin32": (shipped_plan(model, "default").with_budget(k_min=32), None),
        "faithful-fixed": (shipped_plan(model, "faithful").with_budget(rolling=False, k_min=64), None),
        "sources-one": (variant(sources=one), None),
        "sources-two": (variant(sources=two, layer_scale=[1.0] + [1.25, 0.75] * ((n - 1) // 2) + [1.0] * ((n - 1) % 2)),
                        None),
        "sinks": (variant(sinks=4, recent=0.5), None),
        "by-length": (variant(by_length=[dict(max_n=500, plan=short)]), None),
    }
    for s in ("quest", "streamingllm", "omnikv", "kascade-shared", "oracle"):
        plans[s] = make_strategy(s, model)
    return plans


@torch.no_grad()
@torch.no_grad()
def _run_cases(model, plan, selector, backend, ids, ids_short):
    from transformers import DynamicCache

    import kascade

    out = {}
    dev = next(model.parameters()).device
    with kascade.enable(model, plan, backend=backend, selector=selector, warn_uncalibrated=False):
        # prefill + teacher-forced decode
        cache = DynamicCache()
        x = ids[:, :PREFILL].to(dev)
        out["prefill"] = _digest(model(x, past_key_values=cache, use_cache=True).logits)
        for i in range(DECODE_STEPS):
            tok = ids[:, PREFILL + i : PREFILL + i + 1].to(dev)
            out[f"decode{i}"] = _digest(model(tok, past_key_values=cache, use_cache=True).logits)
        # chunked prefill
        cache = DynamicCache()
        model(x[:, :CHUNK], past_key_values=cache, use_cache=True)
        out["chunked"] = _digest(model(x[:, CHUNK:], past_key_values=cache, use_cache=True).logits)
        # left-padded batch
        pad = PREFILL - SHORT
        batch = torch.cat([x, torch.cat([torch.zeros(1, pad, dtype=x.dtype, device=dev), ids_short.to(dev)], 1)])
        mask = torch.ones_like(batch)
        mask[1, :pad] = 0
        cache = DynamicCache()
        out["padded"] = _digest(model(batch, attention_mask=mask, past_key_values=cache, use_cache=True).logits)
        for i in range(2):
            tok = ids[:, PREFILL + i : PREFILL + i + 1].to(dev).expand(2, 1)
            mask = torch.cat([mask, mask.new_ones(2, 1)], 1)
            out[f"padded-decode{i}"] = _digest(model(tok, attention_mask=mask, past_key_values=cache,
                                                     use_cache=True).logits)
    return out


@torch.no_grad()
def _generate(model, plan, backend, ids):
    import kascade

    out = {}
    with kascade.enable(model, plan, backend=backend, warn_uncalibrated=False):
        out["generate"] = model.generate(ids, max_new_tokens=8, do_sample=False)[:, ids.shape[1]:].cpu()
        if ids.device.type == "cuda":
            from kascade.integration.graphs import GraphDecoder

            out["graph"] = GraphDecoder(model, 1, ids.shape[1] + 16).generate(ids, 8).cpu()
    return out


REFUSED = "refused"  # a plan's entry when the backend refused it: {REFUSED: the error's first line}


def record(args) -> None:
    import kascade
    from kascade import text

    if args.model == "random":  # the default model's shapes (its shipped plans apply), random weights and tokens
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                          num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=8192,
                          rms_norm_eps=1e-5, tie_word_embeddings=True, rope_theta=100000.0)
        model = LlamaForCausalLM(cfg).to(args.device).eval()
        g = torch.Generator().manual_seed(0)
        wins = [torch.randint(3, 49152, (PREFILL + DECODE_STEPS,), generator=g) for _ in range(2)]
    else:
        model, tok = kascade.load_model(args.model, device=args.device, dtype=torch.float32)
        wins = text.windows(tok, "eval", PREFILL + DECODE_STEPS, 2, seed=0)
    ids, ids_short = wins[0][None], wins[1][None, :SHORT]
    result = {}
    for dtype in args.dtypes:
        model.to({"fp32": torch.float32, "bf16": torch.bfloat16}[dtype])
        plans = _plans(model)
        for name in args.only or list(plans):
            plan, selector = plans[name]
            key = name if len(args.dtypes) == 1 else f"{name}/{dtype}"
            try:
                result[key] = _run_cases(model, plan, selector, args.backend, ids, ids_short)
            except ValueError as e:  # a plan this tree's backend refuses (e.g. a baseline the kernels do not serve)
                result[key] = {REFUSED: str(e).splitlines()[0]}
                print(f"refused {key}: {result[key][REFUSED]}", flush=True)
            else:
                if name in ("default", "searched", "faithful"):
                    result[key].update(_generate(model, plan, args.backend, ids.to(args.device)))
                print(f"recorded {key}", flush=True)
            # written after every plan: a run cut short keeps what it recorded
            torch.save(dict(device=args.device, dtypes=args.dtypes, backend=args.backend, cases=result), args.out)
    print(f"wrote {args.out}")


def compare(args) -> int:
    a, b = torch.load(args.before, weights_only=False), torch.load(args.after, weights_only=False)
    worst, token_diffs = 0.0, []
    lines = ["| plan | case | bytes equal | argmax agree | max abs diff (last 8 positions) |", "|---|---|---|---|---|"]
    missing = []
    for name, cases in a["cases"].items():
        if name not in b["cases"]:
            missing.append(name)
            continue
        if REFUSED in cases or REFUSED in b["cases"][name]:  # refused by a tree: both must refuse it
            both = REFUSED in cases and REFUSED in b["cases"][name]
            if not both:
                missing.append(f"{name} (refused by one tree only)")
            lines.append(f"| {name} | (refused{' by both' if both else ' by one'}: "
                         f"{cases.get(REFUSED) or b['cases'][name].get(REFUSED)}) | - | - | - |")
            continue
        for case, x in cases.items():
            y = b["cases"][name][case]
            if not isinstance(x, dict):  # generated tokens
                same = torch.equal(x, y)
                if not same:
                    token_diffs.append(f"{name} {case}: {x.tolist()} vs {y.tolist()}")
                if not same or args.verbose:
                    lines.append(f"| {name} | {case} (tokens) | {same} | {(x == y).float().mean().item():.4f} | - |")
                continue
            same = x["sha"] == y["sha"]
            agree = (x["argmax"] == y["argmax"]).float().mean().item()
            diff = (x["tail"] - y["tail"]).abs().max().item()
            worst = max(worst, diff if not same else 0.0)
            if not same or args.verbose:
                lines.append(f"| {name} | {case} | {same} | {agree:.4f} | {diff:.3g} |")
    n = sum(len(c) for c in a["cases"].values())
    print("\n".join(lines))
    print(f"{n} cases; largest difference {worst:.3g}" + (f"; missing plans: {missing}" if missing else "")
          + (f"; generated tokens differ in {len(token_diffs)}" if token_diffs else ""))
    return 0 if worst <= args.atol and not missing and (args.atol > 0 or not token_diffs) else 1


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("record", help="run every plan on the fixed inputs and save digests")
    r.add_argument("--out", required=True)
    r.add_argument("--device", default="cpu")
    r.add_argument("--model", default=None, help="the default model's GGUF file (default: the installed one), or "
                   "'random': its shapes with random weights and tokens")
    r.add_argument("--dtypes", nargs="+", default=["fp32"], choices=("fp32", "bf16"))
    r.add_argument("--backend", default="reference", choices=("reference", "triton", "auto"))
    r.add_argument("--only", nargs="*", default=None, help="record only these plans")
    c = sub.add_parser("compare", help="compare two recordings")
    c.add_argument("before")
    c.add_argument("after")
    c.add_argument("--atol", type=float, default=0.0, help="largest difference accepted (default 0: bit-identical)")
    c.add_argument("--verbose", action="store_true", help="list equal cases too")
    args = p.parse_args(argv)
    if args.cmd == "record":
        record(args)
        return 0
    return compare(args)


if __name__ == "__main__":
    sys.exit(main())
