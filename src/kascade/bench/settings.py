"""What every configuration of `kascade bench` is measured with: :class:`Settings`, validated once."""

from __future__ import annotations

from dataclasses import dataclass

import torch

GB = 1024**3
# How decode steps can run: through transformers' generate, eagerly ("eager") or compiled over a static cache
# ("compiled"); and GraphDecoder's CUDA-graph replays ("graph"). The CLI's --decode-modes takes any of them.
DECODE_MODES = ("eager", "compiled", "graph")


@dataclass(frozen=True)
class Settings:
    """What every configuration is measured with (see ``kascade bench --help``)."""

    lengths: tuple[int, ...] = (32768, 65536, 131072)
    batches: tuple[int, ...] = (1, 8)
    pairs: tuple[tuple[int, int], ...] | None = None  # (batch, length) configurations instead of every batch x length
    repeats: int = 1
    decode_steps: int = 16
    warmup_decode_steps: int | None = None  # None: 2 in graph mode, 16 eager (kernels specialise on N % 16)
    prefill_chunk: int = 0  # 0: the whole prompt in one forward
    backend: str = "auto"
    decode: str | None = None  # "graph" | "eager"; None: graph on CUDA (without prefill_chunk), else eager
    generate: tuple[str, ...] = ()  # also through generate: "eager" (its DynamicCache), "compiled" (static, compiled)
    compile_backend: str = "inductor"  # torch.compile's backend for generate's compiled mode
    seed: int = 0
    device: str = "cpu"
    memory_limit_gb: float | None = None  # None: the device's free memory (no check on CPU)
    time_budget_s: float | None = 480.0

    def __post_init__(self):
        if self.pairs is not None:
            pairs = tuple(sorted({(int(b), int(n)) for b, n in self.pairs}))
            if not pairs:
                raise ValueError("pairs must name at least one (batch, length) configuration")
            object.__setattr__(self, "pairs", pairs)
            object.__setattr__(self, "batches", tuple(sorted({b for b, _ in pairs})))
            object.__setattr__(self, "lengths", tuple(sorted({n for _, n in pairs})))
        object.__setattr__(self, "lengths", tuple(int(x) for x in self.lengths))
        object.__setattr__(self, "batches", tuple(int(x) for x in self.batches))
        for name in ("lengths", "batches"):
            vals = getattr(self, name)
            if not vals or any(v < 1 for v in vals):
                raise ValueError(f"{name} must be positive integers, got {list(vals)}")
        if self.repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {self.repeats}")
        if self.decode_steps < 1:
            raise ValueError(f"decode_steps must be >= 1, got {self.decode_steps}")
        if self.backend == "triton" and torch.device(self.device).type != "cuda":
            raise ValueError(f"backend 'triton' runs the Triton kernels on a CUDA device, not on {self.device!r}; "
                             "use backend 'auto' or 'reference'")
        if self.decode is None:
            cuda = torch.device(self.device).type == "cuda"
            object.__setattr__(self, "decode", "graph" if cuda and not self.prefill_chunk else "eager")
        if self.decode not in ("graph", "eager"):
            raise ValueError(f"decode must be 'graph' or 'eager', got {self.decode!r}")
        if self.decode == "graph" and torch.device(self.device).type != "cuda":
            raise ValueError("decode='graph' (CUDA graphs) needs a CUDA device; use decode='eager'")
        if self.decode == "graph" and self.prefill_chunk:
            raise ValueError("--prefill-chunk needs --decode eager (graph decoding prefills into a static cache)")
        object.__setattr__(self, "generate", tuple(self.generate))
        bad = [m for m in self.generate if m not in DECODE_MODES or m == "graph"]
        if bad or len(set(self.generate)) != len(self.generate):
            raise ValueError(f"generate modes must be distinct ones of 'eager', 'compiled', got {list(self.generate)}")
        if "compiled" in self.generate and self.prefill_chunk:
            raise ValueError("generate's compiled mode prefills the whole prompt at once: drop --prefill-chunk or "
                             "the compiled mode")
        if self.warmup_decode_steps is None:
            object.__setattr__(self, "warmup_decode_steps", 2 if self.decode == "graph" else 16)
        if self.warmup_decode_steps < 0 or self.prefill_chunk < 0:
            raise ValueError("warmup_decode_steps and prefill_chunk must be >= 0")
        if self.memory_limit_gb is not None and self.memory_limit_gb <= 0:
            raise ValueError(f"memory_limit_gb must be positive, got {self.memory_limit_gb}")

    def configurations(self) -> list[tuple[int, int]]:
        """The (batch, length) configurations of a model, in the order they run: ``pairs``, else every batch x
        length; by batch, then length."""
        if self.pairs is not None:
            return list(self.pairs)
        return [(b, n) for b in sorted(self.batches) for n in sorted(self.lengths)]

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32 if self.device == "cpu" else torch.bfloat16
