"""The `kascade bench` run: every (model, batch, length) in turn, skipped or measured, the outputs rewritten after
each one (:func:`run`), and the command-line entry (:func:`main_args`)."""

from __future__ import annotations

import gc
import sys
import time
from dataclasses import asdict, dataclass, field

import torch

from ..files import output_folder
from ..integration.hf import enable
from ..plan import KascadePlan, ModelFingerprint
from .memory import available_bytes, estimate_bytes, predict_seconds, skip_reason
from .models import MODELS, check_plan, load, plan_for
from .report import config_line, environment, table, write
from .settings import GB, Settings
from .timing import measure_config


@dataclass
class _Clock:
    start: float = field(default_factory=time.perf_counter)

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def left(self, settings: Settings) -> float | None:
        return None if settings.time_budget_s is None else settings.time_budget_s - self.elapsed()


def _free(device) -> None:
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


def run(models, settings: Settings, out, *, model_path=None, plan: KascadePlan | str | None = None,
        argv=None) -> dict:
    """Measure every (model, batch, length); write the outputs after each configuration; return the results.
    ``plan``: for every model (None: each one's own, :func:`kascade.bench.models.plan_for`). The
    output folder is held for the run (a second run into it meanwhile is refused), and removed if this run made it and
    then failed before writing into it (:func:`kascade.files.output_folder`)."""
    for m in models:
        if m not in MODELS:
            raise ValueError(f"unknown model {m!r}; choose from {', '.join(MODELS)}")
    check_plan(models, plan, model_path)
    with output_folder(out, "kascade bench") as out:
        return _measure(models, settings, out, model_path, plan, argv)


def _measure(models, settings: Settings, out, model_path, plan, argv) -> dict:
    from tqdm.auto import tqdm

    clock = _Clock()
    results = dict(environment=environment(settings.device), settings=asdict(settings),
                   command=" ".join(argv) if argv else None, models={}, configs=[])
    configs = [(m, b, n) for m in models for b, n in settings.configurations()]
    bar = tqdm(total=len(configs), desc="bench", unit="config")
    for name in models:
        left = clock.left(settings)
        if left is not None and left <= 0:  # not even worth loading the model
            for batch, length in settings.configurations():
                rec = dict(model=name, batch=batch, length=length, status="skipped",
                           reason="--time-budget spent before this model was loaded")
                bar.write(config_line(rec))
                results["configs"].append(rec)
                bar.update(1)
            write(results, out, with_plot=False)
            continue
        bar.set_postfix_str(f"loading {name}")
        t0 = time.perf_counter()
        model, desc = load(name, settings, model_path)
        mplan = plan_for(name, model, plan)
        with enable(model, mplan, backend=settings.backend, warn_uncalibrated=False) as h:
            backend = h.runtime.backend  # fail on a bad backend or plan now, before any timing
        info = dict(description=desc, load_s=time.perf_counter() - t0, fingerprint=asdict(ModelFingerprint.from_model(model)),
                    plan=f"{len(mplan.anchors)} anchors {list(mplan.anchors)} of {mplan.num_layers}, ratio {mplan.ratio}, "
                    f"k_min {mplan.k_min}, tile {mplan.tile}" + ("" if mplan.calibrated else " (uncalibrated)"),
                    plan_source=mplan.source, params=sum(p.numel() for p in model.parameters()))
        trained = getattr(model.config.get_text_config(), "max_position_embeddings", None)
        if name != "default":
            info["note"] = "random weights: speed only"
        elif trained and max(settings.lengths) > trained:
            info["note"] = f"trained context {trained} tokens: lengths beyond it measure speed only"
        results["models"][name] = info
        weights = sum(p.numel() * p.element_size() for p in model.parameters())
        done: list[dict] = []
        for batch, length in settings.configurations():
            bar.set_postfix_str(f"{name} B={batch} L={length}")
            rec = dict(model=name, batch=batch, length=length)
            est = estimate_bytes(model.config, mplan, weights=weights, batch=batch, length=length,
                                 settings=settings, backend=backend)
            rec["estimate_gb"] = {k: v / GB for k, v in est.items()}
            rec["predicted_s"] = predict_seconds(done, batch, length, settings)
            reason = skip_reason(est["total"], available_bytes(model, settings), rec["predicted_s"],
                                 clock.left(settings), settings)
            if reason:
                rec.update(status="skipped", reason=reason)
            else:
                t0 = time.perf_counter()
                partial: dict = {}
                try:
                    rec.update(measure_config(model, mplan, batch=batch, length=length, settings=settings,
                                              partial=partial))
                    rec["status"] = "ok"
                    done.append(rec)
                except torch.OutOfMemoryError as e:
                    rec.update(status="oom", reason=f"out of memory after modes {list(partial) or 'none'}: "
                               + str(e).splitlines()[0][:160],
                               partial={m: {k: v for k, v in r.items() if k != "last_logits"}
                                        for m, r in partial.items()})
                del partial
                rec["wall_s"] = time.perf_counter() - t0
                _free(settings.device)
            bar.write(config_line(rec))
            results["configs"].append(rec)
            results["elapsed_s"] = clock.elapsed()
            # the plot takes a second or two: redrawn only after configurations that took much longer
            write(results, out, with_plot=rec.get("wall_s", 0.0) > 10.0)
            bar.update(1)
        del model
        _free(settings.device)
    bar.close()
    results["elapsed_s"] = clock.elapsed()
    results["files"] = [str(f) for f in write(results, out)]
    return results


def decode_modes(modes, decode: str | None) -> tuple[str | None, tuple[str, ...]]:
    """``(decode, generate)`` of :class:`Settings` from --decode-modes (``graph``: GraphDecoder's replays time the
    main columns; ``eager`` / ``compiled``: also through ``generate``) and --decode."""
    if not modes:
        return decode, ()
    if decode is not None:
        raise ValueError("give --decode-modes or --decode, not both")
    return ("graph" if "graph" in modes else "eager"), tuple(m for m in modes if m != "graph")


def main_args(args, settings: Settings) -> int:
    """The `kascade bench` subcommand (called by :mod:`kascade.cli`, which builds ``settings`` from ``args``): runs
    ``args.models`` and prints the table."""
    r = run(args.models, settings, args.out, model_path=args.model, plan=args.plan, argv=sys.argv)
    print()
    print(table(r))
    print(f"total {r['elapsed_s']:.0f} s; wrote " + ", ".join(r["files"]))
    return 0
