"""The documentation's results tables, rendered from the results files (``src/kascade/results/``) and the cost model.

A page holds a table between markers, ``<!-- results:NAME [ARG] -->`` and ``<!-- /results -->``; :func:`render`
rewrites every such block of a text from the data, and the tests require the committed pages to equal their
rendering, so every figure a page shows in a block is the results file's, at the precision shown. ``python -m
benchmarks.tables`` rewrites the README and the manual after a results file changed.
"""

from __future__ import annotations

import re
import statistics
from pathlib import Path

from kascade import Budget, KascadePlan, ModelFingerprint, costs
from kascade.plan.shipped import shipped_plans
from kascade.tensor_parallel import step_exchange_bytes

from .accuracy_tables import (anchor_adaptation, dense_tail, fp8_fidelity, fp8_fidelity_triton, fp8_selection,
                              heldout, mass_budgets, needle,
                              needle_phases, plans_accuracy, retrieval_plan)
from .cells import MODEL_NAMES, _n, _row, _sig, _table, _x, results

ROOT = Path(__file__).resolve().parents[2]
CARDS = ("h100", "h200")
MARK = re.compile(r"(<!-- results:([\w-]+)((?: [\w-]+)*) -->\n)(.*?)(<!-- /results -->)", re.S)
LLAMA = ModelFingerprint("llama", 32, 32, 8, 128)
SMOL = ModelFingerprint("llama", 30, 9, 3, 64)


def pages() -> list[Path]:
    """The Markdown files that may hold blocks: the README and the manual's pages."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def blocks(text: str) -> list[tuple[str, tuple[str, ...], str]]:
    """(name, args, body) of every block of ``text``."""
    return [(m.group(2), tuple(m.group(3).split()), m.group(4)) for m in MARK.finditer(text)]


def render(text: str) -> str:
    """``text`` with every block's body rendered from the data."""
    return MARK.sub(lambda m: m.group(1) + BLOCKS[m.group(2)](*m.group(3).split()) + "\n" + m.group(5), text)


def _bench(card: str, batch: int, length: int = 131072) -> dict:
    return _row(results(card)["bench"]["configs"], model="llama8b", batch=batch, length=length)


def card_name(card: str) -> str:
    return card.upper()


# -- speed --------------------------------------------------------------------------------------------------------
def speed_summary() -> str:
    """The README's speed table: whole model and attention alone, per card."""
    cols = [card_name(c) for c in CARDS]
    rows = [["**whole model**, 128K-token prompt, batch 1", *([""] * len(CARDS))]]
    for label, get in (
        ("time to first token (`model(...)`)", lambda c: f"{_x(_bench(c, 1)['ttft_speedup'])} faster"),
        ("time per output token (`GraphDecoder`: CUDA graphs)", lambda c: f"{_x(_bench(c, 1)['itl_speedup'])} faster"),
        ("peak memory", lambda c: f"+{100 * (_bench(c, 1)['peak_ratio'] - 1):.1f}%"),
    ):
        rows.append([label, *(get(c) for c in CARDS)])
    rows.append(["**attention alone**, 5 anchors of 32 layers", *([""] * len(CARDS))])
    for label, mode, B in (("decode, batch 32, 128K context", "decode", 32), ("prefill, batch 1, 128K prompt",
                                                                              "prefill", 1)):
        rows.append([label, *(f"{_x(_row(results(c)['kernels'][mode], model='llama-3.1-8b', B=B, N=131072)['model_speedup'])}"
                              f" faster" for c in CARDS)])
    return _table(["Llama-3.1-8B shapes, 10% of keys", *cols], rows)


def machine(card: str) -> str:
    r = results(card)
    m = r["machine"]
    k = r["kernels"]
    return (f"{r['gpu']} ({m['sms']} SMs, device copy {m['copy_TBps']:.2f} TB/s), torch {m['torch']}, triton "
            f"{m['triton']}, CUDA {m['cuda']}, cuDNN {m['cudnn']}, {m['dtype']}; kernels measured {k['measured']} at "
            f"commit {k['commit']}, the whole model {r['bench']['measured']} (transformers {r['bench']['transformers']}).")


def _order(rows):
    return sorted(rows, key=lambda r: (r["model"] != "llama-3.1-8b", r["B"], r["N"]))


def kernels(card: str, mode: str) -> str:
    rows = _order(results(card)["kernels"][mode])
    if mode == "decode":
        return _table(["model", "B", "N", "dense (us)", "reuse layer", "anchor layer", "layer 0", "model average"],
                      [[MODEL_NAMES[r["model"]], r["B"], _n(r["N"]), f"{r['dense_us']:.1f}", _x(r["reuse_x"], 3),
                        _x(r["anchor_x"]), _x(r["layer0_x"]), _x(r["model_speedup"])] for r in rows])
    return _table(["model", "B", "N", "cuDNN (ms)", "reuse layer", "anchor layer", "layer 0", "model average",
                   "anchor scratch (MB)"],
                  [[MODEL_NAMES[r["model"]], r["B"], _n(r["N"]), f"{r['cudnn_ms']:.2f}", _x(r["reuse_x"], 3),
                    _x(r["anchor_x"]), _x(r["layer0_x"]), _x(r["model_speedup"]), f"{r['anchor_extra_mb']:.1f}"]
                   for r in rows])


def bench(card: str) -> str:
    rows = []
    for c in sorted(results(card)["bench"]["configs"], key=lambda c: (c["length"], c["batch"])):
        if c["status"] != "ok":
            rows.append([c["batch"], _n(c["length"]), f"skipped: {c['reason']}", "", "", "", "", ""])
            continue
        d, k = c["dense"], c["kascade"]
        rows.append([c["batch"], _n(c["length"]), f"{d['ttft_s']:.2f} s -> {k['ttft_s']:.2f} s", _x(c["ttft_speedup"]),
                     f"{1e3 * d['itl_s']:.2f} ms -> {1e3 * k['itl_s']:.2f} ms", _x(c["itl_speedup"]),
                     f"+{100 * (c['peak_ratio'] - 1):.1f}%", f"{100 * c['attn_share_decode']:.0f}%"])
    return _table(["batch", "prompt", "time to first token, dense -> Kascade", "speedup",
                   "time per output token, dense -> Kascade", "speedup", "peak memory",
                   "attention's share of a dense decode step"], rows)


def generate(card: str) -> str:
    """Decode through transformers' generate (eager, compiled) beside GraphDecoder, dense and Kascade, per config."""
    rows = []
    for c in sorted(results(card)["bench"]["configs"], key=lambda c: (c["length"], c["batch"])):
        if c["status"] != "ok" or "generate" not in c:
            continue
        modes = [("eager `generate`", c["generate"]["eager"]), ("compiled `generate`", c["generate"]["compiled"]),
                 ("`GraphDecoder`", c)]
        for i, (mode, m) in enumerate(modes):
            d, k = m["dense"], m["kascade"]
            rows.append([c["batch"] if i == 0 else "", _n(c["length"]) if i == 0 else "", mode,
                         f"{1e3 * d['itl_s']:.2f}", f"{1e3 * k['itl_s']:.2f}", _x(m["itl_speedup"]),
                         f"{d['ttft_s']:.2f} s -> {k['ttft_s']:.2f} s" if i < 2 else "",
                         _x(m["ttft_speedup"]) if i < 2 else ""])
    return _table(["batch", "prompt", "decode", "ms per token, dense", "ms per token, Kascade", "speedup",
                   "time to first token, dense -> Kascade", "speedup"], rows)


def eager_decode(card: str) -> str:
    """One attention layer of an eager decode step (host time, back-to-back calls, CUDA-graph replay) and eager
    ``generate``'s inter-token latency, dense against Kascade, at batch 1 (``benchmarks.eager_decode``)."""
    t = results(card)["eager_decode"]
    calls = [("dense (SDPA)", "dense (SDPA)"), ("dense (transformers' SDPA function)", "dense (transformers' SDPA)"),
             ("reuse", "Kascade reuse layer"), ("anchor", "Kascade anchor layer")]
    rows = []
    for r in t["layers"]:
        for i, (key, name) in enumerate(calls):
            m = r[key]
            rows.append([_n(r["keys"]) if i == 0 else "", name, f"{m['host_us']:.0f}", f"{m['back_to_back_us']:.0f}",
                         f"{m['graph_us']:.0f}"])
    gen = [[_n(g["keys"]), f"{g['layers']} ({', '.join(map(str, g['anchors']))})", f"{g['dense_itl_ms']:.2f}",
            f"{g['kascade_itl_ms']:.2f}", _x(g["dense_itl_ms"] / g["kascade_itl_ms"])] for g in t["generate"]]
    return (_table(["keys", "call (one layer, B=1)", "host us", "back to back us", "CUDA graph us"], rows) + "\n\n"
            + _table(["keys", "eager `generate`: layers (anchors)", "ms per token, dense", "ms per token, Kascade",
                      "speedup"], gen))


# the calls of an eager decode layer the launch and head-map tables compare: results key -> row name
_EAGER_CALLS = {"reuse": "Kascade reuse layer", "anchor": "Kascade anchor layer", "sdpa": "dense (SDPA), for scale"}


def eager_launch(card: str) -> str:
    """Eager decode layers with Kascade's kernels launched through Triton's own path and directly
    (:mod:`kascade.ops.triton.launch`), alternated in one run: host us per call, and per layer of a whole step."""
    t = results(card)["eager_launch"]
    rows = [[_n(r["keys"]) if i == 0 else "", name, f"{r['triton'][k]['host_us']:.0f}",
             f"{r['direct'][k]['host_us']:.0f}", f"{r['direct'][k]['host_us'] / r['triton'][k]['host_us']:.2f}"]
            for r in t["layers"] for i, (k, name) in enumerate(_EAGER_CALLS.items())]
    ho = {p: [r for r in t["host_overhead"] if r["launch"] == p] for p in ("triton", "direct")}
    step = [[name, " / ".join(f"{r[k]:.0f}" for r in ho["triton"]), " / ".join(f"{r[k]:.0f}" for r in ho["direct"])]
            for k, name in (("layer0", "layer 0"), ("anchor", "anchor"), ("reuse", "reuse"),
                            ("sdpa_function", "dense (transformers' SDPA function)"))]
    return (_table(["keys", "call (one layer, B=1)", "host us, Triton's launch", "host us, direct", "ratio"], rows)
            + "\n\n" + _table(["a 32-layer step (4K slots)", "host us per layer, Triton's launch (2 runs)",
                                 "direct (2 runs)"], step))


def eager_head_maps(card: str) -> str:
    """Eager decoding before and after a dynamic cache's launches were kept and head maps read in place (one run
    each): one layer (rotated head maps), eager ``generate``, and a 32-layer step's host time."""
    t = results(card)["eager_head_maps"]

    def ba(r, k):
        return f"{r['before'][k]:.0f} -> {r['after'][k]:.0f}" if r.get("before") else f"- -> {r['after'][k]:.0f}"
    rows = [[_n(r["keys"]) if i == 0 else "", name, *(ba(r[k], f) for f in ("host_us", "back_to_back_us", "graph_us"))]
            for r in t["layers"] for i, (k, name) in enumerate(_EAGER_CALLS.items())]
    gen = [[_n(g["keys"]), f"{g['layers']} ({', '.join(map(str, g['anchors']))})",
            *(f"{g[w]['dense_itl_ms']:.2f} / {g[w]['kascade_itl_ms']:.2f}" for w in ("before", "after")),
            " -> ".join(_x(g[w]["dense_itl_ms"] / g[w]["kascade_itl_ms"]) for w in ("before", "after"))]
           for g in t["generate"]]
    step = [[f"{h['cache']} cache, {h['head_maps']} head maps", ba(h, "reuse"), ba(h, "anchor"), ba(h, "layer0"),
             *(f"{h[w]['step_kascade']:.0f} / {h[w]['step_dense']:.0f}" if h.get(w) else "-"
               for w in ("before", "after"))]
            for h in t["host_overhead"]]
    return (_table(["keys", "call (one layer, B=1, rotated head maps)", "host us", "back to back us", "CUDA graph us"],
                   rows) + "\n\n"
            + _table(["keys", "eager `generate`: layers (anchors)", "ms per token dense / Kascade, before",
                      "after", "speedup"], gen) + "\n\n"
            + _table(["a 32-layer step (4K keys), host us", "reuse layer", "anchor", "layer 0",
                      "step's attention Kascade / dense, before", "after"], step))


def generate_host(card: str, section: str = "generate_host") -> str:
    """Eager generate's host time per step and per call, before and after a change (``section``: the fused mask and
    step plan; ``generate_host_ranked``: ranked anchors' ordering and counts), one row a round, in the order run."""
    rows = [[r["tree"], r["process"], f"{r['dense_step_us'] / 1e3:.2f} / {r['kascade_step_us'] / 1e3:.2f}",
             _x(r["dense_step_us"] / r["kascade_step_us"]), f"{r['dense_mask_us']:.0f} / {r['mask_us']:.0f}",
             f"{r['dense_layer_us']:.0f}", f"{r['layer0_us']:.0f}", f"{r['anchor_us']:.0f}", f"{r['reuse_us']:.0f}"]
            for r in results(card)[section]["runs"]]
    return _table(["library", "process", "step ms, dense / Kascade", "speedup", "mask function us, dense / Kascade",
                   "dense layer us", "layer 0 us", "anchor us", "reuse us"], rows)


def jax() -> str:
    j = results("h200")["jax"]
    rows = []
    for r in j["rows"]:
        rows.append([MODEL_NAMES[r["shape"]], r["mode"], r["batch"], _n(r["length"]) if r["length"] >= 8192 else
                     r["length"], f"{r['jax_planned_anchor']:.0f}", f"{r['torch_planned_anchor']:.0f}",
                     _x(r["jax_planned_anchor"] / r["torch_planned_anchor"]), f"{r['jax_planned_reuse']:.0f}",
                     f"{r['torch_planned_reuse']:.0f}", _x(r["jax_planned_reuse"] / r["torch_planned_reuse"]),
                     f"{r['max_abs_difference']:g}"])
    return _table(["shape", "mode", "B", "N", "anchor, JAX (us)", "anchor, PyTorch (us)", "JAX / PyTorch",
                   "reuse, JAX (us)", "reuse, PyTorch (us)", "JAX / PyTorch", "max abs difference"], rows)


# -- the cost model -----------------------------------------------------------------------------------------------
def _bench_plan(model: str, described: str) -> tuple[KascadePlan, str]:
    if model == "llama8b":
        return KascadePlan.uniform(LLAMA, 5), "llama-3.1-8b"
    anchors = tuple(int(x) for x in described.split("[")[1].split("]")[0].split(","))
    return KascadePlan(SMOL, anchors, ((0, 1, 2),) * 30), "smollm2-135m"


def cost_model_rows() -> list[dict]:
    """Whole-model attention speedup measured by ``kascade bench`` (dense minus no attention over Kascade minus no
    attention) against the cost model's, for every configuration the kernel table covers."""
    d = results("h200")["cost_model_checks"]["whole_model"]
    out = []
    for c in (c for c in d["configs"] if c["status"] == "ok"):
        plan, shape = _bench_plan(c["model"], d["models"][c["model"]])
        for mode, key, baseline in (("decode", "itl_s", "ours"), ("prefill", "ttft_s", "best")):
            try:
                predicted = costs.plan_speedup(plan, mode, length=c["length"], batch=c["batch"], shape=shape,
                                               baseline=baseline)
            except ValueError:  # not in the kernel table (prefill is timed at B=1)
                continue
            t = {k: c[k][key] for k in ("dense", "kascade", "noattn")}
            measured = (t["dense"] - t["noattn"]) / (t["kascade"] - t["noattn"])
            out.append(dict(model=c["model"], batch=c["batch"], length=c["length"], mode=mode, measured=measured,
                            predicted=predicted))
    return out


def cost_model() -> str:
    plans = {"llama8b": "Llama-3.1-8B shapes, 5 of 32", "default": "SmolLM2-135M, 6 of 30"}
    rows = sorted(cost_model_rows(), key=lambda r: (r["model"] != "llama8b", r["batch"], r["length"], r["mode"]))
    return _table(["model, anchors", "B", "N", "mode", "measured", "modelled", "error"],
                  [[plans[r["model"]], r["batch"], _n(r["length"]), r["mode"], _x(r["measured"]), _x(r["predicted"]),
                    f"{100 * (r['predicted'] / r['measured'] - 1):+.1f}%"] for r in rows])


def _modelled(plan: KascadePlan, mode: str, **kw) -> float:
    return costs.plan_speedup(plan, mode, shape="llama-3.1-8b", length=131072, **kw)


def _shipped(name: str) -> KascadePlan:
    """The default model's shipped plan ``name``."""
    (plan,) = [p for p in shipped_plans(name) if p.fingerprint == SMOL]
    return plan


def named_plans() -> str:
    rows = []
    acc = {r["plan"]: r for r in results("accuracy")["named_plans"]["rows"]}
    for name in ("fast", "balanced", "faithful", "searched-budgets", "default"):
        plan = _shipped(name)
        w = acc[name]["windows"]
        rows.append([f"`{name}`", len(plan.anchors), _x(_modelled(plan, "decode", batch=32)),
                     _x(_modelled(plan, "prefill", batch=1)), f"{statistics.mean(x['agreement'] for x in w):.3f}",
                     f"{statistics.mean(x['kl'] for x in w):.3f}"])
    return _table(["plan", "anchors", "decode, modelled (B=32, 128K)", "prefill, modelled (B=1, 128K)",
                   "agreement at 8K", "KL at 8K"], rows)


def plan_speed() -> str:
    ps = results("h200")["plan_speed"]
    dec, pre = ps["decode"], ps["prefill"]
    rows = []
    for d in dec["plans"]:
        p = _row(pre["plans"], plan=d["plan"])
        rows.append([f"`{d['plan']}`" if d["plan"] != "dp-8" else "DP, 8 anchors (not shipped)", len(d["anchors"]),
                     _x(dec["dense_ms"] / d["ms"]), _x(d["modelled"]), _x(pre["dense_ms"] / p["ms"]),
                     _x(p["modelled"])])
    return _table(["plan", "anchors", f"decode B={dec['batch']}, {_n(dec['length'])}: measured", "modelled",
                   f"prefill B={pre['batch']}, {_n(pre['length'])}: measured", "modelled"], rows)


def fp8_speed() -> str:
    """The anchors with exact, FP8 and INT8 scoring, per shape (the H100's run of ``benchmarks.fp8_scoring``), the
    run-12 figures of the same shape (``kernels``, exact scoring, an earlier run) beside where there is one."""
    h = results("h100")
    run12 = {(k, r["model"], r["B"], r["N"]): r for k in ("prefill", "decode") for r in h["kernels"][k]}
    rows = []
    for phase in ("prefill", "decode"):
        for r in h["fp8_scoring"][phase]:
            old = run12.get((phase, r["model"], r["B"], r["N"]))
            tags = ("", "_fp8", "_int8")
            rows.append([phase, MODEL_NAMES[r["model"]], r["B"], _n(r["N"]),
                         _x(old["anchor_x"]) if old else "-", *(_x(r["anchor_x" + t]) for t in tags),
                         _x(old["model_speedup"]) if old else "-", *(_x(r["model_avg" + t]) for t in tags),
                         f"{r['kept_share']:.3f} / {r['kept_share_int8']:.3f}"])
    return _table(["phase", "shapes", "B", "N", "anchor, run 12", "anchor, exact", "anchor, FP8", "anchor, INT8",
                   "model, run 12", "model, exact", "model, FP8", "model, INT8", "keys kept: FP8 / INT8"], rows)


# -- tensor parallelism -------------------------------------------------------------------------------------------
def tp_fidelity(model: str) -> str:
    t = results("accuracy")["tensor_parallel"][model]
    rows = []
    for r in t["rows"]:
        tp = "any" if r["tensor_parallel"] == 1 else r["tensor_parallel"]
        moved = t["crossing_links"][str(r["tensor_parallel"])] if model == "tiny" else None
        rows.append([r["plan"], tp, *([f"{moved} of {t['reuse_links']}"] if model == "tiny" else []),
                     f"{r['agreement']:.4f}", f"{r['kl']:.4f}", f"{r['nll']:.4f}"])
    head = ["plan", "TP", *(["crossing links moved"] if model == "tiny" else []), "top-1 agreement", "KL (nats)", "NLL"]
    return _table(head, rows)


def tp_links() -> str:
    t = results("accuracy")["tensor_parallel"]
    d, tiny = t["default"], t["tiny"]
    rows = [[f"default model, the `{n}` plan", d["kv_heads"],
             v["reuse_links"], "-", v["crossing_links"], "-", "-"] for n, v in d["links"].items()]
    c = tiny["crossing_links"]
    rows.append(["random tiny Llama, its calibrated plan", tiny["kv_heads"], tiny["reuse_links"], c["2"], "-", c["4"],
                 c["8"]])
    return _table(["plan", "KV heads", "reuse links", "TP 2", "TP 3", "TP 4", "TP 8"], rows)


def tp_exchange() -> str:
    """What exchange=True sends per step at Llama-3.1-8B shapes (a model, not a measurement: kascade.tensor_parallel),
    next to what the step moves anyway."""
    plan = KascadePlan.uniform(LLAMA, 5)
    L, H, D, HIDDEN, BF16 = 32, 8, 128, 4096, 2
    rows = []
    for kind, B, N in (("decode", 1, 32768), ("decode", 1, 131072), ("decode", 32, 32768), ("decode", 32, 131072),
                       ("prefill", 1, 32768), ("prefill", 1, 131072)):
        q, k = (1 if kind == "decode" else N), Budget().k(N)
        for i, t in enumerate((2, 4, 8)):
            ex = step_exchange_bytes(plan, t, batch=B, keys=N, queries=q, backend="triton")
            allreduce = 2 * (t - 1) / t * B * q * HIDDEN * BF16 * 2 * L  # ring all-reduce, 2 per layer
            row = [f"{kind} B={B}, {_n(N)}" if i == 0 else "", t, _bytes(ex), _bytes(allreduce), _x(ex / allreduce, 3)]
            if kind == "decode":
                dense_kv = B * N * L * (H // t) * D * BF16 * 2
                kascade_kv = B * (H // t) * D * BF16 * (2 * N + 4 * (N + 2 * k) + 27 * 2 * k)
                row += [_bytes(dense_kv), _bytes(kascade_kv), f"{100 * ex / kascade_kv:.2f}%"]
            else:
                row += ["", "", ""]
            rows.append(row)
    return _table(["step", "TP", "exchange", "all-reduce", "exchange / all-reduce", "KV read, dense",
                   "KV read, Kascade", "exchange / KV read"], rows)


def _bytes(n: float) -> str:
    return f"{_sig(n / 1e9)} GB" if n >= 1e9 else f"{_sig(n / 1e6)} MB"


def source(name: str, section: str) -> str:
    """Where a section of a results file was measured: machine, date, command."""
    s = results(name)[section]
    text = "; ".join([*([s["machine"]] if "machine" in s else []), f"measured {s['measured']}"]) + "."
    return text + (f" Command: `{s['command']}`." if "command" in s else "")


BLOCKS = {
    "source": source,
    "speed-summary": speed_summary,
    "machine": machine,
    "kernels": kernels,
    "bench": bench,
    "generate": generate,
    "eager-decode": eager_decode,
    "eager-launch": eager_launch,
    "eager-head-maps": eager_head_maps,
    "generate-host": generate_host,
    "jax": jax,
    "cost-model": cost_model,
    "named-plans": named_plans,
    "plan-speed": plan_speed,
    "heldout-8k": heldout,
    "plans-accuracy": plans_accuracy,
    "needle": needle,
    "mass-budgets": mass_budgets,
    "anchor-adaptation": anchor_adaptation,
    "needle-phases": needle_phases,
    "dense-tail": dense_tail,
    "retrieval-plan": retrieval_plan,
    "fp8-selection": fp8_selection,
    "fp8-fidelity": fp8_fidelity,
    "fp8-fidelity-triton": fp8_fidelity_triton,
    "fp8-speed": fp8_speed,
    "tp-fidelity": tp_fidelity,
    "tp-links": tp_links,
    "tp-exchange": tp_exchange,
}
