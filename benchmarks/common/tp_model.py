"""The tensor-parallel benchmark's model and plans (``python -m benchmarks.tp_bench``): the ranks, the random weights
written once and sharded by transformers, the plans measured, and the routing of each mode."""

from __future__ import annotations

import contextlib
import gc
import json
import os
import shutil
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from .report import log

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


# -- phases ----------------------------------------------------------------------------------------------------------
def _reference_route(model, mode: str, plans):
    """One process: transformers' dense, the shard-local plan, the global plan."""
    import kascade

    plan, local = plans
    if mode == "plain":
        return contextlib.nullcontext()
    return kascade.enable(model, local if mode == "shard-local" else plan, warn_uncalibrated=False)
