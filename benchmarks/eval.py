"""Every evaluation strategy on fidelity and RULER-style tasks, one length at a time (results are written after each
length, so a run cut short keeps what it finished). ``kascade eval`` runs the same code for any model.

    python -m benchmarks.eval --model MODEL.gguf --device cuda --lengths 8192 4096 2048 --out OUT
"""

from __future__ import annotations

import argparse
import platform

import torch
import transformers

from benchmarks.common import out_folder
from kascade.eval import results, runner
from kascade.eval.strategies import STRATEGIES
from kascade.models import load_model


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--device", default="cuda")
    p.add_argument("--lengths", type=int, nargs="+", default=[8192, 4096, 2048])
    p.add_argument("--tasks", nargs="+", default=["fidelity", "niah_single_number", "niah_multikey", "variable_tracking"])
    p.add_argument("--strategies", nargs="+", default=list(STRATEGIES))
    p.add_argument("--samples", type=int, default=2)
    p.add_argument("--out", default=None, help="output folder (default out/eval)")
    a = p.parse_args(argv)
    out = out_folder(a.out, "eval")
    model, tok = load_model(a.model, device=a.device, dtype=torch.float32)
    dev = torch.cuda.get_device_name() if a.device.startswith("cuda") else f"CPU ({platform.machine()})"
    header = (f"machine: {dev}; torch {torch.__version__}; transformers {transformers.__version__}; "
              f"SmolLM2-135M-Instruct fp32; budget ratio 0.10, k_min 128, tile 32, rolling; shipped calibrated plan; "
              f"{a.samples} samples per task and length, seed 0")
    rows = []
    for L in a.lengths:
        rows += runner.run(model, tok, strategies=a.strategies, tasks=a.tasks, lengths=[L], samples=a.samples,
                           progress=False)
        r = results.write(rows, out, header)
        print(f"--- after length {L}\n{r['markdown']}", flush=True)


if __name__ == "__main__":
    main()
