"""KascadePlan: which layers are anchors, which anchor head each reuse head follows, and the budget.

A plan is made once per model (by calibration, or the uncalibrated uniform default), saved as JSON, and checked
against the model it is enabled on through a fingerprint of the attention shapes.

The JSON form is :mod:`kascade.plan.json_form`'s; the plans that ship with the package are in
:mod:`kascade.plan.shipped`.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from .. import _renamed
from ..budget import Budget
from . import json_form
from .reuse_rule import Reuse, _is_int


def _ints(name: str, values) -> tuple[int, ...]:
    """``values`` as a tuple of ints; TypeError naming ``name`` for anything that is not an integer."""
    if isinstance(values, (str, bytes)) or not hasattr(values, "__iter__"):
        raise TypeError(f"{name} must be a sequence of integers, got {values!r}")
    values = tuple(values)
    bad = [v for v in values if not _is_int(v)]
    if bad:
        raise TypeError(f"{name} must hold integers, got {bad[0]!r} in {list(values)}")
    return tuple(int(v) for v in values)


@dataclass(frozen=True)
class ModelFingerprint:
    """The attention shape a plan was made for."""

    architecture: str  # transformers' model_type, e.g. "llama"
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int

    def __post_init__(self):
        if not isinstance(self.architecture, str):
            raise TypeError(f"fingerprint architecture must be a string, got {self.architecture!r}")
        for f in ("num_layers", "num_q_heads", "num_kv_heads", "head_dim"):
            x = getattr(self, f)
            if not _is_int(x) or x < 1:
                raise ValueError(f"fingerprint {f} must be a positive integer, got {x!r}")
            object.__setattr__(self, f, int(x))
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
    ratio, k_min, tile, rolling, mass, score_dtype, dense_tail: the budget (see :class:`kascade.budget.Budget`;
                ``mass``: rows keep keys by attention mass, ``ratio`` then caps them; ``score_dtype`` "fp8" / "int8": the
                anchors rank keys by FP8 / INT8 scores; ``dense_tail``: a prefill's last queries attend densely).
    calibrated: False for the uniform default that no calibration chose.
    source:     a human-readable note on where the plan came from.
    reuse:      the reuse rule (:class:`Reuse`; default: the paper's).
    by_length:  ``((max_n, plan), ...)`` with increasing ``max_n``: a forward whose longest sequence has at most
                ``max_n`` keys uses that sub-plan (the first that fits); longer ones use this plan's own fields.
    tensor_parallel: the tensor-parallel size the plan was made *shard-local* for (every reuse head follows an
                anchor head of its own rank: :meth:`for_tensor_parallel`), or None (any head may follow any head).
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
    reuse: Reuse = Reuse()
    by_length: tuple = ()
    tensor_parallel: int | None = None
    mass: float | None = None
    score_dtype: str | None = None
    dense_tail: int = 0

    def __post_init__(self):
        if not isinstance(self.fingerprint, ModelFingerprint):
            raise TypeError(f"fingerprint must be a ModelFingerprint, got {type(self.fingerprint).__name__}")
        object.__setattr__(self, "anchors", _ints("anchors", self.anchors))
        if isinstance(self.head_map, (str, bytes)) or not hasattr(self.head_map, "__iter__"):
            raise TypeError(f"head_map must be one row of KV heads per layer, got {self.head_map!r}")
        object.__setattr__(self, "head_map", tuple(_ints(f"head_map[{i}]", row) for i, row in enumerate(self.head_map)))
        for name in ("rolling", "calibrated"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if not isinstance(self.source, str):
            raise TypeError(f"source must be a string, got {self.source!r}")
        if not isinstance(self.reuse, Reuse):
            raise TypeError(f"reuse must be a kascade.plan.Reuse, got {type(self.reuse).__name__}")
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
        self.budget  # validates ratio, k_min, tile, mass, score_dtype, dense_tail
        if self.mass is not None and (self.reuse.sources is not None or self.reuse.recent):
            raise ValueError("a budget by attention mass takes the paper's reuse or per-layer budgets (reuse.scale); "
                             "the sources and sinks + recent rules count keys by the geometry")
        self._check_reuse()
        self._check_by_length()
        if self.tensor_parallel is not None:
            tp = self.tensor_parallel
            if not _is_int(tp) or tp < 1 or H % tp:
                raise ValueError(f"tensor_parallel must be a positive integer dividing the {H} KV heads, got {tp!r}")
            cross = self.crossing_links(tp)
            if cross:
                raise ValueError(f"the plan says it is shard-local for tensor_parallel={tp} but links heads across "
                                 f"shards: (layer, head, anchor layer, anchor head) {cross[:3]}")

    def _check_reuse(self):
        n, H, a, r = self.num_layers, self.fingerprint.num_kv_heads, self.anchors, self.reuse
        if r.sources is not None:
            if len(r.sources) != n:
                raise ValueError(f"reuse sources must have one row per layer ({n}), got {len(r.sources)}")
            for layer, row in enumerate(r.sources):
                if len(row) != H:
                    raise ValueError(f"reuse sources[{layer}] must have {H} entries (KV heads), got {len(row)}")
                for h, pairs in enumerate(row):
                    if layer in a:
                        if pairs != ((layer, h),):
                            raise ValueError(f"reuse sources[{layer}][{h}] must be (({layer}, {h}),): layer {layer} "
                                             f"is an anchor, got {pairs}")
                        continue
                    if not 1 <= len(pairs) <= 2 or len(set(pairs)) != len(pairs):
                        raise ValueError(f"reuse sources[{layer}][{h}] must name one or two distinct (anchor, head) "
                                         f"pairs, got {pairs}")
                    for al, ah in pairs:
                        if al not in a or al > layer:
                            raise ValueError(f"reuse sources[{layer}][{h}] names layer {al}, which is not an anchor "
                                             f"at or below layer {layer} (anchors {list(a)})")
                        if not 0 <= ah < H:
                            raise ValueError(f"reuse sources[{layer}][{h}] names head {ah}, outside 0..{H - 1}")
        if r.factor is not None:
            if len(r.factor) != n:
                raise ValueError(f"reuse factor must have one entry per layer ({n}), got {len(r.factor)}")
            if r.factor[0] != 1.0:
                raise ValueError(f"reuse factor[0] must be 1.0 (layer 0 is dense), got {r.factor[0]}")

    def _check_by_length(self):
        bl = self.by_length
        if isinstance(bl, (str, bytes)) or not hasattr(bl, "__iter__"):
            raise TypeError(f"by_length must be a sequence of (max_n, plan) pairs, got {bl!r}")
        bl = tuple(tuple(e) for e in bl)
        for i, e in enumerate(bl):
            if len(e) != 2 or not _is_int(e[0]):
                raise TypeError(f"by_length[{i}] must be a (max_n: int, plan) pair, got {e!r}")
        bl = tuple((int(m), p) for m, p in bl)
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

    # -- the reuse rule ----------------------------------------------------------------------------------------
    @property
    def ranked(self) -> bool:
        """Whether the anchors keep their keys in rank order (the reuse rule is not the paper's)."""
        return self.reuse.ranked

    def for_length(self, n: int) -> "KascadePlan":
        """The (sub-)plan that serves a forward whose longest sequence has ``n`` keys."""
        for m, p in self.by_length:
            if n <= m:
                return p
        return self

    def sources_of(self, layer: int) -> tuple[tuple[tuple[int, int], ...], ...]:
        """Per KV head of ``layer``: the (anchor layer, anchor head) pairs it reuses."""
        if self.reuse.sources is not None:
            return self.reuse.sources[layer]
        a = self.anchor_of(layer)
        return tuple(((a, h),) for h in self.head_map[layer])

    scale = _renamed.attribute("layer_factor", _renamed.FACTOR)
    depth = _renamed.attribute("rank_factor", _renamed.RANK_FACTOR)

    def layer_factor(self, layer: int) -> float:
        """The multiplier of ``layer``'s row budget (1 under the paper's rule)."""
        return 1.0 if self.reuse.factor is None else self.reuse.factor[layer]

    def rank_factor(self, anchor: int) -> float:
        """How deep ``anchor`` ranks its keys, as a multiple of the row budget: the largest factor among the layers
        whose sets draw on it, its own included."""
        return max(self.layer_factor(l) for l in self._readers[anchor])

    def last_reader(self, anchor: int) -> int:
        """The last layer that reads ``anchor``'s selection (after it, the selection can be dropped)."""
        return max(self._readers[anchor])

    @cached_property
    def _readers(self) -> dict[int, tuple[int, ...]]:
        """Per anchor, the layers that use its selection (itself included)."""
        readers = {a: {a} for a in self.anchors}
        for layer in range(self.num_layers):
            if not self.is_anchor(layer):
                for pairs in self.sources_of(layer):
                    for al, _ in pairs:
                        readers[al].add(layer)
        return {a: tuple(sorted(r)) for a, r in readers.items()}

    # -- structure ---------------------------------------------------------------------------------------------
    @property
    def budget(self) -> Budget:
        return Budget(ratio=self.ratio, k_min=self.k_min, tile=self.tile, rolling=self.rolling, mass=self.mass,
                      score_dtype=self.score_dtype, dense_tail=self.dense_tail)

    @property
    def num_layers(self) -> int:
        return self.fingerprint.num_layers

    def is_anchor(self, layer: int) -> bool:
        return layer in self.anchors

    def anchor_of(self, layer: int) -> int:
        """The nearest anchor at or below ``layer``."""
        found = 0
        for a in self.anchors:  # increasing, from 0 (a loop torch.compile can trace, unlike bisect)
            if a > layer:
                break
            found = a
        return found

    def with_budget(self, **changes) -> "KascadePlan":
        """A copy with other budget settings (ratio, k_min, tile, rolling, mass, score_dtype, dense_tail)."""
        bad = set(changes) - {"ratio", "k_min", "tile", "rolling", "mass", "score_dtype", "dense_tail"}
        if bad:
            raise TypeError(f"with_budget takes ratio, k_min, tile, rolling, mass, score_dtype, dense_tail; got "
                            f"{sorted(bad)}")
        subs = tuple((m, dataclasses.replace(p, **changes)) for m, p in self.by_length)
        return dataclasses.replace(self, by_length=subs, **changes)

    # -- tensor parallelism ------------------------------------------------------------------------------------
    def crossing_links(self, tp: int) -> list[tuple[int, int, int, int]]:
        """The links ``(layer, head, anchor layer, anchor head)`` that cross tensor-parallel shards when the KV heads
        are split into ``tp`` equal, contiguous shards (empty: the plan runs shard-local at that size)."""
        H = self.fingerprint.num_kv_heads
        if not _is_int(tp) or tp < 1:
            raise ValueError(f"tensor-parallel size must be an integer >= 1, got {tp!r}")
        if H % tp:
            raise ValueError(f"tensor-parallel size {tp} does not divide the model's {H} KV heads")
        per = H // tp
        return [(l, h, al, ah) for l in range(self.num_layers) if not self.is_anchor(l)
                for h, pairs in enumerate(self.sources_of(l)) for al, ah in pairs if ah // per != h // per]

    def for_tensor_parallel(self, tp: int, similarity=None) -> "KascadePlan":
        """This plan made shard-local for ``tp`` ranks: every link that crosses shards is moved to an anchor head of
        the reuse head's own shard, the most similar one by the calibration statistics' ``similarity[a, b, hb, ha]``
        (:class:`kascade.calibrate.stats.CalibrationStats`, ``[layers, layers, heads, heads]``) when given, else the
        head with the reuse head's own index (which every shard holds). Links within a shard are kept."""
        H = self.fingerprint.num_kv_heads
        cross = self.crossing_links(tp)  # checks that tp divides H
        per = H // tp

        def local(layer, h, al):
            shard = range(h // per * per, h // per * per + per)
            if similarity is None:
                return h
            return max(shard, key=lambda a: (float(similarity[al, layer, h, a]), -a))

        head_map = [list(row) for row in self.head_map]
        sources = None if self.reuse.sources is None else [[list(p) for p in row] for row in self.reuse.sources]
        for l, h, al, ah in cross:
            if sources is None:
                head_map[l][h] = local(l, h, al)
            else:
                pairs = [(a, local(l, h, a) if a == al and x == ah else x) for a, x in sources[l][h]]
                sources[l][h] = list(dict.fromkeys(pairs))  # a union may collapse to one source
        reuse = self.reuse if sources is None else dataclasses.replace(self.reuse, sources=sources)
        # one replace: the shard-local size is checked against the moved links, never against the old ones
        return dataclasses.replace(self, head_map=tuple(map(tuple, head_map)), reuse=reuse, tensor_parallel=tp,
                                   by_length=tuple((m, p.for_tensor_parallel(tp, similarity)) for m, p in self.by_length),
                                   source=f"{self.source}; shard-local for tensor_parallel={tp} "
                                   f"({len(cross)} links moved into their shard"
                                   f"{' by similarity' if similarity is not None else ' to the same head'})")

    def with_reuse(self, **changes) -> "KascadePlan":
        """A copy whose reuse rule has other fields (``factor``, ``sources``, ``sinks``, ``recent``)."""
        return dataclasses.replace(self, reuse=dataclasses.replace(self.reuse, **changes))

    # -- constructors ------------------------------------------------------------------------------------------
    @classmethod
    def uniform(cls, fingerprint: ModelFingerprint, num_anchors: int = 6, **budget) -> "KascadePlan":
        """Uncalibrated default: layer 0 plus evenly spaced anchors, identity head map."""
        n = fingerprint.num_layers
        if not _is_int(num_anchors) or not 1 <= num_anchors <= n:
            raise ValueError(f"num_anchors must be in 1..{n}, got {num_anchors!r}")
        anchors = sorted({math.floor(i * n / num_anchors) for i in range(num_anchors)})
        ident = tuple(range(fingerprint.num_kv_heads))
        return cls(fingerprint, tuple(anchors), (ident,) * n, calibrated=False,
                   source=f"uniform: {num_anchors} evenly spaced anchors, identity head map (uncalibrated)", **budget)

    @classmethod
    def from_anchors(cls, model, anchors, *, topk: int | None = None, ratio: float | None = None,
                     **budget) -> "KascadePlan":
        """The paper's one-call form, ``kascade_attention(q, k, v, topk=64, anchors=[2, 6, 10])``, as a plan: these
        anchor layers (layer 0, always dense, is added), every reuse head following the same head of its nearest
        anchor (identity head map: no calibration), and a fixed ``topk`` keys per row (``ratio=0, k_min=topk``) or
        a ``ratio`` of the context (with ``k_min``, default 128). ``model``: a model or its
        :class:`ModelFingerprint`; ``budget``: ``k_min``, ``tile``, ``rolling``. Calibration (``kascade
        calibrate``) chooses better anchors and head maps."""
        fp = model if isinstance(model, ModelFingerprint) else ModelFingerprint.from_model(model)
        if (topk is None) == (ratio is None):
            raise ValueError("give one of topk (a fixed number of keys per row) and ratio (a fraction of the context)")
        if topk is not None:
            if not _is_int(topk) or topk < 1:
                raise ValueError(f"topk must be an integer >= 1, got {topk!r}")
            if "k_min" in budget:
                raise ValueError("topk is the number of keys (k_min): give one of them")
            budget.update(ratio=0.0, k_min=int(topk))
        else:
            budget["ratio"] = ratio
        anchors = sorted({0, *_ints("anchors", anchors)})
        ident = tuple(range(fp.num_kv_heads))
        what = f"top-{topk}" if topk is not None else f"ratio {ratio}"
        return cls(fp, tuple(anchors), (ident,) * fp.num_layers, calibrated=False,
                   source=f"from_anchors: anchors {anchors}, {what}, identity head map (uncalibrated)", **budget)

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
        """JSON-ready dict in format ``kascade-plan/4`` (:mod:`kascade.plan.json_form`)."""
        return json_form.to_dict(self)

    @classmethod
    def from_dict(cls, d) -> "KascadePlan":
        """A plan from its JSON form (any format :mod:`kascade.plan.json_form` reads), checked strictly; ValueError naming
        the field."""
        return cls._from_fields(json_form.fields(d))

    @classmethod
    def _from_fields(cls, f: dict) -> "KascadePlan":
        f = dict(f)
        where, fp = f.pop("where"), f.pop("fingerprint")
        by_length = tuple((m, cls._from_fields(sub)) for m, sub in f.pop("by_length"))
        try:
            return cls(ModelFingerprint(**fp), by_length=by_length, **f)
        except (TypeError, ValueError) as e:
            raise ValueError(f"malformed Kascade plan ({where}): {e}") from None

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    @classmethod
    def from_json(cls, text: str) -> "KascadePlan":
        try:
            d = json.loads(text, object_pairs_hook=_no_repeated_keys)
        except json.JSONDecodeError as e:
            raise ValueError(f"not a Kascade plan: invalid JSON ({e.msg} at line {e.lineno})") from None
        return cls.from_dict(d)

    def save(self, path) -> None:
        Path(path).write_text(self.to_json() + "\n")

    @classmethod
    def load(cls, path) -> "KascadePlan":
        path = Path(path)
        if not path.is_file():
            raise ValueError(f"no plan file at {path}" + (" (it is a folder)" if path.is_dir() else ""))
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            raise ValueError(f"the plan file {path} is not UTF-8 text (not a Kascade plan)") from None
        return cls.from_json(text)


def _no_repeated_keys(pairs) -> dict:
    """A JSON object, refused when it gives a key twice (json keeps the last silently: an edited plan file would
    run with a value its reader may not have seen)."""
    d = {}
    for key, value in pairs:
        if key in d:
            raise ValueError(f"not a Kascade plan: the key {key!r} is given twice in one JSON object")
        d[key] = value
    return d
