"""The tensor-parallel benchmark's report: the machine, results.json, results.md and results.png."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
from pathlib import Path

import torch

from .report import T0, log
from .tp_env import MULTICAST_OFF
from .tp_model import MODES_ONE, MODES_TP, Ranks


# -- results -------------------------------------------------------------------------------------------------------
def machine_info(ranks: Ranks) -> dict:
    from kascade.bench.report import cpu_name, environment

    info = dict(environment(str(ranks.device)), host=socket.gethostname(), cpu=cpu_name(), cpu_count=os.cpu_count(),
                device=ranks.device.type, ranks=ranks.world, env={k: os.environ.get(k) for k in MULTICAST_OFF})
    try:
        info["kascade_commit"] = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                                                cwd=Path(__file__).parent, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        info["kascade_commit"] = None
    if ranks.cuda:
        info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        try:
            info["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception:  # noqa: BLE001
            info["nccl"] = None
        try:
            topo = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=20)
            info["nvidia_smi_topo"] = topo.stdout.strip() or topo.stderr.strip()
        except (OSError, subprocess.SubprocessError) as e:
            info["nvidia_smi_topo"] = f"unavailable: {e}"
    else:
        info["torch_threads"] = torch.get_num_threads()
    return info


def config_entry(results: dict, batch: int, length: int) -> dict:
    for c in results["configs"]:
        if c["batch"] == batch and c["length"] == length:
            return c
    c = dict(batch=batch, length=length, tp={}, one_gpu={})
    results["configs"].append(c)
    results["configs"].sort(key=lambda e: (e["batch"], e["length"]))
    return c


def fmt_len(n: int) -> str:
    return f"{n // 1024}K" if n % 1024 == 0 and n >= 1024 else str(n)


def _t(r: dict | None, key: str, scale: float = 1.0, digits: int = 3) -> str:
    return f"{r[key] * scale:.{digits}f}" if r and r.get(key) is not None else ""


def _ratio(base: dict | None, r: dict | None, key: str) -> str:
    if not base or not r or not base.get(key) or not r.get(key):
        return ""
    return f"{base[key] / r[key]:.2f}x"


def markdown(res: dict) -> str:
    m, s = res["machine"], res["settings"]
    tp = m["ranks"]
    if m.get("gpus"):
        dev = f"{', '.join(sorted(set(m['gpus'])))} x{len(m['gpus'])} ({m['gpu_memory_gb']:.0f} GiB each)"
    else:
        dev = f"{m.get('cpu', 'CPU')}, {m['cpu_count']} cores, {m['torch_threads']} torch thread(s) per rank"
    lines = [f"# Tensor-parallel Kascade ({tp} ranks) against one device", "",
             f"Machine: {dev}; torch {m['torch']}, triton {m['triton']}, transformers "
             f"{m['transformers']}" + (f", CUDA {m.get('cuda')}, NCCL {m.get('nccl')}" if m.get("gpus") else "") +
             f"; Python {m['python']}; {res['status']}, {res.get('elapsed_s', 0):.0f} s.",
             f"Model: {res['model']['description']}; plan: {res['plan']['source']} (anchors "
             f"{res['plan']['anchors']}, ratio {res['plan']['ratio']}, k_min {res['plan']['k_min']}, tile "
             f"{res['plan']['tile']}; {res['plan']['crossing_links']} links cross the ranks, shard-local form: 0).",
             f"Timing: median of up to {s['repeats']} prefills (--repeat-budget {s['repeat_budget']} s), ITL median "
             f"of {s['decode_steps']} decode steps; times of rank 0.", ""]
    if res["correctness"]:
        lines += ["## Correctness: tensor parallel against one process, same plan", "",
                  "| N | mode (TP) | against (one process) | max logit diff | logit scale | greedy tokens equal | "
                  "differing (near ties) | passed |", "|---|---|---|---|---|---|---|---|"]
        for c in res["correctness"]:
            if "error" in c:
                lines.append(f"| {c['length']} | {c['mode']} | | error: {c['error'][:120]} | | | | no |")
                continue
            lines.append(f"| {c['length']} | {c['mode']} | {c['reference']} | {c['max_logit_diff']:.3g} | "
                         f"{c['logit_scale']:.3g} | {'yes' if c['tokens_equal'] else 'no'} | {c['mismatches']} "
                         f"({c['near_ties']}) | {'yes' if c['passed'] else '**no**'} |")
        lines.append("")
    if res["exchange_bytes_check"]:
        lines += ["Exchange bytes one rank received, counted during the checks, against "
                  "`step_exchange_bytes`:", "", "| N | forward | counted | model | equal |", "|---|---|---|---|---|"]
        for e in res["exchange_bytes_check"]:
            lines.append(f"| {e['length']} | {e['forward']} | {e['counted']} | {e['model']} | "
                         f"{'yes' if e['counted'] == e['model'] else 'no'} |")
        lines.append("")
    lines += ["## Speed", "", "| B | N | setup | mode | TTFT (s) | TTFT vs dense | ITL (ms) | ITL vs dense | decode | "
              "peak GB / device | note |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in res["configs"]:
        for setup, modes, label in (("tp", MODES_TP, f"TP {tp}"), ("one_gpu", MODES_ONE, "1 device")):
            runs = c[setup]
            if c.get(f"{setup}_skipped"):
                lines.append(f"| {c['batch']} | {fmt_len(c['length'])} | {label} | | | | | | | | skipped: "
                             f"{c[f'{setup}_skipped']} |")
                continue
            base = runs.get("dense")
            for mode in modes:
                r = runs.get(mode)
                if r is None:
                    continue
                if "error" in r:
                    lines.append(f"| {c['batch']} | {fmt_len(c['length'])} | {label} | {mode} | | | | | | | "
                                 f"error: {r['error'][:150]} |")
                    continue
                peak = [p for p in (r.get("peak_gb_ranks") or [r.get("peak_gb")]) if p is not None]
                lines.append(f"| {c['batch']} | {fmt_len(c['length'])} | {label} | {mode} | {_t(r, 'ttft_s')} | "
                             f"{_ratio(base, r, 'ttft_s')} | {_t(r, 'itl_s', 1e3, 2)} | {_ratio(base, r, 'itl_s')} | "
                             f"{r.get('decode', '')} | {'/'.join(f'{p:.1f}' for p in peak)} | "
                             f"{('graph failed: ' + r['graph_error'][:80]) if r.get('graph_error') else ''} |")
    lines += ["", f"## TP {tp} against one device (same mode; > 1x: tensor parallel is faster)", "",
              "| B | N | mode (one device / TP) | TTFT | ITL |", "|---|---|---|---|---|"]
    for c in res["configs"]:
        for one, tpm in (("dense", "dense"), ("kascade", "shard-local"), ("kascade", "exchange")):
            a, b = c["one_gpu"].get(one), c["tp"].get(tpm)
            if a and b and "error" not in a and "error" not in b:
                lines.append(f"| {c['batch']} | {fmt_len(c['length'])} | {one} / {tpm} | {_ratio(a, b, 'ttft_s')} | "
                             f"{_ratio(a, b, 'itl_s')} |")
    lines += ["", "## The exchange's cost per decode step", "",
              f"Model: `step_exchange_bytes` (bytes one rank receives per step; static cache: `k(capacity)` keys per "
              f"row on the Triton path) over an assumed {s['link_gbps']:g} GB/s per direction (bandwidth only, no "
              "latency). Alone: the step's all-gathers of random indices of those shapes, back to back. Difference: "
              "ITL(exchange) - ITL(shard-local).", "",
              "| B | N | bytes / rank (model) | counted (first eager step) | model time (us) | alone (us) | "
              "alone GB/s | ITL difference (us) |", "|---|---|---|---|---|---|---|---|"]
    for c in res["configs"]:
        e = c.get("exchange_cost")
        if not e:
            continue
        alone = e.get("alone") or {}
        diff = e.get("itl_difference_s")
        lines.append(f"| {c['batch']} | {fmt_len(c['length'])} | {e['model_bytes']} | {e.get('counted_bytes', '')} | "
                     f"{e['model_seconds'] * 1e6:.3g} | "
                     f"{_t(alone, 'seconds_per_step', 1e6, 1)} | {_t(alone, 'effective_gbps', 1, 1)} | "
                     f"{'' if diff is None else f'{diff * 1e6:.1f}'} |")
    return "\n".join(lines) + "\n"


def plot(res: dict, path: Path) -> bool:
    """TTFT (top) and ITL (bottom) against the prompt length, one column per batch size, one line per setup and
    mode (tensor parallel solid, one device dotted)."""
    try:
        from kascade.plots import pyplot

        plt = pyplot()
    except ImportError:
        return False
    tp = res["machine"]["ranks"]
    lines = [("tp", m, f"TP {tp} {m}", "-") for m in MODES_TP] + [("one_gpu", m, f"1 device {m}", ":")
                                                                  for m in MODES_ONE]
    colors = {"dense": "tab:gray", "shard-local": "tab:blue", "exchange": "tab:orange", "kascade": "tab:green"}
    batches = sorted({c["batch"] for c in res["configs"]}) or [1]
    fig, axes = plt.subplots(2, len(batches), figsize=(5 * len(batches) + 1, 7), squeeze=False)
    for col, batch in enumerate(batches):
        for setup, mode, label, style in lines:
            pts = sorted((c["length"], c[setup][mode]) for c in res["configs"] if c["batch"] == batch
                         and "ttft_s" in c[setup].get(mode, {}) and "itl_s" in c[setup].get(mode, {}))
            if not pts:
                continue
            xs = [n for n, _ in pts]
            for row, key, scale in ((0, "ttft_s", 1.0), (1, "itl_s", 1e3)):
                axes[row][col].plot(xs, [r[key] * scale for _, r in pts], style, marker="o", color=colors[mode],
                                    label=label)
        for row, title in ((0, "TTFT (s)"), (1, "ITL (ms)")):
            ax = axes[row][col]
            ax.set_xscale("log", base=2)
            lengths = sorted({c["length"] for c in res["configs"]})
            ax.set_xticks(lengths, [fmt_len(n) for n in lengths])
            ax.minorticks_off()
            ax.set_title(f"{title}, batch {batch}")
            ax.set_xlabel("prompt length (tokens)")
            ax.grid(True, alpha=0.3)
            if ax.lines:
                ax.legend(fontsize=7)
    fig.suptitle(f"Kascade under tensor parallelism: {res['model']['description']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


_PLOTTED: list = [None]  # the timings the last results.png shows


def write(res: dict, out: Path) -> None:
    """results.json, results.md and (when the timings changed since it was last drawn) results.png."""
    res["elapsed_s"] = time.perf_counter() - T0
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / "results.json.tmp"
    tmp.write_text(json.dumps(res, indent=1))
    os.replace(tmp, out / "results.json")
    try:  # the numbers are safe in results.json: a table or plot that fails must not end the run
        (out / "results.md").write_text(markdown(res))
        timings = json.dumps(res["configs"], sort_keys=True)
        if timings != _PLOTTED[0]:
            plot(res, out / "results.png")
            _PLOTTED[0] = timings
    except Exception as e:  # noqa: BLE001
        log(f"results.md / results.png not written: {type(e).__name__}: {e}")
