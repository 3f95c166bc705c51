#!/usr/bin/env bash
# One GPU call: the per-layer-budget plan through the Triton kernels (fidelity vs dense on held-out windows,
# against the reference numbers in docs/variants/ship.md) and its speed against the default plan (kascade bench).
# Usage (GPU machine, model staged): bash benchmarks/ranked_check.sh /root/stage/smollm2.gguf OUTDIR
set -euo pipefail
MODEL=$1; OUT=$2
mkdir -p "$OUT"
python3 - "$MODEL" "$OUT" <<'PY'
import json, sys, torch
sys.path.insert(0, "benchmarks")
from variants import evaluate
from kascade import text
from kascade.models import load_model
from kascade.plan import shipped_plan
model, tok = load_model(sys.argv[1], device="cuda", dtype=torch.float32)
plans = {v: shipped_plan(model, v) for v in ("default", "layer-budget")}
res = {}
for L, n in ((4096, 8), (8192, 5)):
    wins = text.windows(tok, "eval", L, n, seed=1)
    res[L] = evaluate(model, plans, wins, lambda *x: None, "triton")
    print(L, {k: (round(v["agreement"], 4), round(v["kl"], 4), round(v["attended_fraction"], 4)) for k, v in res[L].items()}, flush=True)
json.dump(res, open(f"{sys.argv[2]}/ranked_fidelity_triton.json", "w"), indent=1)
PY
python3 -c "from kascade.plan import shipped_plan, SHIPPED_VARIANTS; import kascade.plan as p; from importlib import resources; print(resources.files('kascade') / 'plans' / 'layer-budget' / 'smollm2-135m-instruct.json')" > /tmp/lb_path.txt
for v in default layer-budget; do
  if [ "$v" = default ]; then PLAN=""; else PLAN="--plan $(cat /tmp/lb_path.txt)"; fi
  python3 -m kascade.cli bench --device cuda --model "$MODEL" --models default --lengths 32768 131072 --batches 1 8 \
    $PLAN --out "$OUT/bench_$v" --time-budget 150 2>&1 | grep -E "^\| default|TTFT" | tail -8
done
