"""Where eager ``generate``'s decode steps spend the host's time, dense against Kascade, inside transformers' own
``generate`` (not a benchmark's loop): per step, the mask function, the attention function of each layer kind, the
whole forward and the whole step.

    python -m benchmarks.generate_host [--length 32768] [--layers 8] [--anchors 2] [--steps 40] [--rounds 2]
                                       [--head-maps rotated] [--budgets per-layer] [--profile] [--out DIR] [--quick]

A random-weight Llama at Llama-3.1-8B's shapes (``--layers`` layers, bf16 on a GPU; ``--quick``: tiny shapes, fp32 on
a CPU, the reference backend there), one prompt of ``--length`` tokens, greedy ``generate`` of ``--steps`` tokens over
transformers' default dynamic cache, dense (its SDPA) and Kascade (the bench's uniform plan with ``--anchors`` anchors,
Triton backend on a GPU) alternated ``--rounds`` times. Each call is timed on the host (``perf_counter`` around
it: what the host spends before it moves on; the GPU runs behind): the mask function once per step, the attention
function per layer (layer 0, the other anchors, the reuse layers, or dense), the model's forward, and the step
(between two tokens' stopping-criteria calls). Medians per call over the steps after the first 10; ``per step``: the
mean of a step's calls. What the step spends outside the forward is ``generate``'s own work (logits processing,
stopping criteria, the cache's growth is inside the forward).

``--profile``: also a cProfile of ten of Kascade's decode steps (the slowest functions by own time, then
kascade's by cumulative time), in ``profile.txt``.

Writes generate_host.json and summary.md into --out (default out/generate_host).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import functools
import io
import json
import pstats
import statistics
import time

from benchmarks.common import out_folder
from benchmarks.common.plans import add_plan_options, uniform_plan

SKIP = 10  # decode steps left out of the medians (prefill and warm-up)


def _parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--length", type=int, default=32768, help="prompt tokens (default 32768)")
    p.add_argument("--layers", type=int, default=8, help="layers of the random model (default 8)")
    p.add_argument("--anchors", type=int, default=2, help="anchors of the uniform plan, layer 0 included (default 2)")
    p.add_argument("--steps", type=int, default=40, help="generated tokens per run (default 40; > 12)")
    p.add_argument("--rounds", type=int, default=2, help="dense / Kascade alternations (default 2)")
    add_plan_options(p, head_maps="rotated")
    p.add_argument("--profile", action="store_true", help="a cProfile of ten Kascade decode steps (profile.txt)")
    p.add_argument("--out", default=None, help="output folder (default out/generate_host)")
    p.add_argument("--quick", action="store_true", help="tiny shapes on this machine's device: a smoke run")
    a = p.parse_args(argv)
    if a.steps <= SKIP + 2:
        p.error(f"--steps must be > {SKIP + 2} (the first {SKIP} steps are not timed)")
    return a


class _Clock:
    """Host time of calls, by kind."""

    def __init__(self):
        self.calls: dict[str, list[float]] = {}

    def wrap(self, kind_of, fn):
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            t = time.perf_counter()
            out = fn(*args, **kwargs)
            self.calls.setdefault(kind_of(args), []).append((time.perf_counter() - t) * 1e6)
            return out
        return timed


@contextlib.contextmanager
def _timed_functions(clock: _Clock, anchors: set):
    """Dense's and Kascade's attention and mask functions, and Kascade's registration of them, timed by ``clock``."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from kascade.integration import functions

    def layer_kind(args):
        layer = args[0].layer_idx
        return "layer 0" if layer == 0 else "anchor" if layer in anchors else "reuse"

    saved = [(ALL_ATTENTION_FUNCTIONS._global_mapping, "sdpa"), (ALL_MASK_ATTENTION_FUNCTIONS._global_mapping, "sdpa"),
             (vars(functions), "kascade_attention_forward"), (vars(functions), "kascade_mask")]
    old = [d[k] for d, k in saved]
    kinds = [lambda a: "dense", lambda a: "mask", layer_kind, lambda a: "mask"]
    try:
        for (d, k), fn, kind in zip(saved, old, kinds):
            d[k] = clock.wrap(kind, fn)
        yield
    finally:
        for (d, k), fn in zip(saved, old):
            d[k] = fn


class _Stamps:
    """A stopping criterion that stamps the host's time at every token (and never stops)."""

    def __init__(self, on_step=None):
        self.t: list[float] = []
        self.on_step = on_step

    def __call__(self, input_ids, scores, **kwargs):
        import torch

        self.t.append(time.perf_counter())
        if self.on_step is not None:
            self.on_step(len(self.t))
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def _run(model, ids, steps: int, clock: _Clock, per_step: dict) -> dict:
    import torch

    kw = dict(attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=0, max_new_tokens=steps,
              min_new_tokens=steps)
    model.generate(ids, **kw)  # warm-up: compiles, allocates
    clock.calls.clear()
    stamps = _Stamps()
    out = model.generate(ids, stopping_criteria=[stamps], **kw)
    gaps = [(b - a) * 1e6 for a, b in zip(stamps.t[SKIP:], stamps.t[SKIP + 1:])]
    r = {"step_us": statistics.median(gaps), "tokens": out[0, ids.shape[1]:].tolist()}
    for kind, xs in clock.calls.items():
        n = per_step[kind]
        xs = xs[n * (SKIP + 1):]  # prefill's call(s) and the first steps
        r[kind] = {"median_us": statistics.median(xs), "per_step_us": sum(xs) / (len(xs) / n), "per_step": n}
    return r


def _profile(model, ids) -> str:
    import torch

    prof = cProfile.Profile()

    def on_step(i):
        if i == 4:
            prof.enable()
        elif i == 14:
            prof.disable()

    model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=0, max_new_tokens=16,
                   min_new_tokens=16, stopping_criteria=[_Stamps(on_step)])
    text = []
    for sort, restrict in (("tottime", (30,)), ("cumtime", ("kascade", 40))):
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats(sort).print_stats(*restrict)
        text.append(s.getvalue())
    return "\n".join(text)


def main(argv=None) -> dict:
    a = _parse(argv)
    import torch

    import kascade
    from kascade.bench.models import LLAMA8B, TINY, random_llama
    from kascade.bench.timing import prompt
    from kascade.plan import ModelFingerprint

    dev = torch.device("cuda" if torch.cuda.is_available() and not a.quick else "cpu")
    shapes = dict(TINY if a.quick else LLAMA8B) | {"num_hidden_layers": 4 if a.quick else a.layers}
    length = 96 if a.quick else a.length
    steps = SKIP + 4 if a.quick else a.steps
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    model = random_llama(shapes, device=str(dev), dtype=dtype, max_positions=length + steps + 64)
    plan = uniform_plan(ModelFingerprint.from_model(model), a.anchors, a.head_maps, a.budgets)
    backend = "triton" if dev.type == "cuda" else "reference"
    ids = prompt(1, length, shapes["vocab_size"], 0, dev)
    anchors = set(plan.anchors)
    n = shapes["num_hidden_layers"]
    per_step = {"mask": 1, "dense": n, "layer 0": 1, "anchor": len(anchors) - 1, "reuse": n - len(anchors),
                "forward": 1}
    clock = _Clock()
    result = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
              "versions": {"torch": torch.__version__, "transformers": __import__("transformers").__version__},
              "length": length, "layers": n, "anchors": sorted(anchors), "head_maps": a.head_maps, "budgets": a.budgets,
              "steps": steps,
              "backend": backend, "runs": []}
    out = out_folder(a.out, "generate_host")
    model.forward = clock.wrap(lambda args: "forward", model.forward)  # generate calls the instance's forward
    with torch.no_grad(), _timed_functions(clock, anchors):
        for _ in range(a.rounds):
            dense = _run(model, ids, steps, clock, per_step)
            with kascade.enable(model, plan, backend=backend, warn_uncalibrated=False):
                sparse = _run(model, ids, steps, clock, per_step)
                if a.profile and not result["runs"]:
                    (out / "profile.txt").write_text(_profile(model, ids))
            result["runs"].append({"dense": dense, "kascade": sparse})
    del model.forward
    (out / "generate_host.json").write_text(json.dumps(result, indent=1))
    (out / "summary.md").write_text(summary(result))
    print(summary(result))
    return result


def summary(result: dict) -> str:
    head = (f"eager generate, host time (us), {result['device']}, {result['length']} tokens, {result['layers']} layers, "
            f"anchors {result['anchors']}, {result['head_maps']} head maps, "
            f"{result.get('budgets', 'uniform')} budgets, {result['backend']} backend")
    lines = [head, "", "| round | path | step | forward | mask fn | layer 0 | anchor | reuse | dense layer |",
             "|---|---|---|---|---|---|---|---|---|"]
    for i, run in enumerate(result["runs"]):
        for path in ("dense", "kascade"):
            r = run[path]

            def cell(kind):
                return f"{r[kind]['median_us']:.0f} ({r[kind]['per_step_us']:.0f})" if kind in r else "-"
            lines.append(f"| {i} | {path} | {r['step_us']:.0f} | {cell('forward')} | {cell('mask')} | "
                         f"{cell('layer 0')} | {cell('anchor')} | {cell('reuse')} | {cell('dense')} |")
    lines += ["", "a call's median (in brackets: per step, all calls of that kind); step: between two tokens"]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
