"""One rank of the tensor-parallel tests (run by tests/integration/test_tensor_parallel.py under torchrun).

Every rank loads the same saved model twice, once whole and once sharded (``tp_plan="auto"``), runs the same inputs
through Kascade on both with the same plan (shard-local, and the unconstrained plan with exchange), and rank 0 writes
what it found to ``--out`` as JSON: the largest logit difference per case, whether greedy tokens agree, and the
errors the refusals raised.
"""

from __future__ import annotations

import argparse
import json
import warnings

import torch
import torch.distributed as dist


def cases(model, plan, exchange, ids, mask):
    """Logits of a left-padded prefill, a chunked prefill and greedy tokens, under Kascade (plan None: the model's
    own attention)."""
    import contextlib

    from transformers import DynamicCache

    import kascade
    from kascade.models import cache_kwargs

    out = {}
    routed = contextlib.nullcontext() if plan is None else kascade.enable(model, plan, exchange=exchange,
                                                                          warn_uncalibrated=False)
    with torch.no_grad(), routed:
        out["prefill"] = model(ids, attention_mask=mask).logits
        cache = DynamicCache()
        cut = ids.shape[1] * 2 // 3
        model(ids[:, :cut], attention_mask=mask[:, :cut], use_cache=True, **cache_kwargs(model, cache))
        out["chunked"] = model(ids[:, cut:], attention_mask=mask, use_cache=True, **cache_kwargs(model, cache)).logits
        gen = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, output_scores=True,
                             return_dict_in_generate=True)
        out["tokens"] = gen.sequences[:, ids.shape[1]:]
        out["scores"] = torch.stack(gen.scores, 1)
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True, help="a saved transformers model folder")
    p.add_argument("--plan", required=True, help="an unconstrained plan JSON (links may cross shards)")
    p.add_argument("--length", type=int, default=96)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    warnings.filterwarnings("ignore")
    from transformers import AutoModelForCausalLM

    import kascade
    from kascade import KascadePlan

    tp_model = AutoModelForCausalLM.from_pretrained(args.model, tp_plan="auto", dtype=torch.float32).eval()
    whole = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    size = dist.get_world_size()
    plan = KascadePlan.load(args.plan)
    local = plan.for_tensor_parallel(size)
    vocab = whole.config.get_text_config().vocab_size
    ids = torch.randint(3, vocab, (2, args.length), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :11] = 0  # left padding
    report = {"size": size, "crossing_links": len(plan.crossing_links(size)), "cases": {}}
    # "dense": the same comparison without Kascade, the tensor-parallel rounding alone (reductions in another order)
    for name, p, exchange in (("dense", None, False), ("shard-local", local, False), ("exchange", plan, True)):
        want, got = cases(whole, p, False, ids, mask), cases(tp_model, p, exchange, ids, mask)
        real = mask.bool()
        report["cases"][name] = {
            "prefill": (got["prefill"][real] - want["prefill"][real]).abs().max().item(),
            "chunked": (got["chunked"] - want["chunked"]).abs().max().item(),
            "scores": (got["scores"] - want["scores"]).abs().max().item(),
            "tokens_equal": bool(torch.equal(got["tokens"], want["tokens"])),
        }
    errors = {}
    try:
        kascade.enable(tp_model, plan, warn_uncalibrated=False)
    except ValueError as e:
        errors["crossing_plan"] = str(e)
    try:
        kascade.enable(whole, plan, exchange=True, warn_uncalibrated=False)
    except ValueError as e:
        errors["exchange_without_tp"] = str(e)
    report["errors"] = errors
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
