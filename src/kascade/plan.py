"""KascadePlan: which layers are anchors, which anchor head each reuse head follows, and the budget.

A plan is made once per model (by calibration, or the uncalibrated uniform default), saved as JSON, and checked
against the model it is enabled on through a fingerprint of the attention shapes.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from .budget import Budget


@dataclass(frozen=True)
class ModelFingerprint:
    """The attention shape a plan was made for."""

    architecture: str  # transformers' model_type, e.g. "llama"
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int

    def __post_init__(self):
        for f in ("num_layers", "num_q_heads", "num_kv_heads", "head_dim"):
            x = getattr(self, f)
            if not isinstance(x, int) or x < 1:
                raise ValueError(f"fingerprint {f} must be a positive integer, got {x!r}")
        if self.num_q_heads % self.num_kv_heads:
            raise ValueError(f"query heads ({self.num_q_heads}) must be a multiple of KV heads ({self.num_kv_heads})")

    @classmethod
    def from_config(cls, config) -> "ModelFingerprint":
        cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
        hq = cfg.num_attention_heads
        return cls(
            architecture=str(cfg.model_type),
            num_layers=int(cfg.num_hidden_layers),
            num_q_heads=int(hq),
            num_kv_heads=int(getattr(cfg, "num_key_value_heads", None) or hq),
            head_dim=int(getattr(cfg, "head_dim", None) or cfg.hidden_size // hq),
        )

    @classmethod
    def from_model(cls, model) -> "ModelFingerprint":
        return cls.from_config(model.config)

    def differences(self, other: "ModelFingerprint") -> list[str]:
        return [
            f"{f.name}: plan has {getattr(self, f.name)!r}, model has {getattr(other, f.name)!r}"
            for f in dataclasses.fields(self)
            if getattr(self, f.name) != getattr(other, f.name)
        ]


@dataclass(frozen=True)
class KascadePlan:
    """Anchors, head map and budget for one model.

    anchors:    sorted layer indices that select their own top-k keys; always contains 0 (layer 0 is dense).
    head_map:   one row per layer, ``head_map[l][h]`` = the KV head of ``anchor_of(l)`` whose index set KV head
                ``h`` of layer ``l`` uses. Rows of anchor layers are the identity.
    ratio, k_min, tile, rolling: the budget (see :class:`kascade.budget.Budget`).
    calibrated: False for the uniform default that no calibration chose.
    source:     a human-readable note on where the plan came from.
    """

    fingerprint: ModelFingerprint
    anchors: tuple[int, ...]
    head_map: tuple[tuple[int, ...], ...]
    ratio: float = 0.10
    k_min: int = 128
    tile: int = 32
    rolling: bool = True
    calibrated: bool = False
    source: str = ""

    def __post_init__(self):
        object.__setattr__(self, "anchors", tuple(int(a) for a in self.anchors))
        object.__setattr__(self, "head_map", tuple(tuple(int(h) for h in row) for row in self.head_map))
        fp = self.fingerprint
        n, H = fp.num_layers, fp.num_kv_heads
        a = self.anchors
        if not a or a[0] != 0:
            raise ValueError(f"anchors must start with layer 0 (layer 0 is always a dense anchor), got {list(a)}")
        if list(a) != sorted(set(a)):
            raise ValueError(f"anchors must be strictly increasing, got {list(a)}")
        if a[-1] >= n:
            raise ValueError(f"anchor {a[-1]} is out of range for a model of {n} layers")
        if len(self.head_map) != n:
            raise ValueError(f"head_map must have one row per layer ({n}), got {len(self.head_map)}")
        for layer, row in enumerate(self.head_map):
            if len(row) != H:
                raise ValueError(f"head_map[{layer}] must have {H} entries (KV heads), got {len(row)}")
            if any(h < 0 or h >= H for h in row):
                raise ValueError(f"head_map[{layer}] = {list(row)} has heads outside 0..{H - 1}")
            if layer in a and row != tuple(range(H)):
                raise ValueError(f"head_map[{layer}] must be the identity: layer {layer} is an anchor")
        self.budget  # validates ratio, k_min, tile

    # -- structure ---------------------------------------------------------------------------------------------
    @property
    def budget(self) -> Budget:
        return Budget(ratio=self.ratio, k_min=self.k_min, tile=self.tile, rolling=self.rolling)

    @property
    def num_layers(self) -> int:
        return self.fingerprint.num_layers

    def is_anchor(self, layer: int) -> bool:
        return layer in self.anchors

    def anchor_of(self, layer: int) -> int:
        """The nearest anchor at or below ``layer``."""
        return max(a for a in self.anchors if a <= layer)

    def with_budget(self, **changes) -> "KascadePlan":
        """A copy with other budget settings (ratio, k_min, tile, rolling)."""
        bad = set(changes) - {"ratio", "k_min", "tile", "rolling"}
        if bad:
            raise TypeError(f"with_budget takes ratio, k_min, tile, rolling; got {sorted(bad)}")
        return dataclasses.replace(self, **changes)

    # -- constructors ------------------------------------------------------------------------------------------
    @classmethod
    def uniform(cls, fingerprint: ModelFingerprint, num_anchors: int = 6, **budget) -> "KascadePlan":
        """Uncalibrated default: layer 0 plus evenly spaced anchors, identity head map."""
        n = fingerprint.num_layers
        if not 1 <= num_anchors <= n:
            raise ValueError(f"num_anchors must be in 1..{n}, got {num_anchors}")
        anchors = sorted({math.floor(i * n / num_anchors) for i in range(num_anchors)})
        ident = tuple(range(fingerprint.num_kv_heads))
        return cls(fingerprint, tuple(anchors), (ident,) * n, calibrated=False,
                   source=f"uniform: {num_anchors} evenly spaced anchors, identity head map (uncalibrated)", **budget)

    @classmethod
    def all_anchors(cls, fingerprint: ModelFingerprint, **budget) -> "KascadePlan":
        """Every layer selects its own top-k (the 'oracle' at the same budget)."""
        n = fingerprint.num_layers
        ident = tuple(range(fingerprint.num_kv_heads))
        return cls(fingerprint, tuple(range(n)), (ident,) * n, calibrated=False,
                   source="oracle: every layer is an anchor", **budget)

    # -- checks ------------------------------------------------------------------------------------------------
    def check_model(self, model) -> None:
        """Raise ValueError if this plan was made for a model of another shape."""
        diffs = self.fingerprint.differences(ModelFingerprint.from_model(model))
        if diffs:
            raise ValueError("this Kascade plan was made for another model: " + "; ".join(diffs))

    # -- JSON --------------------------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["anchors"] = list(self.anchors)
        d["head_map"] = [list(r) for r in self.head_map]
        return {"format": "kascade-plan/1", **d}

    @classmethod
    def from_dict(cls, d: dict) -> "KascadePlan":
        d = dict(d)
        fmt = d.pop("format", None)
        if fmt != "kascade-plan/1":
            raise ValueError(f"not a Kascade plan (format {fmt!r}, expected 'kascade-plan/1')")
        try:
            fp = ModelFingerprint(**d.pop("fingerprint"))
            return cls(fingerprint=fp, **d)
        except TypeError as e:
            raise ValueError(f"malformed Kascade plan: {e}") from None

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    @classmethod
    def from_json(cls, text: str) -> "KascadePlan":
        return cls.from_dict(json.loads(text))

    def save(self, path) -> None:
        Path(path).write_text(self.to_json() + "\n")

    @classmethod
    def load(cls, path) -> "KascadePlan":
        return cls.from_json(Path(path).read_text())


def shipped_plans() -> list[KascadePlan]:
    """The calibrated plans that ship inside the package (``kascade/plans/*.json``)."""
    folder = resources.files("kascade") / "plans"
    if not folder.is_dir():
        return []
    return [KascadePlan.from_json(f.read_text()) for f in sorted(folder.iterdir(), key=lambda f: f.name)
            if f.name.endswith(".json")]


def default_plan(model, num_anchors: int = 6) -> KascadePlan:
    """The shipped calibrated plan whose fingerprint matches ``model``, else the uncalibrated uniform plan."""
    fp = ModelFingerprint.from_model(model)
    for plan in shipped_plans():
        if plan.fingerprint == fp:
            return plan
    return KascadePlan.uniform(fp, num_anchors=min(num_anchors, fp.num_layers))
