"""Kascade on a tensor-parallel model: every rank runs its own heads.

    torchrun --nproc-per-node 2 examples/tensor_parallel.py --model path/to/model [--plan plan.json] [--exchange]

The model (a local transformers folder) is sharded by transformers itself (``tp_plan="auto"``; NCCL on GPUs, gloo on
CPUs). A plan is global: one file serves any number of ranks. By default the plan is made shard-local for this
many ranks (each reuse head follows an anchor head that its own rank holds: nothing is exchanged); with --exchange
the plan runs as it is and the anchors' selections are all-gathered across the ranks. Every rank must be given the
same inputs; rank 0 prints the answer.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, AutoTokenizer

import kascade


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="a local transformers model folder")
    p.add_argument("--plan", default=None, help="a Kascade plan JSON (default: the shipped one, else uniform)")
    p.add_argument("--exchange", action="store_true", help="run the plan as it is, exchanging selections")
    p.add_argument("--prompt", default="Explain tensor parallelism in one sentence.")
    p.add_argument("--max-new-tokens", type=int, default=32)
    args = p.parse_args()

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(args.model, tp_plan="auto", dtype=dtype).eval()
    tok = AutoTokenizer.from_pretrained(args.model)
    size = dist.get_world_size()
    plan = kascade.KascadePlan.load(args.plan) if args.plan else kascade.default_plan(model)
    if not args.exchange:
        plan = plan.for_tensor_parallel(size)
    ids = tok(args.prompt, return_tensors="pt").to(model.device)
    with torch.no_grad(), kascade.enable(model, plan, exchange=args.exchange, warn_uncalibrated=False):
        out = model.generate(**ids, max_new_tokens=args.max_new_tokens, do_sample=False)
    if dist.get_rank() == 0:
        print(tok.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
