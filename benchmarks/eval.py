"""Issue 4's table: every strategy on fidelity and RULER-style tasks, one length at a time (results are written
after each length, so a run cut short keeps what it finished).

    python benchmarks/eval.py --model /root/stage/smollm2.gguf --device cuda --lengths 8192 4096 2048 --out $OUT
"""

from __future__ import annotations

import argparse
import platform
from pathlib import Path

import torch
import transformers

from kascade.eval import results, runner
from kascade.eval.strategies import STRATEGIES
from kascade.models import load_model


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--device", default="cuda")
    p.add_argument("--lengths", type=int, nargs="+", default=[8192, 4096, 2048])
    p.add_argument("--tasks", nargs="+", default=["fidelity", "niah_single_number", "niah_multikey", "variable_tracking"])
    p.add_argument("--strategies", nargs="+", default=list(STRATEGIES))
    p.add_argument("--samples", type=int, default=2)
    p.add_argument("--out", default="out/eval")
    a = p.parse_args()
    model, tok = load_model(a.model, device=a.device, dtype=torch.float32)
    dev = torch.cuda.get_device_name() if a.device.startswith("cuda") else f"CPU ({platform.machine()})"
    header = (f"machine: {dev}; torch {torch.__version__}; transformers {transformers.__version__}; "
              f"SmolLM2-135M-Instruct fp32; budget ratio 0.10, k_min 128, tile 32, rolling; shipped calibrated plan; "
              f"{a.samples} samples per task and length, seed 0")
    rows = []
    for L in a.lengths:
        rows += runner.run(model, tok, strategies=a.strategies, tasks=a.tasks, lengths=[L], samples=a.samples,
                           progress=False)
        r = results.write(rows, Path(a.out), header)
        print(f"--- after length {L}\n{r['markdown']}", flush=True)


if __name__ == "__main__":
    main()
