"""Tensor-parallel Kascade against one GPU: correctness and speed, in one torchrun call.

    python3 -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/tp_bench.py --out DIR [options]
    python3 -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/tp_bench.py --tiny --out DIR   # CPU

(``torchrun`` is the same launcher.) The model has Llama-3.1-8B's shapes (32 layers, hidden 4096, 32 query / 8 KV
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
shell too). On two H200s, from the repository root (docs/benchmarks/tp.md says more):

    export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=$PWD/src
    timeout -k 10 585 python3 -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/tp_bench.py \
        --device cuda --out $OUT --weights-dir /tmp/kascade-tp-bench --time-budget 480
"""

from __future__ import annotations

import os

# NVLink multicast off (shared GPUs): set before torch and NCCL are imported or initialised.
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
os.environ.update(MULTICAST_OFF)

import argparse  # noqa: E402
import contextlib  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import signal  # noqa: E402
import socket  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
from datetime import timedelta  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

T0 = time.perf_counter()
GB = 1024**3
MODES_TP = ("dense", "shard-local", "exchange")
MODES_ONE = ("dense", "kascade")
# A tiny Llama for CPU runs: 4 KV heads, so that 2 ranks hold 2 heads each and head maps can cross them.
TINY = dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=8,
            num_key_value_heads=4, head_dim=16, rope_theta=10000.0, tie_word_embeddings=False)
# a budget that selects at the tiny lengths (prefill tiles keep up to k(N) - T earlier keys)
TINY_ANCHORS, TINY_BUDGET = 2, dict(ratio=0.2, k_min=16, tile=8)
MAX_POSITIONS = {"llama8b": 1 << 20, "tiny": 1 << 16}  # RoPE without scaling: only a bound on positions
SHARD_BYTES = 4 * GB
# Defaults by size: (8B shapes on GPUs, --tiny on CPUs)
DEFAULTS = dict(lengths=([32768, 131072], [96, 192]), batches=([1, 4], [1, 2]), check_lengths=([512, 32768], [48, 160]),
                check_tokens=(8, 4), decode_steps=(32, 4), warmup_length=(4096, 32))


def log(msg: str, every_rank: bool = False) -> None:
    """Progress on rank 0 (``every_rank``: on every rank, which is named)."""
    rank = int(os.environ.get("RANK", "0"))
    if rank == 0 or every_rank:
        prefix = f"[{time.perf_counter() - T0:7.1f} s]" + (f" rank {rank}:" if every_rank else "")
        print(f"{prefix} {msg}", flush=True)


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


# -- ranks -------------------------------------------------------------------------------------------------------------
class Ranks:
    """This process's place among the torchrun ranks, and a CPU (gloo) group for agreeing on decisions: every rank
    must take the same branches, or the model's collectives would wait forever."""

    def __init__(self, device: str):
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if device == "cuda" and gpus < self.world:
            raise SystemExit(f"--device cuda needs a GPU per rank: {self.world} ranks, {gpus} GPUs")
        self.cuda = device == "cuda" or (device == "auto" and gpus >= self.world)
        self.device = torch.device("cuda", self.local_rank) if self.cuda else torch.device("cpu")
        self.group = None
        if self.cuda:
            torch.cuda.set_device(self.device)
        if self.world > 1:
            dist.init_process_group(backend="nccl" if self.cuda else "gloo",
                                    device_id=self.device if self.cuda else None, timeout=timedelta(minutes=30))
            self.group = dist.new_group(backend="gloo", timeout=timedelta(hours=3)) if self.cuda else dist.group.WORLD

    def agree(self, obj):
        """Rank 0's ``obj`` on every rank."""
        if self.world == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def gather(self, obj) -> list:
        """Every rank's ``obj``, by rank, on every rank."""
        if self.world == 1:
            return [obj]
        out = [None] * self.world
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier(group=self.group)

    def close(self) -> None:
        if self.world > 1:
            self.barrier()
            dist.destroy_process_group()


def free_memory(device: torch.device) -> None:
    """Hand freed GPU memory back before the next configuration (nothing on CPUs, where a collection costs ~0.5 s
    with transformers loaded and frees nothing the next run needs)."""
    if device.type == "cuda":
        gc.collect()
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


# -- the model -----------------------------------------------------------------------------------------------------
def model_shape(args) -> tuple[str, dict]:
    from kascade.bench.models import LLAMA8B

    name, cfg = ("tiny", dict(TINY)) if args.tiny else ("llama8b", dict(LLAMA8B))
    if args.layers is not None:
        cfg["num_hidden_layers"] = args.layers
    return name, cfg


def weights_folder(args, name: str, cfg: dict, dtype: torch.dtype) -> Path:
    return Path(args.weights_dir) / f"{name}-{cfg['num_hidden_layers']}layers-{str(dtype).split('.')[-1]}"


def write_weights(folder: Path, name: str, cfg: dict, device: torch.device, dtype: torch.dtype) -> None:
    """A random Llama of ``cfg`` built on ``device`` in ``dtype`` (no fp32 detour), written as safetensors shards
    of at most 4 GiB with an index (moved to the host one shard at a time), then renamed into place: a folder
    that exists is complete."""
    from safetensors.torch import save_file

    from kascade.bench.models import random_llama

    model = random_llama(cfg, device=str(device), dtype=dtype, max_positions=MAX_POSITIONS[name])
    tmp = folder.with_name(folder.name + f".partial-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    model.config.save_pretrained(tmp)
    state = model.state_dict()
    shards, size = [[]], 0
    for key, t in state.items():
        n = t.numel() * t.element_size()
        if shards[-1] and size + n > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(key)
        size += n
    weight_map = {}
    for i, keys in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file({k: state[k].detach().to("cpu").contiguous() for k in keys}, str(tmp / fname),
                  metadata={"format": "pt"})
        weight_map.update({k: fname for k in keys})
    total = sum(t.numel() * t.element_size() for t in state.values())
    (tmp / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                  "weight_map": weight_map}, indent=1))
    (tmp / "kascade_random.json").write_text(json.dumps(_marker(cfg, dtype), indent=1))
    del model, state
    free_memory(device)
    if folder.exists():
        shutil.rmtree(folder)
    os.replace(tmp, folder)


def _marker(cfg: dict, dtype) -> dict:
    return {"config": cfg, "dtype": str(dtype), "seed": 0, "builder": "kascade.bench.models.random_llama"}


def prepare_weights(args, ranks: Ranks, dtype) -> tuple[Path, str, dict, float]:
    """``(folder, name, config, seconds)``: rank 0 writes the weights unless a complete folder is there; the others
    wait."""
    name, cfg = model_shape(args)
    folder = weights_folder(args, name, cfg, dtype)
    marker = folder / "kascade_random.json"
    t = time.perf_counter()
    if ranks.rank == 0:
        ok = marker.is_file() and json.loads(marker.read_text()) == json.loads(json.dumps(_marker(cfg, dtype)))
        if ok:
            log(f"reusing the random weights in {folder}")
        else:
            log(f"writing random {name} weights ({cfg['num_hidden_layers']} layers, {dtype}) to {folder}")
            write_weights(folder, name, cfg, ranks.device, dtype)
    ranks.barrier()
    if not marker.is_file():
        raise SystemExit(f"rank {ranks.rank}: no weights in {folder} (is --weights-dir on a disk every rank sees?)")
    return folder, name, cfg, time.perf_counter() - t


def load_model(folder: Path, ranks: Ranks, dtype, *, tp: bool):
    """The whole model on this rank's device, or (``tp``) its shard, sharded by transformers (``tp_plan="auto"``)."""
    from transformers import AutoModelForCausalLM

    if tp:
        model = AutoModelForCausalLM.from_pretrained(folder, tp_plan="auto", dtype=dtype)
    else:
        kw = {"device_map": str(ranks.device)} if ranks.cuda else {}
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, **kw)
    return model.eval()


def local_bytes(model) -> int:
    """Bytes of this rank's parameters (the local shard of a DTensor)."""
    total = 0
    for p in model.parameters():
        t = p.to_local() if hasattr(p, "to_local") else p
        total += t.numel() * t.element_size()
    return total


# -- plans -------------------------------------------------------------------------------------------------------
def make_plans(args, cfg: dict, world: int):
    """``(global plan, shard-local plan)``."""
    from transformers import LlamaConfig

    from kascade import KascadePlan, ModelFingerprint
    from kascade.bench.models import LLAMA8B_ANCHORS

    fp = ModelFingerprint.from_config(LlamaConfig(**cfg))
    H, n = fp.num_kv_heads, fp.num_layers
    if world > 1 and H % world:
        raise SystemExit(f"{world} ranks do not divide the model's {H} KV heads")
    if args.plan:
        plan = KascadePlan.load(args.plan)
        diffs = plan.fingerprint.differences(fp)
        if diffs:
            raise SystemExit(f"--plan was made for another model: {'; '.join(diffs)}")
    else:
        # 5 anchors of 32 layers (`kascade bench`'s plan); a model cut by --layers keeps about half its layers reuse
        count = TINY_ANCHORS if args.tiny else LLAMA8B_ANCHORS
        anchors = KascadePlan.uniform(fp, max(1, min(count, n // 2))).anchors
        shift = H // world if world > 1 else H // 2
        ident, moved = tuple(range(H)), tuple((h + shift) % H for h in range(H))
        rows = tuple(ident if layer in anchors else moved for layer in range(n))
        budget = TINY_BUDGET if args.tiny else {}
        plan = KascadePlan(fp, anchors, rows, calibrated=False, **budget,
                           source=f"tp_bench: uniform anchors, every reuse head follows head h + {shift} (mod {H})")
    local = plan.for_tensor_parallel(world) if world > 1 else plan
    return plan, local


# -- routing (what a mode runs) -----------------------------------------------------------------------------------
def dense_runtime(cuda: bool):
    """The dense baseline of `kascade bench` (cuDNN SDPA prefill, split-K Triton decode), on CPUs with the reference
    ops behind the same routing."""
    from kascade.integration.runtime import DenseRuntime

    if cuda:
        return DenseRuntime()

    class ReferenceDense(DenseRuntime):
        backend = "reference"

    return ReferenceDense()


def route(model, mode: str, plans, cuda: bool):
    """A context manager routing ``model``'s attention for ``mode``."""
    import kascade
    from kascade.integration.hf import attach

    plan, local = plans
    if mode == "dense":
        return attach(model, dense_runtime(cuda))
    if mode == "plain":  # transformers' own attention (SDPA): the correctness checks' dense
        return contextlib.nullcontext()
    if mode == "shard-local":
        return kascade.enable(model, local, warn_uncalibrated=False)
    if mode == "exchange":
        return kascade.enable(model, plan, exchange=True, warn_uncalibrated=False)
    if mode == "kascade":
        return kascade.enable(model, plan, warn_uncalibrated=False)
    raise ValueError(mode)


class ExchangeCounter:
    """Counts the bytes the exchange's all-gathers bring to this rank: ``(ranks - 1)`` times every local selection
    gathered (wraps ``kascade.attention.gather_heads`` while active; restored after)."""

    def __init__(self):
        self.bytes = 0

    @contextlib.contextmanager
    def active(self):
        import kascade.attention as ka

        original = ka.gather_heads

        def counting(sel, shard):
            self.bytes += (shard.size - 1) * sel.indices.numel() * sel.indices.element_size()
            return original(sel, shard)

        ka.gather_heads = counting
        try:
            yield self
        finally:
            ka.gather_heads = original


# -- correctness ---------------------------------------------------------------------------------------------------
def prompt(batch: int, length: int, vocab: int, seed: int, device) -> torch.Tensor:
    from kascade.bench.timing import prompt as bench_prompt

    return bench_prompt(batch, length, vocab, seed, device)


@torch.no_grad()
def forced_logits(model, ids: torch.Tensor, steps: int, feed: torch.Tensor | None = None,
                  counter: ExchangeCounter | None = None) -> tuple[torch.Tensor, list[int]]:
    """``([B, steps + 1, V] fp32 logits on the host, bytes exchanged per forward)``: a prefill of ``ids``, then
    ``steps`` decode steps fed ``feed[:, i]`` (teacher forcing) or, without ``feed``, the greedy token."""
    from transformers import DynamicCache

    from kascade.models import cache_kwargs

    cache = DynamicCache()
    kw = cache_kwargs(model, cache)
    exchanged = []

    def forward(x, **extra):
        if counter is not None:
            counter.bytes = 0
        out = model(x, use_cache=True, **extra, **kw).logits[:, -1].float().cpu()
        exchanged.append(counter.bytes if counter is not None else 0)
        return out

    rows = [forward(ids, logits_to_keep=1)]
    for i in range(steps):
        nxt = feed[:, i] if feed is not None else rows[-1].argmax(-1)
        rows.append(forward(nxt[:, None].to(ids.device)))
    return torch.stack(rows, 1), exchanged


def compare(ref: torch.Tensor, got: torch.Tensor) -> dict:
    """Greedy tokens and logits of ``got`` against ``ref`` (both ``[B, S, V]``)."""
    diff = (got - ref).abs()
    want, have = ref.argmax(-1), got.argmax(-1)
    miss = want != have
    # a near-tie: at a differing position the reference's margin between its token and the other is within twice
    # the largest logit difference there (rounding may decide it either way)
    margin = ref.gather(-1, want[..., None])[..., 0] - ref.gather(-1, have[..., None])[..., 0]
    ties = miss & (margin <= 2 * diff.amax(-1))
    top2 = ref.topk(2, -1).values
    return dict(max_logit_diff=float(diff.max()), logit_scale=float(ref.abs().max()),
                tokens_equal=not bool(miss.any()), mismatches=int(miss.sum()), near_ties=int(ties.sum()),
                passed=bool((miss == ties).all()), smallest_reference_margin=float((top2[..., 0] - top2[..., 1]).min()),
                reference_tokens=want.tolist(), tokens=have.tolist())


# -- timing ------------------------------------------------------------------------------------------------------
class Clock:
    """Seconds a call takes: CUDA events on CUDA (after a synchronize), perf_counter on CPUs."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def __call__(self, fn):
        if self.cuda:
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3, out
        t = time.perf_counter()
        out = fn()
        return time.perf_counter() - t, out


def capacity(length: int, args) -> int:
    """Static-cache slots of one timed configuration: the prompt, every decode step, and one spare."""
    return length + max(1, args.warmup_decode_steps) + 1 + args.decode_steps + 1


@torch.no_grad()
def measure_mode(model, ids: torch.Tensor, args, *, use_graph: bool, ranks: Ranks | None,
                 counter: ExchangeCounter | None = None) -> dict:
    """TTFT and ITL of the routing set on ``model`` (see the module docstring). ``ranks``: the tensor-parallel
    ranks (decisions taken by rank 0), or None for a one-device run."""
    from kascade.integration.graphs import GraphDecoder

    dev = ids.device
    B, L = ids.shape
    agree = ranks.agree if ranks is not None else (lambda x: x)
    clock = Clock(dev)
    wall = time.perf_counter()
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    warm = max(1, args.warmup_decode_steps)
    dec = GraphDecoder(model, B, capacity(L, args), use_graph=use_graph, warmup=warm)
    r: dict = {}
    try:
        dec.prefill(ids[:, : min(L, args.warmup_length)])
        times = []
        while True:
            t, first = clock(lambda: dec.prefill(ids))
            times.append(t)
            more = len(times) < args.repeats and (
                args.repeat_budget <= 0 or sum(times) + statistics.mean(times) <= args.repeat_budget)
            if not agree(more):
                break
        r.update(ttft_s=statistics.median(times), ttft_all_s=times, first_token=first[:, 0].tolist())
        for i in range(warm):
            if i == 0 and counter is not None:
                counter.bytes = 0
                with counter.active():
                    dec.step()
                r["exchanged_bytes_first_decode_step"] = counter.bytes
            else:
                dec.step()
        r["decode"] = "graph" if use_graph else "eager"
        if use_graph:
            # capture without replaying, and replay only once every rank has a graph: a replay's collectives
            # would wait forever for a rank whose capture failed
            failed = None
            try:
                dec.capture()
            except Exception as e:  # noqa: BLE001 -- recorded; every rank then decodes eager
                if isinstance(e, torch.OutOfMemoryError):
                    raise
                failed = f"{type(e).__name__}: {e}"[:500]
            why = [w for w in (ranks.gather(failed) if ranks is not None else [failed]) if w]
            if why:
                dec.graph, dec.use_graph = None, False
                torch.cuda.synchronize(dev)
                r.update(decode="eager", graph_error=why[0])
        dec.step()  # the first replay (or one more eager step)
        steps = [clock(dec.step)[0] for _ in range(args.decode_steps)]
        r.update(itl_s=statistics.median(steps), itl_mean_s=statistics.mean(steps), itl_all_s=steps)
    finally:
        dec = None  # the static cache and any graph: freed before the next mode allocates its own
        free_memory(dev)
    r["peak_gb"] = torch.cuda.max_memory_allocated(dev) / GB if dev.type == "cuda" else None
    r["wall_s"] = time.perf_counter() - wall
    return r


@torch.no_grad()
def time_exchange(model, plan, batch: int, keys: int, iters: int, ranks: Ranks) -> dict:
    """One decode step's exchange timed alone: per anchor, an all-gather of a ``[B, H / ranks, 1, k]`` int64
    selection (random indices, the decode shape of a static cache of ``keys`` slots), ``iters`` steps back to back;
    mean seconds per step."""
    from kascade.integration.hf import attention_modules
    from kascade.ops import Selection
    from kascade.tensor_parallel import gather_heads, head_shard, selection_shape

    fp = plan.fingerprint
    shard = head_shard(attention_modules(model), fp.num_kv_heads, fp.head_dim)
    dev = next(model.parameters()).device
    sels, received = [], 0
    g = torch.Generator(device=dev).manual_seed(0)
    for a in plan.anchors:
        rows, width = selection_shape(plan.budget, keys, 1, plan.depth(a) if plan.ranked else None)
        idx = torch.randint(0, keys, (batch, shard.count, rows, width), generator=g, device=dev, dtype=torch.int64)
        sels.append(Selection(idx, torch.zeros(batch, dtype=torch.long, device=dev), plan.tile, True))
        received += (shard.size - 1) * idx.numel() * idx.element_size()

    def step():
        for s in sels:
            gather_heads(s, shard)

    for _ in range(3):
        step()
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    ranks.barrier()  # both ranks start the timed steps together
    t, _ = Clock(dev)(lambda: [step() for _ in range(iters)])
    return dict(seconds_per_step=t / iters, bytes_received_per_step=received, iters=iters,
                effective_gbps=received / (t / iters) / 1e9 if t > 0 else None)


# -- memory and time ---------------------------------------------------------------------------------------------
def estimate_gb(cfg: dict, plan, *, weights: int, batch: int, length: int, args, device: torch.device,
                world: int = 1) -> float:
    """Estimated peak GB of one configuration on one device (a tensor-parallel rank: its share of the heads and
    of the MLP width; the model's vocabulary and hidden size whole), from ``kascade.bench.memory``."""
    from transformers import LlamaConfig

    from kascade.bench.memory import estimate_bytes
    from kascade.bench.settings import Settings

    shard = dict(cfg)
    if world > 1:
        for key in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
            shard[key] = cfg[key] // world
    settings = Settings(lengths=(length,), batches=(batch,), decode_steps=args.decode_steps + 2,
                        warmup_decode_steps=max(1, args.warmup_decode_steps), decode=decode_kind(args, device),
                        device=device.type, time_budget_s=None)
    est = estimate_bytes(LlamaConfig(**shard), plan, weights=weights, batch=batch, length=length, settings=settings)
    return est["total"] / GB


def device_gb(args, device: torch.device) -> float | None:
    if args.memory_limit_gb is not None:
        return args.memory_limit_gb
    if device.type != "cuda":
        return None
    free_memory(device)
    free, _ = torch.cuda.mem_get_info(device)
    return (free + torch.cuda.memory_allocated(device)) / GB


def decode_kind(args, device: torch.device) -> str:
    if args.decode == "auto":
        return "graph" if device.type == "cuda" else "eager"
    if args.decode == "graph" and device.type != "cuda":
        raise SystemExit("--decode graph needs CUDA")
    return args.decode


def cost(batch: int, length: int) -> float:
    """Relative work of a configuration: linear in the tokens, plus attention's quadratic part (at Llama-3.1-8B
    shapes on an H200 attention is ~70% of dense prefill at 128K: the two are equal near 56K)."""
    return batch * length * (1 + length / 57344)


def predict_s(done: list[dict], batch: int, length: int, args) -> float | None:
    """A rough prediction of a configuration's wall time from the last one measured in the same setup: each mode's
    prefill scaled by :func:`cost`, repeated as --repeats and --repeat-budget allow (plus the short warm-up
    prefill), and the rest of its time (decode steps, capture) scaled by the batch."""
    if not done:
        return None
    last = done[-1]
    scale = cost(batch, length) / cost(last["batch"], last["length"])
    warm_then = min(1.0, args.warmup_length / last["length"])
    warm_now = min(1.0, args.warmup_length / length)
    total = 0.0
    for r in last["modes"].values():
        ttft = r["ttft_s"] * scale
        reps = args.repeats if args.repeat_budget <= 0 else max(1, min(args.repeats, int(args.repeat_budget // ttft)))
        rest = max(0.0, r["wall_s"] - r["ttft_s"] * (len(r["ttft_all_s"]) + warm_then))
        total += ttft * (reps + warm_now) + rest * batch / last["batch"]
    return total


def skip_reason(need_gb: float, have_gb: float | None, predicted: float | None, args) -> str | None:
    if have_gb is not None and need_gb > have_gb:
        return f"needs ~{need_gb:.1f} GB per device (estimate), {have_gb:.1f} GB there"
    if args.time_budget is not None:
        left = args.time_budget - (time.perf_counter() - T0)
        if left <= 0:
            return "--time-budget spent"
        if predicted is not None and predicted > left:
            return f"predicted ~{predicted:.0f} s, {left:.0f} s left of --time-budget"
    return None


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


# -- phases ----------------------------------------------------------------------------------------------------------
def _reference_route(model, mode: str, plans):
    """One process: transformers' dense, the shard-local plan, the global plan."""
    import kascade

    plan, local = plans
    if mode == "plain":
        return contextlib.nullcontext()
    return kascade.enable(model, local if mode == "shard-local" else plan, warn_uncalibrated=False)


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
