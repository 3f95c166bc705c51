"""Dense pass rates of candidate forms of the needle tasks (``kascade.eval.needle``): the trial that chose which
tasks and value forms the suite keeps (those a model answers densely in at least 80% of samples). Each spec is
``TASK:FORM:LENGTH:SAMPLES``; samples are the suite's own (``needle.generate(task, tok, length, seed, index,
form=FORM)``), answered greedily through ``kascade eval``'s session.

    python -m benchmarks.needle_forms needle_passkey:digits5:2048:10 needle_passkey:word:2048:5 \\
        needle_fact:city:2048:10 needle_multikey:digits5:2048:10 needle_multikey:city:2048:10 --out OUT

Forms: ``kascade.eval.needle.CANDIDATES`` (passkeys: digits5, digits7, word, compound, the demo's blue-harbor-7421;
facts: city, pet, number; two needles: city, or a passkey form).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from benchmarks.common import out_folder
from kascade.eval import needle
from kascade.eval.results import wilson
from kascade.eval.runner import Session
from kascade.models import load_model


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("specs", nargs="+", metavar="TASK:FORM:LENGTH:SAMPLES")
    p.add_argument("--model", default=None)
    p.add_argument("--device", default="cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="output folder (default out/needle_forms)")
    a = p.parse_args(argv)
    out = out_folder(a.out, "needle_forms")
    model, tok = load_model(a.model, device=a.device, dtype=torch.float32 if a.device == "cpu" else torch.bfloat16)
    sess = Session(model, tok, ["dense"])
    with open(out / "samples.jsonl", "a") as log:
        for spec in a.specs:
            task, form, length, n = spec.split(":")
            length, n = int(length), int(n)
            t0, passed = time.perf_counter(), 0
            for i in range(n):
                s = needle.generate(task, tok, length, a.seed, i, form=form)
                pred, _, _, secs, n_tok, _ = sess.generate("dense", s)
                sc = needle.score(s, pred)
                passed += sc == 1
                log.write(json.dumps(dict(task=task, form=form, length=length, sample=i, depth=s.meta["depth"],
                                          prompt_tokens=n_tok, answers=s.answers, prediction=pred, score=sc,
                                          seconds=secs)) + "\n")
                log.flush()
            lo, hi = wilson(passed, n)
            print(f"{task} {form} {length}: {passed}/{n} = {passed / n:.2f} [{lo:.2f}, {hi:.2f}] "
                  f"({time.perf_counter() - t0:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
