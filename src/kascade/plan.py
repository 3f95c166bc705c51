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

    Optional variant fields (issue 8; format ``kascade-plan/2`` when any is set, see :mod:`kascade.reuse`):

    sources:     per layer, per KV head, the ``(anchor layer, anchor KV head)`` pairs whose rankings the head
                 reuses (one: follow that head, which may belong to any earlier anchor; two: the union, merged
                 rank by rank). Anchor layers list themselves. When set it replaces ``head_map`` for reuse layers.
    layer_scale: per layer, a multiplier of the row budget (layer 0, dense, must be 1.0). An anchor ranks as many
                 keys as the largest budget among the layers it serves; each layer takes a prefix.
    sinks, recent: a reuse row keeps the first ``sinks`` keys plus the most recent keys, ``recent`` of its budget
                 in all (sinks included), and fills the rest from its sources' rankings.
    by_length:   ``((max_n, plan), ...)`` with increasing ``max_n``: a forward whose longest sequence has at most
                 ``max_n`` keys uses that sub-plan (the first that fits); longer ones use this plan's own fields.
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
    sources: tuple | None = None
    layer_scale: tuple[float, ...] | None = None
    sinks: int = 0
    recent: float = 0.0
    by_length: tuple = ()

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
        self._check_variant_fields()

    def _check_variant_fields(self):
        n, H, a = self.num_layers, self.fingerprint.num_kv_heads, self.anchors
        if self.sources is not None:
            src = tuple(tuple(tuple((int(x), int(y)) for x, y in head) for head in row) for row in self.sources)
            object.__setattr__(self, "sources", src)
            if len(src) != n:
                raise ValueError(f"sources must have one row per layer ({n}), got {len(src)}")
            for layer, row in enumerate(src):
                if len(row) != H:
                    raise ValueError(f"sources[{layer}] must have {H} entries (KV heads), got {len(row)}")
                for h, pairs in enumerate(row):
                    if layer in a:
                        if pairs != ((layer, h),):
                            raise ValueError(f"sources[{layer}][{h}] must be (({layer}, {h}),): layer {layer} is an "
                                             f"anchor, got {pairs}")
                        continue
                    if not 1 <= len(pairs) <= 2 or len(set(pairs)) != len(pairs):
                        raise ValueError(f"sources[{layer}][{h}] must name one or two distinct (anchor, head) "
                                         f"pairs, got {pairs}")
                    for al, ah in pairs:
                        if al not in a or al > layer:
                            raise ValueError(f"sources[{layer}][{h}] names layer {al}, which is not an anchor at "
                                             f"or below layer {layer} (anchors {list(a)})")
                        if not 0 <= ah < H:
                            raise ValueError(f"sources[{layer}][{h}] names head {ah}, outside 0..{H - 1}")
        if self.layer_scale is not None:
            ls = tuple(float(x) for x in self.layer_scale)
            object.__setattr__(self, "layer_scale", ls)
            if len(ls) != n:
                raise ValueError(f"layer_scale must have one entry per layer ({n}), got {len(ls)}")
            if not all(math.isfinite(x) and x > 0 for x in ls):
                raise ValueError(f"layer_scale entries must be finite and > 0, got {list(ls)}")
            if ls[0] != 1.0:
                raise ValueError(f"layer_scale[0] must be 1.0 (layer 0 is dense), got {ls[0]}")
        if not isinstance(self.sinks, int) or self.sinks < 0:
            raise ValueError(f"sinks must be an integer >= 0, got {self.sinks!r}")
        if not isinstance(self.recent, (int, float)) or not 0.0 <= self.recent <= 1.0:
            raise ValueError(f"recent must be in [0, 1], got {self.recent!r}")
        if self.sinks and not self.recent:
            raise ValueError("sinks > 0 needs recent > 0: the sinks are counted inside the recent share of the budget")
        bl = tuple((int(m), p) for m, p in self.by_length)
        object.__setattr__(self, "by_length", bl)
        for i, (m, p) in enumerate(bl):
            if not isinstance(p, KascadePlan):
                raise TypeError(f"by_length[{i}] must hold a KascadePlan, got {type(p).__name__}")
            if m < 1 or (i and m <= bl[i - 1][0]):
                raise ValueError(f"by_length bounds must be positive and increasing, got {[x for x, _ in bl]}")
            if p.by_length:
                raise ValueError("a by_length sub-plan cannot hold sub-plans itself")
            if p.fingerprint != self.fingerprint:
                raise ValueError(f"by_length[{i}] was made for another model: "
                                 + "; ".join(p.fingerprint.differences(self.fingerprint)))
            if p.budget != self.budget:
                raise ValueError(f"by_length[{i}] has budget {p.budget}, the plan {self.budget}: one budget per plan")

    # -- variants ----------------------------------------------------------------------------------------------
    @property
    def ranked(self) -> bool:
        """Whether reuse layers build their sets from anchors' rankings (any variant field set) rather than by the
        faithful head-map remap."""
        return self.sources is not None or self.layer_scale is not None or self.recent > 0

    def for_length(self, n: int) -> "KascadePlan":
        """The (sub-)plan that serves a forward whose longest sequence has ``n`` keys."""
        for m, p in self.by_length:
            if n <= m:
                return p
        return self

    def sources_of(self, layer: int) -> tuple[tuple[tuple[int, int], ...], ...]:
        """Per KV head of ``layer``: the (anchor layer, anchor head) pairs it reuses."""
        if self.sources is not None:
            return self.sources[layer]
        a = self.anchor_of(layer)
        return tuple(((a, h),) for h in self.head_map[layer])

    def scale_of(self, layer: int) -> float:
        return 1.0 if self.layer_scale is None else self.layer_scale[layer]

    def rank_depth(self, anchor: int) -> float:
        """How many keys (as a multiple of the row budget) ``anchor`` must rank: the largest budget among the
        layers whose sets draw on it, its own included."""
        depth = self.scale_of(anchor)
        for layer in range(self.num_layers):
            if not self.is_anchor(layer) and any(al == anchor for pairs in self.sources_of(layer) for al, _ in pairs):
                depth = max(depth, self.scale_of(layer))
        return depth

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
        subs = tuple((m, dataclasses.replace(p, **changes)) for m, p in self.by_length)
        return dataclasses.replace(self, by_length=subs, **changes)

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
        """JSON-ready dict: format ``kascade-plan/1`` for a faithful plan (readable by older versions),
        ``kascade-plan/2`` when any variant field is set (only the fields that are set are written)."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in _V2_FIELDS}
        d["fingerprint"] = dataclasses.asdict(self.fingerprint)
        d["anchors"] = list(self.anchors)
        d["head_map"] = [list(r) for r in self.head_map]
        v2 = {}
        if self.sources is not None:
            v2["sources"] = [[[list(p) for p in head] for head in row] for row in self.sources]
        if self.layer_scale is not None:
            v2["layer_scale"] = list(self.layer_scale)
        if self.recent:
            v2["sinks"], v2["recent"] = self.sinks, self.recent
        if self.by_length:
            v2["by_length"] = [dict(max_n=m, plan=p.to_dict()) for m, p in self.by_length]
        return {"format": "kascade-plan/2" if v2 else "kascade-plan/1", **d, **v2}

    @classmethod
    def from_dict(cls, d: dict) -> "KascadePlan":
        d = dict(d)
        fmt = d.pop("format", None)
        if fmt not in FORMATS:
            raise ValueError(f"not a Kascade plan (format {fmt!r}, expected one of {FORMATS})")
        if fmt == "kascade-plan/1" and set(d) & _V2_FIELDS:
            raise ValueError(f"malformed Kascade plan: kascade-plan/1 has no fields {sorted(set(d) & _V2_FIELDS)}")
        try:
            fp = ModelFingerprint(**d.pop("fingerprint"))
            if "by_length" in d:
                d["by_length"] = tuple((int(e["max_n"]), cls.from_dict(e["plan"])) for e in d["by_length"])
            return cls(fingerprint=fp, **d)
        except (TypeError, KeyError) as e:
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


FORMATS = ("kascade-plan/1", "kascade-plan/2")
_V2_FIELDS = frozenset({"sources", "layer_scale", "sinks", "recent", "by_length"})


# Shipped plans: ``plans/<model>.json`` is the default; ``plans/<variant>/<model>.json`` are the alternatives a user
# can name (``enable(model, plan="faithful")``).
SHIPPED_VARIANTS = {
    "default": "the library's default, the most accurate at the paper's cost: anchors chosen by measured fidelity, "
               "per-layer budgets from each layer's measured sensitivity (same average budget; its anchors rank up "
               "to 2x deeper, see docs/variants)",
    "searched": "anchors chosen by measured fidelity, one budget for every layer (the faithful reuse rule: the "
                "cheapest decode selection)",
    "faithful": "the paper's method: the similarity DP's anchors and argmax head map",
}


def shipped_plans(variant: str = "default") -> list[KascadePlan]:
    """The calibrated plans that ship inside the package for ``variant`` (see :data:`SHIPPED_VARIANTS`)."""
    if variant not in SHIPPED_VARIANTS:
        raise ValueError(f"unknown shipped plan variant {variant!r}; choose from {', '.join(SHIPPED_VARIANTS)}")
    folder = resources.files("kascade") / "plans"
    if variant != "default":
        folder = folder / variant
    if not folder.is_dir():
        return []
    return [KascadePlan.from_json(f.read_text()) for f in sorted(folder.iterdir(), key=lambda f: f.name)
            if f.name.endswith(".json")]


def shipped_plan(model, variant: str = "default") -> KascadePlan:
    """The shipped ``variant`` plan for ``model``'s shape; ValueError (listing what exists) if there is none."""
    fp = ModelFingerprint.from_model(model)
    for plan in shipped_plans(variant):
        if plan.fingerprint == fp:
            return plan
    have = [v for v in SHIPPED_VARIANTS if any(p.fingerprint == fp for p in shipped_plans(v))]
    raise ValueError(f"no shipped {variant!r} plan for this model ({fp}); shipped for it: {have or 'none'} "
                     "(make one with `kascade calibrate`)")


def default_plan(model, num_anchors: int = 6) -> KascadePlan:
    """The shipped calibrated plan whose fingerprint matches ``model``, else the uncalibrated uniform plan."""
    fp = ModelFingerprint.from_model(model)
    for plan in shipped_plans():
        if plan.fingerprint == fp:
            return plan
    return KascadePlan.uniform(fp, num_anchors=min(num_anchors, fp.num_layers))
