#!/usr/bin/env bash
# One GPU call: a per-layer-budget (ranked) plan through the Triton kernels: fidelity vs dense on held-out windows
# next to the plain searched plan (anchors + head map only), and its speed (kascade bench, dense timed in the same run).
# Usage (GPU machine, model staged; from the repository root, kascade importable):
#   bash benchmarks/ranked_check.sh MODEL.gguf OUTDIR RANKED_PLAN.json [BASE_PLAN.json]
# BASE_PLAN defaults to the shipped "searched" variant.
set -euo pipefail
MODEL=$1; OUT=$2; RANKED=$3; BASE=${4:-}
mkdir -p "$OUT"
python3 - "$MODEL" "$OUT" "$RANKED" "$BASE" <<'PY'
import json, sys, torch
from benchmarks.common.fidelity import evaluate
from kascade import KascadePlan, text
from kascade.models import load_model
from kascade.plan import shipped_plan
model, tok = load_model(sys.argv[1], device="cuda", dtype=torch.float32)
plans = {"searched": KascadePlan.load(sys.argv[4]) if sys.argv[4] else shipped_plan(model, "searched"),
         "ranked": KascadePlan.load(sys.argv[3])}
res = {}
for L, n in ((4096, 8), (8192, 5)):
    wins = text.windows(tok, "eval", L, n, seed=1)
    res[L] = {b: evaluate(model, plans, wins, b) for b in ("triton", "reference")}
    print(L, {b: {k: (round(v["agreement"], 4), round(v["kl"], 4), round(v["attended_fraction"], 4))
                  for k, v in r.items()} for b, r in res[L].items()}, flush=True)
json.dump(res, open(f"{sys.argv[2]}/ranked_fidelity_triton.json", "w"), indent=1)
PY
python3 -m kascade.cli bench --device cuda --model "$MODEL" --models default --lengths 32768 131072 --batches 1 8 \
  --plan "$RANKED" --out "$OUT/bench_ranked" --time-budget "${BENCH_BUDGET:-330}" 2>&1 | grep -E "^\| default|TTFT" | tail -8
