"""The JSON form of a plan.

``kascade-plan/4`` is written; ``kascade-plan/1`` (anchors, head map, budget), ``kascade-plan/2`` (the reuse-rule
fields at the top level, the per-layer budget multiplier named ``layer_scale``) and ``kascade-plan/3`` (the reuse
section as in /4, the multiplier named ``scale``) still load: the multiplier is ``factor`` in /4, so that ``scale``
means the softmax scale alone. Files are parsed strictly: an
integer field holds an integer, a boolean field ``true`` or ``false``, unknown fields are refused, and an error names
the field and the value it found.

This module reads and writes the form only; :class:`~kascade.plan.KascadePlan` builds itself from :func:`fields`
(``KascadePlan.from_dict``), so that the plan's module imports this one and not the other way round.
"""

from __future__ import annotations

import dataclasses

from .reuse_rule import Reuse, _is_int, _is_number

FORMAT = "kascade-plan/4"
FORMATS = ("kascade-plan/1", "kascade-plan/2", "kascade-plan/3", FORMAT)
_V2_REUSE = {"sources": "sources", "layer_scale": "factor", "sinks": "sinks", "recent": "recent"}
_V3_REUSE = {"scale": "factor", "sources": "sources", "sinks": "sinks", "recent": "recent"}
_V4_REUSE = ("factor", "sources", "sinks", "recent")
_BASE_FIELDS = {"fingerprint", "anchors", "head_map", "ratio", "k_min", "tile", "rolling", "mass", "score_dtype",
                "dense_tail", "calibrated", "source"}


class _Field:
    """Strict reading of one JSON value: ``where`` names it in errors (``plan.anchors[2]``)."""

    @staticmethod
    def fail(where, want, value):
        raise ValueError(f"malformed Kascade plan: {where} must be {want}, got {value!r}")

    @classmethod
    def int(cls, where, v):
        if not _is_int(v):
            cls.fail(where, "an integer", v)
        return int(v)

    @classmethod
    def number(cls, where, v):
        if not _is_number(v):
            cls.fail(where, "a number", v)
        return float(v) if not _is_int(v) else v

    @classmethod
    def bool(cls, where, v):
        if not isinstance(v, bool):
            cls.fail(where, "true or false", v)
        return v

    @classmethod
    def str(cls, where, v):
        if not isinstance(v, str):
            cls.fail(where, "a string", v)
        return v

    @classmethod
    def list(cls, where, v):
        if not isinstance(v, list):
            cls.fail(where, "a list", v)
        return v

    @classmethod
    def obj(cls, where, v, keys, required=()):
        if not isinstance(v, dict):
            cls.fail(where, "a JSON object", v)
        unknown = sorted(set(v) - set(keys))
        if unknown:
            raise ValueError(f"malformed Kascade plan: {where} has unknown field(s) {unknown}")
        missing = [k for k in required if k not in v]
        if missing:
            raise ValueError(f"malformed Kascade plan: {where} lacks field(s) {missing}")
        return v


def _parse(d, where: str) -> dict:
    F = _Field
    if not isinstance(d, dict):
        raise ValueError(f"not a Kascade plan: {where} must be a JSON object, got {type(d).__name__} {d!r:.60}")
    fmt = d.get("format")
    if fmt not in FORMATS:
        raise ValueError(f"not a Kascade plan ({where}.format is {fmt!r}, expected one of {list(FORMATS)})")
    keys = {"format", *_BASE_FIELDS}
    if fmt in ("kascade-plan/3", FORMAT):
        keys |= {"reuse", "by_length", "tensor_parallel"}
    elif fmt == "kascade-plan/2":
        keys |= set(_V2_REUSE) | {"by_length"}
    F.obj(where, d, keys, required=("fingerprint", "anchors", "head_map"))
    fpd = F.obj(f"{where}.fingerprint", d["fingerprint"],
                ("architecture", "num_layers", "num_q_heads", "num_kv_heads", "head_dim"),
                required=("architecture", "num_layers", "num_q_heads", "num_kv_heads", "head_dim"))
    fp = dict(architecture=F.str(f"{where}.fingerprint.architecture", fpd["architecture"]),
              **{k: F.int(f"{where}.fingerprint.{k}", fpd[k]) for k in ("num_layers", "num_q_heads", "num_kv_heads",
                                                                        "head_dim")})
    anchors = [F.int(f"{where}.anchors[{i}]", a) for i, a in enumerate(F.list(f"{where}.anchors", d["anchors"]))]
    head_map = [[F.int(f"{where}.head_map[{l}][{h}]", x) for h, x in enumerate(F.list(f"{where}.head_map[{l}]", row))]
                for l, row in enumerate(F.list(f"{where}.head_map", d["head_map"]))]
    kw = {}
    for name, read in (("ratio", F.number), ("k_min", F.int), ("tile", F.int), ("rolling", F.bool),
                       ("mass", F.number), ("score_dtype", F.str), ("dense_tail", F.int), ("calibrated", F.bool),
                       ("source", F.str),
                       ("tensor_parallel", F.int)):
        if name in d:
            kw[name] = read(f"{where}.{name}", d[name])
    # the reuse fields under their /4 names, with the name the file used (for errors)
    if fmt == FORMAT:
        r = F.obj(f"{where}.reuse", d.get("reuse", {}), _V4_REUSE)
        named = {k: k for k in r}
    elif fmt == "kascade-plan/3":
        r3 = F.obj(f"{where}.reuse", d.get("reuse", {}), tuple(_V3_REUSE))
        r, named = {_V3_REUSE[k]: v for k, v in r3.items()}, {_V3_REUSE[k]: k for k in r3}
    else:
        r = {_V2_REUSE[k]: d[k] for k in _V2_REUSE if k in d}
        named = {_V2_REUSE[k]: k for k in _V2_REUSE if k in d}
    reuse = {}
    if "factor" in r:
        name = named["factor"]
        reuse["factor"] = [F.number(f"{where}.reuse.{name}[{i}]", x) for i, x in
                           enumerate(F.list(f"{where}.reuse.{name}", r["factor"]))]
    if "sources" in r:
        reuse["sources"] = [
            [[[F.int(f"{where}.reuse.sources[{l}][{h}][{j}]", x) for x in F.list(f"{where}.reuse.sources[{l}][{h}][{j}]", p)]
              for j, p in enumerate(F.list(f"{where}.reuse.sources[{l}][{h}]", head))]
             for h, head in enumerate(F.list(f"{where}.reuse.sources[{l}]", row))]
            for l, row in enumerate(F.list(f"{where}.reuse.sources", r["sources"]))]
    if "sinks" in r:
        reuse["sinks"] = F.int(f"{where}.reuse.sinks", r["sinks"])
    if "recent" in r:
        reuse["recent"] = F.number(f"{where}.reuse.recent", r["recent"])
    by_length = []
    for i, e in enumerate(F.list(f"{where}.by_length", d.get("by_length", []))):
        e = F.obj(f"{where}.by_length[{i}]", e, ("max_n", "plan"), required=("max_n", "plan"))
        by_length.append((F.int(f"{where}.by_length[{i}].max_n", e["max_n"]), _parse(e["plan"], f"{where}.by_length[{i}].plan")))
    try:
        reuse = Reuse(**reuse)
    except (TypeError, ValueError) as e:
        raise ValueError(f"malformed Kascade plan ({where}): {e}") from None
    return dict(where=where, fingerprint=fp, anchors=tuple(anchors), head_map=tuple(map(tuple, head_map)),
                reuse=reuse, by_length=tuple(by_length), **kw)



def to_dict(plan) -> dict:
    """``plan`` (a :class:`~kascade.plan.KascadePlan`) as a JSON-ready dict in format ``kascade-plan/4`` (``reuse``, ``by_length``,
    ``tensor_parallel``, ``mass``, ``score_dtype`` and ``dense_tail`` only when set)."""
    d = {"format": FORMAT, "fingerprint": dataclasses.asdict(plan.fingerprint), "anchors": list(plan.anchors),
         "head_map": [list(r) for r in plan.head_map], "ratio": plan.ratio, "k_min": plan.k_min,
         "tile": plan.tile, "rolling": plan.rolling, "calibrated": plan.calibrated, "source": plan.source}
    if plan.reuse.ranked:
        d["reuse"] = plan.reuse.to_dict()
    if plan.by_length:
        d["by_length"] = [dict(max_n=m, plan=p.to_dict()) for m, p in plan.by_length]
    if plan.tensor_parallel is not None:
        d["tensor_parallel"] = plan.tensor_parallel
    if plan.mass is not None:
        d["mass"] = plan.mass
    if plan.score_dtype is not None:
        d["score_dtype"] = plan.score_dtype
    if plan.dense_tail:
        d["dense_tail"] = plan.dense_tail
    return d


def fields(d) -> dict:
    """The fields of a plan in its JSON form (any of :data:`FORMATS`), read strictly (ValueError naming the field for
    anything else): ``where`` (the path of the plan in the file, for errors), ``fingerprint`` (a dict), ``anchors``,
    ``head_map``, ``reuse`` (a :class:`Reuse`), ``by_length`` (``(max_n, fields)`` pairs) and the budget fields
    given; :meth:`KascadePlan.from_dict` builds the plan of them."""
    return _parse(d, "plan")
