"""What `kascade bench` writes: the machine and versions (:func:`environment`), the Markdown table (:func:`table`),
the chart (:func:`plot`, skipped without matplotlib), the files (:func:`write`) and one progress line per
configuration (:func:`config_line`)."""

from __future__ import annotations

import importlib.metadata
import json
import platform
from pathlib import Path

import torch

from ..plots import pyplot
from .settings import GB


def cpu_name() -> str:
    """The CPU's model name (Linux's /proc/cpuinfo), else what the platform module knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment(device: str) -> dict:
    """The machine, the device and the versions a result was measured with."""
    import transformers

    try:  # the installed version, without paying for importing triton (it is optional on CPU)
        triton_v = importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        triton_v = None
    dev = torch.device(device)
    gpu = torch.cuda.get_device_name(dev) if dev.type == "cuda" else None
    gpu_mem = torch.cuda.get_device_properties(dev).total_memory / GB if dev.type == "cuda" else None
    return dict(machine=f"{platform.node()} ({platform.machine()}, {platform.system()})",
                device=gpu or f"CPU ({cpu_name()})", gpu=gpu, gpu_memory_gb=gpu_mem,
                torch=torch.__version__, cuda=torch.version.cuda, triton=triton_v,
                transformers=transformers.__version__, python=platform.python_version())


def _f(x, fmt):
    return "-" if x is None else format(x, fmt)


def _share(x: float) -> str:
    return f"{x:.2f}" if x >= 0 else "<0 (noise)"


def table(results: dict) -> str:
    """The results as Markdown: a header line (device, versions, settings), one row per configuration, notes."""
    env = results["environment"]
    s = results["settings"]
    decode = s.get("decode") or "eager"
    lines = [
        (f"device {env['device']}; torch {env['torch']}, triton {env['triton']}, transformers {env['transformers']}; "
         f"backend {s['backend']}; decode {decode}; repeats {s['repeats']} (median, after one "
         f"warm-up), {s['decode_steps']} decode steps; prefill chunk {s['prefill_chunk'] or 'none'}"),
        "",
        f"TTFT: the prompt through model(...) (logits_to_keep=1); ITL: {MAIN_MODES[decode]}",
        "",
        ("| model | B | L | TTFT dense s | TTFT kascade s | speedup | ITL dense ms | ITL kascade ms | speedup "
         "| attn share prefill / decode | peak GB dense | peak GB kascade | ratio | wall s |"),
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results["configs"]:
        head = f"| {r['model']} | {r['batch']} | {r['length']} |"
        if r.get("status") != "ok":
            lines.append(f"{head} {r['status']}: {r.get('reason', '')} |" + " |" * 10)
            continue
        d, k = r["dense"], r["kascade"]
        lines.append(
            f"{head} {d['ttft_s']:.3f} | {k['ttft_s']:.3f} | {r['ttft_speedup']:.2f}x | {1e3 * d['itl_s']:.2f} | "
            f"{1e3 * k['itl_s']:.2f} | {r['itl_speedup']:.2f}x | {_share(r['attn_share_prefill'])} / "
            f"{_share(r['attn_share_decode'])} | {_f(d['peak_gb'], '.1f')} | {_f(k['peak_gb'], '.1f')} | "
            f"{_f(r['peak_ratio'], '.2f')} | {r['wall_s']:.1f} |")
    lines += _generate_table(results)
    lines.append("")
    lines += [f"- {m}: {info['description']}; plan: {info['plan']}" + (f". {info['note']}" if info.get("note") else "")
              for m, info in results["models"].items()]
    lines.append("- speedup = dense / kascade (same run); attention share = 1 - t(no-op attention) / t(dense) (below 0: "
                 "the run without attention came out slower, timing noise larger than attention's share).")
    if not env.get("gpu"):
        lines.append("- measured on a CPU: timings of this size vary several-fold between identical runs (other "
                     "processes, frequency scaling, thread scheduling) and the CPU runs the reference backend, so "
                     "these speedups show that the command works, not what Kascade gains; measure speed on a GPU.")
    if s.get("decode") == "graph":
        lines.append("- decode: static cache, one CUDA-graph replay per step, for all three modes; dense = PyTorch "
                     "SDPA (cuDNN first) in prefill and Kascade's dense split-K Triton kernel in decode.")
    if s["prefill_chunk"]:
        lines.append(f"- prefill in chunks of {s['prefill_chunk']} tokens: for the chunks after the first, dense runs "
                     "transformers' SDPA with an explicit [B, 1, chunk, N] mask (not the causal flash path).")
    return "\n".join(lines)


# What each decode mode is, as the report names it.
MAIN_MODES = {
    "graph": "graph mode: GraphDecoder, greedy steps over a static cache, each one CUDA-graph replay",
    "eager": "eager Python loop: model(...) per greedy step over a DynamicCache",
}
GENERATE_MODES = {
    "eager": "eager generate: model.generate(...), its DynamicCache",
    "compiled": "compiled generate: model.generate(..., cache_implementation=\"static\", compile_config=...), "
                "torch.compile fullgraph ({backend}{cuda_graphs})",
}


def generate_mode_name(mode: str, settings: dict, device: str) -> str:
    cuda = not device.startswith("CPU")
    return GENERATE_MODES[mode].format(backend=settings.get("compile_backend", "inductor"),
                                       cuda_graphs=", mode reduce-overhead: a CUDA graph per step" if cuda else "")


def _generate_table(results: dict) -> list[str]:
    """The measurements through ``generate``, one row per configuration and decode mode (named in the row and in a
    note), or nothing when the run took none."""
    s = results["settings"]
    modes = list(s.get("generate") or ())
    if not modes:
        return []
    lines = ["", "Through transformers' generate (per-token stamps, CUDA events on a GPU: TTFT from generate's start "
             "to its first token, ITL the mean step after warm-up steps):", "",
             "| model | B | L | decode mode | TTFT dense s | TTFT kascade s | speedup | ITL dense ms | ITL kascade ms "
             "| speedup | first token agreement |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results["configs"]:
        if r.get("status") != "ok":
            continue
        for mode in modes:
            g = r["generate"][mode]
            d, k = g["dense"], g["kascade"]
            lines.append(f"| {r['model']} | {r['batch']} | {r['length']} | {mode} generate | {d['ttft_s']:.3f} | "
                         f"{k['ttft_s']:.3f} | {g['ttft_speedup']:.2f}x | {1e3 * d['itl_s']:.2f} | "
                         f"{1e3 * k['itl_s']:.2f} | {g['itl_speedup']:.2f}x | {g['first_token_agreement']:.2f} |")
    dev = results["environment"]["device"]
    lines += [""] + [f"- {generate_mode_name(m, s, dev)}" for m in modes]
    return lines


def plot(results: dict, path: Path) -> Path | None:
    """TTFT and ITL against the context length, dense vs Kascade, one row per model, saved to ``path``; None (and
    no file) without matplotlib: the chart is optional, the run's results are not."""
    try:
        plt = pyplot()
    except ImportError:
        return None
    ok = [r for r in results["configs"] if r.get("status") == "ok"]
    models = list(dict.fromkeys(r["model"] for r in results["configs"]))
    fig, axes = plt.subplots(max(1, len(models)), 2, figsize=(11, 3.6 * max(1, len(models))), squeeze=False)
    for row, m in zip(axes, models):
        for ax, key, scale, unit in ((row[0], "ttft_s", 1.0, "TTFT (s)"), (row[1], "itl_s", 1e3, "ITL (ms)")):
            for i, b in enumerate(sorted({r["batch"] for r in ok if r["model"] == m})):
                rs = sorted((r for r in ok if r["model"] == m and r["batch"] == b), key=lambda r: r["length"])
                xs = [r["length"] for r in rs]
                for mode, style in (("dense", "-o"), ("kascade", "--s")):
                    ax.plot(xs, [scale * r[mode][key] for r in rs], style, color=f"C{i}", label=f"{mode} B={b}")
            ax.set_xscale("log", base=2)
            lengths = sorted({r["length"] for r in ok if r["model"] == m})
            ax.set_xticks(lengths, [f"{x // 1024}K" if x % 1024 == 0 else str(x) for x in lengths])
            ax.xaxis.set_minor_locator(plt.NullLocator())
            ax.set_yscale("log")
            ax.set_xlabel("context length (tokens)")
            ax.set_ylabel(unit)
            decode = results["settings"].get("decode") or "eager"
            itl = f"{m}: ITL ({'graph' if decode == 'graph' else 'eager loop'})"
            ax.set_title(f"{m}: TTFT" if key == "ttft_s" else itl)
            ax.grid(True, which="both", alpha=0.3)
            if ax.has_data():
                ax.legend(fontsize=8)
    fig.suptitle(f"dense vs Kascade on {results['environment']['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write(results: dict, out: Path, *, with_plot: bool = True) -> list[Path]:
    """``bench.json``, ``bench.md`` and (``with_plot``, matplotlib installed) ``bench.png`` in ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    files = [out / "bench.json", out / "bench.md"]
    files[0].write_text(json.dumps(results, indent=1) + "\n")
    files[1].write_text(table(results) + "\n")
    png = plot(results, out / "bench.png") if with_plot else None
    return files + ([png] if png else [])


def config_line(rec: dict) -> str:
    """One configuration's outcome in a line, printed as the run goes."""
    head = f"{rec['model']} B={rec['batch']} L={rec['length']}: {rec['status']}"
    if rec["status"] == "skipped":
        return f"{head} ({rec['reason']})"
    head += f", {rec['wall_s']:.1f} s wall"
    if rec["status"] != "ok":
        return f"{head} ({rec['reason']})"
    d, k = rec["dense"], rec["kascade"]
    line = (f"{head}; TTFT {d['ttft_s']:.3f} / {k['ttft_s']:.3f} s, ITL {1e3 * d['itl_s']:.2f} / "
            f"{1e3 * k['itl_s']:.2f} ms (dense / kascade)")
    for mode, g in rec.get("generate", {}).items():
        line += (f"; {mode} generate: TTFT {g['dense']['ttft_s']:.3f} / {g['kascade']['ttft_s']:.3f} s, ITL "
                 f"{1e3 * g['dense']['itl_s']:.2f} / {1e3 * g['kascade']['itl_s']:.2f} ms")
    return line

