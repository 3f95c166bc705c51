"""Tensor-parallel Kascade against one GPU: correctness and speed, in one torchrun call.

    python3 -m torch.distributed.run --standalone --nproc-per-node 2 -m benchmarks.tp_bench --out DIR [options]
    python3 -m torch.distributed.run --standalone --nproc-per-node 2 -m benchmarks.tp_bench --tiny --out DIR   # CPU

(``torchrun`` is the same launcher; run from the repository root.) The model has Llama-3.1-8B's shapes (32 layers, hidden 4096, 32 query / 8 KV
heads, head dim 128, intermediate 14336, vocab 128256) and random weights: nothing is downloaded. Rank 0 writes them
once to --weights-dir (bf16 safetensors on CUDA, about 16 GB; reused by later runs) while the other ranks wait;
transformers then shards them itself (``from_pretrained(folder, tp_plan="auto")``). bf16 and NCCL on CUDA, fp32 and
gloo on CPUs (--tiny: a tiny Llama of the same family, for proving the script on a CPU).

The tensor-parallel size is the number of ranks (2 on the two-GPU machine; any size dividing the KV heads works).
The one-GPU baseline needs no second command: the same run measures it (phase 1 below). With
``--nproc-per-node 1`` only the one-GPU baseline runs (on a one-GPU machine).

Plans. A plan is global; the one measured here (unless --plan gives one) has the uniform anchors of `kascade bench`
(5 of 32 layers, 10% of keys, k_min 128, tile 32) and a head map in which every reuse head follows the anchor head
of the next rank (head h -> (h + H / ranks) mod H): every link crosses the ranks, as in a calibrated plan whose links
were not made shard-local (random weights have no calibrated plan). Its shard-local form
(``plan.for_tensor_parallel(ranks)``) keeps every link inside its rank.

Two phases (results are written after each step, so a run cut short keeps what it did):

1. Whole model, every rank on its own device at the same time:
   - rank 0 computes the references of the correctness checks: greedy tokens and last-position logits of one
     process at each --check-lengths prompt (batch 1; prefill, then --check-tokens decode steps, dynamic cache,
     eager): dense, Kascade with the shard-local plan, Kascade with the global plan;
   - the one-device baseline: every rank measures its share of the configurations that fit one device (dense and
     Kascade with the global plan, which on one device costs what the shard-local one does); rank 0's share is
     smaller by the references' work.
2. Tensor parallel (every rank, the sharded model):
   - correctness: the same prompts, fed the reference's tokens (teacher-forced), must give the same greedy token
     at every step: dense vs dense, shard-local vs one process with the shard-local plan, exchange
     (``enable(..., exchange=True)`` with the global plan) vs one process with the global plan. Reported: the
     largest logit difference, the tokens, and, where a token differs, whether the reference's own logits of the
     two tokens there are within twice the difference (a near-tie, which rounding may decide either way; such a
     check still passes, and says so). While the exchange runs, the bytes its all-gathers bring in per forward are
     counted and compared with ``kascade.tensor_parallel.step_exchange_bytes``.
   - speed, per --lengths x --batches (cheapest first): dense, Kascade shard-local, Kascade exchange.
   - the exchange's cost per decode step, three ways: ITL(exchange) - ITL(shard-local); the all-gathers of one
     decode step's selections timed alone (random indices of the exact shapes, --exchange-iters back-to-back steps);
     and the model: ``step_exchange_bytes`` (bytes one rank receives) / --link-gbps.

Timing (one configuration and mode): a static KV cache (``kascade.integration.graphs.GraphDecoder``), a warm-up
prefill of min(N, --warmup-length) tokens, then up to --repeats timed prefills of the whole prompt (TTFT = their
median; fewer when the next would take the mode's timed prefills past --repeat-budget seconds), then
--warmup-decode-steps eager decode steps, a CUDA-graph capture (on CUDA; if capture fails under tensor parallelism
the decode runs eager and the failure is recorded) and --decode-steps timed steps (ITL = their median). Times are
CUDA events on CUDA (perf_counter on CPUs); the tensor-parallel times are rank 0's. Dense runs through
``kascade.integration.runtime.DenseRuntime`` (cuDNN SDPA prefill, split-K Triton decode: the baseline of `kascade
bench`), Kascade through ``kascade.enable`` (Triton on CUDA, the reference ops on CPUs).

Memory: before a configuration runs, its peak on one device is estimated with ``kascade.bench.memory.estimate_bytes``
(for a tensor-parallel rank: the shard's heads and MLP width, the rank's measured weights); one that does not fit is
skipped with the reason (the default grid includes B=4 at 128K, which does not fit one H200 unchunked but fits two).
An out-of-memory error is caught and recorded per configuration. --time-budget skips what would not finish in time.

Outputs under --out, rewritten after every step: results.json (machine, versions, settings, every number),
results.md (tables), results.png (TTFT and ITL against the length, per setup and mode).

On machines shared with others, NVLink multicast must stay off: this script sets NCCL_NVLS_ENABLE=0,
TORCH_SYMM_MEM_DISABLE_MULTICAST=1 and NVSHMEM_DISABLE_NVLS=1 before anything initialises NCCL (export them in the
shell too). On two H200s, from the repository root (the manual's tensor-parallel page says more):

    export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=$PWD/src
    timeout -k 10 585 python3 -m torch.distributed.run --standalone --nproc-per-node 2 -m benchmarks.tp_bench \
        --device cuda --out $OUT --weights-dir /tmp/kascade-tp-bench --time-budget 480
"""

from __future__ import annotations

import os

from benchmarks.common.tp_env import MULTICAST_OFF

os.environ.update(MULTICAST_OFF)  # before torch and NCCL are imported or initialised

import argparse  # noqa: E402
import contextlib  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

from benchmarks.common import log  # noqa: E402
from benchmarks.common.report import T0  # noqa: E402
from benchmarks.common.tp_model import (GB, MODES_ONE, MODES_TP, ExchangeCounter, Ranks,  # noqa: E402
                                        _reference_route, free_memory, load_model, local_bytes, make_plans,
                                        model_shape, prepare_weights, route)
from benchmarks.common.tp_report import config_entry, fmt_len, machine_info, write  # noqa: E402
from benchmarks.common.tp_timing import (capacity, compare, cost, decode_kind, device_gb,  # noqa: E402
                                         estimate_gb, forced_logits, measure_mode, predict_s, prompt, skip_reason,
                                         time_exchange)

# Defaults by size: (8B shapes on GPUs, --tiny on CPUs)
DEFAULTS = dict(lengths=([32768, 131072], [96, 192]), batches=([1, 4], [1, 2]), check_lengths=([512, 32768], [48, 160]),
                check_tokens=(8, 4), decode_steps=(32, 4), warmup_length=(4096, 32))


# -- arguments -------------------------------------------------------------------------------------------------------
def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="folder for results.json, results.md and results.png")
    p.add_argument("--tiny", action="store_true",
                   help="a tiny random Llama (8 query / 4 KV heads, 4 layers) and tiny defaults: proves the script "
                        "on a CPU")
    p.add_argument("--layers", type=int, default=None, help="cut the model to this many layers (default: all)")
    p.add_argument("--weights-dir", default="/tmp/kascade-tp-bench",
                   help="where the random weights are written once and reused (a sub-folder per model shape; "
                        "default %(default)s; about 16 GB at 8B shapes; keep it out of --out)")
    p.add_argument("--plan", default=None,
                   help="a global Kascade plan JSON for the model (default: uniform anchors, every reuse head "
                        "following the next rank's head)")
    p.add_argument("--lengths", type=int, nargs="+", default=None,
                   help="prompt lengths timed (default 32768 131072; --tiny: 96 192)")
    p.add_argument("--batches", type=int, nargs="+", default=None, help="batch sizes timed (default 1 4; --tiny: 1 2)")
    p.add_argument("--check-lengths", type=int, nargs="*", default=None,
                   help="prompt lengths of the correctness checks (default 512 32768; --tiny: 48 160; none: skip)")
    p.add_argument("--check-tokens", type=int, default=None,
                   help="decode steps compared after each check's prefill (default 8; --tiny: 4)")
    p.add_argument("--repeats", type=int, default=3, help="timed prefills per mode, TTFT = median (default 3)")
    p.add_argument("--repeat-budget", type=float, default=30.0,
                   help="stop repeating a mode's prefill once the next would take its timed prefills past this many "
                        "seconds (at least one; 0: always --repeats; default %(default)s)")
    p.add_argument("--warmup-length", type=int, default=None,
                   help="tokens of the untimed warm-up prefill per mode (compiles kernels; default 4096; --tiny 32)")
    p.add_argument("--decode-steps", type=int, default=None, help="timed decode steps, ITL = median (default 32; "
                                                                  "--tiny 4)")
    p.add_argument("--warmup-decode-steps", type=int, default=2,
                   help="eager decode steps before the CUDA graph is captured (default %(default)s)")
    p.add_argument("--decode", choices=("auto", "graph", "eager"), default="auto",
                   help="decode steps replayed from CUDA graphs or eager (auto: graph on CUDA, eager on CPUs)")
    p.add_argument("--exchange-iters", type=int, default=50,
                   help="back-to-back decode-step exchanges timed alone per configuration (default %(default)s)")
    p.add_argument("--link-gbps", type=float, default=450.0,
                   help="link bandwidth the exchange model assumes, GB/s (1e9 bytes) per direction per GPU "
                        "(default %(default)s: NVLink 4 on an H200 SXM, 18 links x 25 GB/s)")
    p.add_argument("--memory-limit-gb", type=float, default=None,
                   help="memory one device may use (default: the GPU's; no check on CPUs)")
    p.add_argument("--time-budget", type=float, default=None,
                   help="seconds from the start after which nothing new is started; a configuration predicted to "
                        "end later is skipped with the reason (default: no limit)")
    p.add_argument("--skip-check", action="store_true", help="skip the correctness checks")
    p.add_argument("--skip-tp", action="store_true", help="skip the tensor-parallel timings")
    p.add_argument("--skip-one-gpu", action="store_true", help="skip the one-device timings")
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                   help="auto: CUDA when there is a GPU for every rank, else CPU")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    a = p.parse_args(argv)
    small = 1 if a.tiny else 0
    for name, vals in DEFAULTS.items():
        if getattr(a, name) is None:
            setattr(a, name, vals[small])
    if a.check_lengths is None:
        a.check_lengths = []
    for name in ("lengths", "batches"):
        if not getattr(a, name) or min(getattr(a, name)) < 1:
            p.error(f"--{name} must be positive integers")
    if a.check_lengths and min(a.check_lengths) < 2:
        p.error("--check-lengths must be at least 2")
    for name in ("repeats", "decode_steps", "warmup_length", "exchange_iters"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if a.check_tokens < 1 or a.warmup_decode_steps < 0 or a.repeat_budget < 0:
        p.error("--check-tokens must be >= 1; --warmup-decode-steps and --repeat-budget >= 0")
    if a.layers is not None and a.layers < 1:
        p.error("--layers must be >= 1")
    if a.plan is not None and not Path(a.plan).is_file():
        p.error(f"--plan {a.plan}: no such file")
    return a


def check_phase(args, model, ranks: Ranks, plans, refs: dict, vocab: int, backend: str, results: dict) -> None:
    """The sharded model fed the references' tokens (phase 2's correctness)."""
    from kascade.tensor_parallel import step_exchange_bytes

    plan = plans[0]
    for n in args.check_lengths:
        ids = prompt(1, n, vocab, args.seed + 1, ranks.device)
        ref = refs.get(n) if ranks.rank == 0 else None
        feed = ranks.agree(ref["kascade"].argmax(-1)[:, :-1] if ref else None)
        for mode, against in (("plain", "plain"), ("shard-local", "shard-local"), ("exchange", "kascade")):
            counter = ExchangeCounter() if mode == "exchange" else None
            want = ranks.agree(ref[against].argmax(-1)[:, :-1] if ref else None) if against != "kascade" else feed
            try:
                with route(model, mode, plans, ranks.cuda), (counter.active() if counter else contextlib.nullcontext()):
                    got, exchanged = forced_logits(model, ids, args.check_tokens, feed=want, counter=counter)
                err = None
            except torch.OutOfMemoryError as e:
                err = f"OutOfMemoryError: {str(e)[:300]}"
            errs = [e for e in ranks.gather(err) if e]
            label = "dense" if mode == "plain" else mode
            if errs:
                entry = dict(length=n, mode=label, error=errs[0], passed=False)
            elif ranks.rank == 0:
                entry = dict(length=n, mode=label, reference=("dense" if against == "plain" else
                                                              "shard-local plan" if against == "shard-local" else
                                                              "global plan"), **compare(ref[against], got))
                if counter is not None:
                    for i, b in enumerate(exchanged):
                        q, keys = (n, n) if i == 0 else (1, n + i)
                        model_b = step_exchange_bytes(plan, ranks.world, batch=1, keys=keys, queries=q,
                                                      backend=backend)
                        results["exchange_bytes_check"].append(dict(length=n, forward="prefill" if i == 0 else
                                                                    f"decode {i}", counted=b, model=model_b))
            if ranks.rank == 0:
                results["correctness"].append(entry)
                ok = "passed" if entry["passed"] else "FAILED"
                extra = "" if errs else f"max logit diff {entry['max_logit_diff']:.3g}, tokens equal " \
                                        f"{entry['tokens_equal']}"
                log(f"check N={n} {label}: {ok} ({extra or entry['error']})")
            free_memory(ranks.device)
        if ranks.rank == 0:
            write(results, Path(args.out))


def run_modes(model, ids, args, modes, plans, ranks: Ranks, *, tp: bool, use_graph: bool, setup: dict,
              prefix: str, graph_failed: dict | None = None) -> None:
    """Measure ``modes`` on ``model``, each into ``setup[mode]`` (an error is recorded, the next mode runs). A mode in
    ``graph_failed`` (mode -> reason) decodes eager; a mode whose capture fails is added to it."""
    graph_failed = {} if graph_failed is None else graph_failed
    for mode in modes:
        counter = ExchangeCounter() if mode == "exchange" else None
        err = None
        try:
            with route(model, mode, plans, ranks.cuda) as h:
                r = measure_mode(model, ids, args, use_graph=use_graph and mode not in graph_failed,
                                 ranks=ranks if tp else None, counter=counter)
                r["backend"] = getattr(getattr(h, "runtime", None), "backend", None)
                if use_graph and mode in graph_failed:
                    r["graph_error"] = f"(an earlier configuration) {graph_failed[mode]}"
                elif r.get("graph_error"):
                    graph_failed[mode] = r["graph_error"]
        except torch.OutOfMemoryError as e:
            err, r = f"OutOfMemoryError: {str(e)[:300]}", None
            free_memory(ids.device)
        if tp:
            errs = [e for e in ranks.gather(err) if e]
            peaks = ranks.gather(r.get("peak_gb") if r else None)
            if errs:
                r = dict(error=errs[0])
            else:
                r["peak_gb_ranks"] = peaks
        elif err:
            r = dict(error=err)
        setup[mode] = r
        if "error" in r:
            log(f"{prefix} {mode}: {r['error'][:200]}", every_rank=not tp)
        else:
            peak = "-" if r.get("peak_gb") is None else f"{r['peak_gb']:.1f} GB"
            log(f"{prefix} {mode}: TTFT {r['ttft_s']:.3f} s ({len(r['ttft_all_s'])} runs), ITL "
                f"{r['itl_s'] * 1e3:.2f} ms ({r['decode']}), peak {peak}", every_rank=not tp)


def tp_phase(args, folder, ranks: Ranks, dtype, cfg, plans, refs, results) -> None:
    """Phase 2: the sharded model's checks against ``refs``, then every configuration's three modes (rank 0 decides
    what runs, every rank runs it) and the exchange's cost."""
    from kascade.tensor_parallel import step_exchange_bytes

    t = time.perf_counter()
    model = load_model(folder, ranks, dtype, tp=True)
    weights = local_bytes(model)
    vocab = cfg["vocab_size"]
    results["model"]["tp_load_s"] = time.perf_counter() - t
    results["model"]["tp_weights_gb_per_rank"] = weights / GB
    log(f"tensor-parallel model loaded ({weights / GB:.2f} GB per rank, {time.perf_counter() - t:.1f} s)")
    backend = "triton" if ranks.cuda else "reference"
    if args.check_lengths and not args.skip_check:
        check_phase(args, model, ranks, plans, refs, vocab, backend, results)
    if args.skip_tp:
        del model
        return
    use_graph = decode_kind(args, ranks.device) == "graph"
    graph_failed: dict = {}  # mode -> why its capture failed under tensor parallelism (it then decodes eager)
    plan = plans[0]
    done: list[dict] = []
    for batch, length in sorted(((b, n) for n in args.lengths for b in args.batches), key=lambda x: cost(*x)):
        entry = config_entry(results, batch, length)
        prefix = f"[TP {ranks.world}] B={batch} N={fmt_len(length)}"
        need = estimate_gb(cfg, plan, weights=weights, batch=batch, length=length, args=args, device=ranks.device,
                           world=ranks.world)
        why = ranks.agree(skip_reason(need, device_gb(args, ranks.device), predict_s(done, batch, length, args), args))
        entry["tp_estimate_gb"] = need
        if why:
            entry["tp_skipped"] = why
            log(f"{prefix}: skipped: {why}")
        else:
            log(f"{prefix}: estimated {need:.1f} GB per rank")
            ids = prompt(batch, length, vocab, args.seed, ranks.device)
            run_modes(model, ids, args, MODES_TP, plans, ranks, tp=True, use_graph=use_graph, setup=entry["tp"],
                      prefix=prefix, graph_failed=graph_failed)
            cap = capacity(length, args)
            keys = cap if backend == "triton" else length + 1
            model_bytes = step_exchange_bytes(plan, ranks.world, batch=batch, keys=keys, queries=1, backend=backend)
            ex = dict(model_bytes=model_bytes, model_keys=keys, model_seconds=model_bytes / (args.link_gbps * 1e9),
                      link_gbps_assumed=args.link_gbps)
            loc, exc = entry["tp"].get("shard-local", {}), entry["tp"].get("exchange", {})
            ex["counted_bytes"] = exc.get("exchanged_bytes_first_decode_step")
            if "itl_s" in loc and "itl_s" in exc:
                if loc["decode"] == exc["decode"]:
                    ex["itl_difference_s"] = exc["itl_s"] - loc["itl_s"]
                else:
                    ex["itl_difference_s"] = None
                    ex["note"] = f"shard-local decoded {loc['decode']}, exchange {exc['decode']}: not comparable"
            try:
                ex["alone"] = time_exchange(model, plan, batch, keys, args.exchange_iters, ranks)
            except torch.OutOfMemoryError as e:
                ex["alone"] = dict(error=str(e)[:300])
            entry["exchange_cost"] = ex
            done.append(dict(batch=batch, length=length, modes={m: r for m, r in entry["tp"].items()
                                                                if "ttft_s" in r}))
            if not done[-1]["modes"]:
                done.pop()
        if ranks.rank == 0:
            write(results, Path(args.out))
    del model
    free_memory(ranks.device)


def references(args, model, ranks: Ranks, plans, vocab: int) -> dict:
    """``{length: {mode: logits [1, S, V]}}`` of one process: transformers' dense, the shard-local plan, the global
    plan (what the tensor-parallel checks are compared with)."""
    refs = {}
    for n in args.check_lengths:
        ids = prompt(1, n, vocab, args.seed + 1, ranks.device)
        refs[n] = {}
        for mode in ("plain", "shard-local", "kascade"):
            with _reference_route(model, mode, plans):
                refs[n][mode], _ = forced_logits(model, ids, args.check_tokens)
        log(f"reference N={n}: greedy tokens {refs[n]['kascade'].argmax(-1).tolist()}")
    free_memory(ranks.device)
    return refs


def whole_model_phase(args, folder, ranks: Ranks, dtype, cfg, plans, results) -> dict:
    """Every rank that has work loads the whole model on its own device. Rank 0 computes the references of the
    checks (returned); every rank measures its share of the one-device configurations (those that fit one device;
    the costliest first to the least loaded rank, rank 0 counting the references as load)."""
    want_refs = ranks.world > 1 and bool(args.check_lengths) and not args.skip_check
    timing = not args.skip_one_gpu
    spent = ranks.agree(args.time_budget is not None and time.perf_counter() - T0 >= args.time_budget)
    if timing and spent:
        timing = False
        if ranks.rank == 0:
            for batch, length in ((b, n) for n in args.lengths for b in args.batches):
                config_entry(results, batch, length)["one_gpu_skipped"] = "--time-budget spent"
            log("one device: skipped, --time-budget spent")
    if not timing and not (want_refs and ranks.rank == 0):
        ranks.barrier()
        return {}
    t = time.perf_counter()
    model = load_model(folder, ranks, dtype, tp=False)
    weights = local_bytes(model)
    results["model"]["whole_load_s"] = time.perf_counter() - t
    log(f"whole model loaded ({weights / GB:.2f} GB, {time.perf_counter() - t:.1f} s)")
    plan = plans[0]
    refs = references(args, model, ranks, plans, cfg["vocab_size"]) if want_refs and ranks.rank == 0 else {}
    if not timing:
        model = None
        free_memory(ranks.device)
        ranks.barrier()
        return refs
    use_graph = decode_kind(args, ranks.device) == "graph"
    have = ranks.agree(device_gb(args, ranks.device))
    runnable = []
    for batch, length in sorted(((b, n) for n in args.lengths for b in args.batches), key=lambda x: -cost(*x)):
        need = estimate_gb(cfg, plan, weights=weights, batch=batch, length=length, args=args, device=ranks.device)
        why = skip_reason(need, have, None, args) if have is not None else None
        if ranks.rank == 0:
            entry = config_entry(results, batch, length)
            entry["one_gpu_estimate_gb"] = need
            if why:
                entry["one_gpu_skipped"] = why
                log(f"[1 device] B={batch} N={fmt_len(length)}: skipped: {why}")
        if not why:
            runnable.append((batch, length))
    load, share = [0.0] * ranks.world, [[] for _ in range(ranks.world)]
    if want_refs and ranks.world > 1:
        load[0] = 3 * sum(cost(1, n) for n in args.check_lengths)  # rank 0's references: 3 prompts per length
    for c in runnable:
        r = min(range(ranks.world), key=lambda i: load[i])
        share[r].append(c)
        load[r] += cost(*c)
    mine = sorted(share[ranks.rank], key=lambda x: cost(*x))
    done: list[dict] = []
    for i in range(max((len(x) for x in share), default=0)):
        report = None
        if i < len(mine):
            batch, length = mine[i]
            prefix = f"[1 device] B={batch} N={fmt_len(length)}"
            why = skip_reason(0.0, None, predict_s(done, batch, length, args), args)
            report = dict(batch=batch, length=length, skipped=why, modes={})
            if why:
                log(f"{prefix}: skipped: {why}", every_rank=True)
            else:
                ids = prompt(batch, length, cfg["vocab_size"], args.seed, ranks.device)
                run_modes(model, ids, args, MODES_ONE, plans, ranks, tp=False, use_graph=use_graph,
                          setup=report["modes"], prefix=prefix)
                ok = {m: r for m, r in report["modes"].items() if "ttft_s" in r}
                if ok:
                    done.append(dict(batch=batch, length=length, modes=ok))
        for rank, rep in enumerate(ranks.gather(report)):
            if rep is None or ranks.rank != 0:
                continue
            entry = config_entry(results, rep["batch"], rep["length"])
            entry["one_gpu_rank"] = rank
            if rep["skipped"]:
                entry["one_gpu_skipped"] = rep["skipped"]
            entry["one_gpu"].update(rep["modes"])
        if ranks.rank == 0:
            write(results, Path(args.out))
    model = None
    free_memory(ranks.device)
    ranks.barrier()
    return refs


def main(argv=None) -> None:
    args = parse_args(argv)
    # a SIGTERM (the launcher's, or `timeout`'s) ends the run through the `finally` below: results say "interrupted"
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    warnings.filterwarnings("ignore", message=".*uncalibrated plan.*")
    warnings.filterwarnings("ignore", message=".*tp_plan.*", category=FutureWarning)  # still the way in 5.17
    ranks = Ranks(args.device)
    dtype = torch.bfloat16 if ranks.cuda else torch.float32
    out = Path(args.out)
    if ranks.rank == 0:
        out.mkdir(parents=True, exist_ok=True)
    log(f"{ranks.world} rank(s) on {ranks.device.type}; {dtype}")
    name, cfg = model_shape(args)
    plans = make_plans(args, cfg, ranks.world)
    plan = plans[0]
    results = dict(status="running", machine=machine_info(ranks), settings=vars(args),
                   model=dict(name=name, config=cfg, description=(
                       "tiny random Llama (CPU proof)" if args.tiny else
                       f"Llama-3.1-8B shapes ({cfg['num_hidden_layers']} layers), random weights") + f", {dtype}"),
                   plan=dict(source=plan.source, anchors=list(plan.anchors), ratio=plan.ratio, k_min=plan.k_min,
                             tile=plan.tile, head_map=[list(r) for r in plan.head_map],
                             crossing_links=len(plan.crossing_links(ranks.world)) if ranks.world > 1 else 0),
                   correctness=[], exchange_bytes_check=[], configs=[])
    folder, _, _, secs = prepare_weights(args, ranks, dtype)
    results["model"].update(weights_dir=str(folder), weights_s=secs)
    if ranks.rank == 0:
        write(results, out)
    try:
        if ranks.world == 1:
            log("one rank: no tensor-parallel run, the one-device baseline only")
        refs = whole_model_phase(args, folder, ranks, dtype, cfg, plans, results)
        if ranks.world > 1 and not (args.skip_tp and (args.skip_check or not args.check_lengths)):
            tp_phase(args, folder, ranks, dtype, cfg, plans, refs, results)
        results["status"] = "done"
    finally:
        if ranks.rank == 0:
            if results["status"] != "done":
                results["status"] = "interrupted"
            write(results, out)
            log(f"wrote {out / 'results.json'}, results.md, results.png")
    ranks.close()


if __name__ == "__main__":
    sys.exit(main())
