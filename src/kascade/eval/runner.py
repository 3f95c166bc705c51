"""`kascade eval`: every strategy on every task through the same attention path; files a person can read.

    r = evaluate(Settings(strategies=("dense", "kascade"), tasks=("fidelity",), lengths=(2048,), out="ev"))

:func:`evaluate` checks everything it can before the model's weights are read (the output folder, the files, then
the model's shape and the token windows from its config and tokenizer), then runs every (strategy, task, length,
sample) in turn. Each finished row is appended to ``rows.jsonl`` in the output folder and the summary files are
rewritten after every sample, so an interrupted run keeps what it finished; run again with the same settings and
the same folder, it skips the rows already there (the files: :mod:`kascade.eval.results`).
"""

from __future__ import annotations

import platform
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch
import transformers
from tqdm.auto import tqdm

from .. import models, ops, text
from ..budget import SCORE_DTYPES
from ..fidelity import DenseReference
from ..files import output_folder
from ..integration.hf import enable
from ..plan import SHIPPED_VARIANTS, ModelFingerprint, resolve_plan
from ..text import load_texts
from . import longbench, needle, ruler
from .results import FIDELITY, Results, _digest
from .strategies import STRATEGIES, available, make_strategy

TASKS = (FIDELITY, *ruler.TASKS, *needle.TASKS)
MIN_FIDELITY_LENGTH = 2  # one scored position
MIN_RULER_LENGTH = 256  # below it the instructions and needles alone overrun the length
SAMPLES = 2  # samples per task and length without --samples; the needle tasks' own default is needle.SAMPLES


def samples_of(task: str, samples: int | None) -> int:
    """How many samples ``task`` runs per length: ``samples`` (--samples) where given, else the task's default
    (``needle.SAMPLES`` for the needle tasks, enough for a narrow confidence interval; ``SAMPLES`` for the others)."""
    if samples is not None:
        return samples
    return needle.SAMPLES if task in needle.TASKS else SAMPLES


def _ids(x) -> list[int]:
    return [] if x is None else [int(x)] if isinstance(x, int) else [int(t) for t in x]


def _left_padded(ids: list[dict], pad: int) -> dict:
    """Single-prompt encodings (``{input_ids, attention_mask}``, ``[1, n]`` each) as one left-padded batch."""
    if len(ids) == 1:
        return ids[0]
    n = max(i["input_ids"].shape[1] for i in ids)
    rows = [torch.nn.functional.pad(i["input_ids"], (n - i["input_ids"].shape[1], 0), value=pad) for i in ids]
    masks = [torch.nn.functional.pad(i["attention_mask"], (n - i["attention_mask"].shape[1], 0), value=0)
             for i in ids]
    return dict(input_ids=torch.cat(rows), attention_mask=torch.cat(masks))


def _attended_fraction(runtime) -> tuple[float, dict[int, float]]:
    if runtime is None:
        return 1.0, {}
    per_layer = {l: a / d for l, (a, d) in sorted(runtime.attended.items()) if d}
    att = sum(a for a, _ in runtime.attended.values())
    den = sum(d for _, d in runtime.attended.values())
    return (att / den if den else 1.0), per_layer


class Session:
    """One model and its strategies; runs samples under each strategy and keeps the budget accounting."""

    def __init__(self, model, tok, strategies, plan=None, budget=None, omnikv_layer=2, backend="auto"):
        self.model, self.tok, self.backend = model, tok, backend
        self.strategies = {s: make_strategy(s, model, plan, omnikv_layer=omnikv_layer, budget=budget)
                           for s in strategies}
        self.dev = next(model.parameters()).device

    def _ctx(self, name):
        spec = self.strategies[name]
        if spec is None:
            return None
        plan, selector = spec
        return enable(self.model, plan, backend=self.backend, selector=selector, account=True,
                      warn_uncalibrated=False)

    def prompt(self, sample: ruler.Sample) -> dict:
        """The chat-formatted prompt of ``sample``: ``{input_ids, attention_mask}`` on the model's device."""
        ids = self.tok.apply_chat_template([{"role": "user", "content": sample.prompt}], add_generation_prompt=True,
                                           return_tensors="pt", return_dict=True)
        return {k: v.to(self.dev) for k, v in ids.items()}

    @torch.no_grad()
    def generate(self, name: str, sample: ruler.Sample, ids: dict | None = None):
        """``(prediction, attended fraction, per layer, seconds, prompt tokens, backend)`` of ``sample`` under
        ``name``."""
        ((pred, n_tok),), frac, per_layer, secs, backend = self._generate(name, [sample], [ids])
        return pred, frac, per_layer, secs, n_tok, backend

    @torch.no_grad()
    def generate_batch(self, name: str, samples: list) -> list[tuple]:
        """:meth:`generate` of each of ``samples`` in one left-padded batch (one ``generate`` call): the attended
        fraction is the batch's (padding not counted) and the seconds the batch's share per sample."""
        preds, frac, per_layer, secs, backend = self._generate(name, samples, [None] * len(samples))
        return [(pred, frac, per_layer, secs / len(samples), n_tok, backend) for pred, n_tok in preds]

    def _generate(self, name, samples, ids):
        ids = [self.prompt(s) if i is None else i for s, i in zip(samples, ids)]
        batch = _left_padded(ids, self.tok.pad_token_id)
        handle = self._ctx(name)
        t0 = time.perf_counter()
        try:
            out = self.model.generate(**batch, max_new_tokens=max(s.max_new_tokens for s in samples),
                                      do_sample=False, pad_token_id=self.tok.pad_token_id)
        finally:
            if handle is not None:
                handle.disable()
        secs = time.perf_counter() - t0
        L = batch["input_ids"].shape[1]
        stops = set(_ids(self.model.generation_config.eos_token_id)) | set(_ids(self.tok.eos_token_id))
        preds = []
        for b, s in enumerate(samples):
            new = out[b, L:L + s.max_new_tokens].tolist()
            end = next((j + 1 for j, t in enumerate(new) if t in stops), len(new))  # a batch pads after the end
            preds.append((self.tok.decode(new[:end], skip_special_tokens=True, clean_up_tokenization_spaces=False),
                          ids[b]["input_ids"].shape[1]))
        frac, per_layer = _attended_fraction(handle.runtime if handle else None)
        return preds, frac, per_layer, secs, handle.runtime.backend if handle else None

    def fidelity(self, window: torch.Tensor, names=None):
        """Per strategy (``names``, default all): top-1 agreement and KL vs dense, and NLL of the true next tokens
        (second half scored)."""
        ref = DenseReference(self.model, [window])
        res = {}
        for name in self.strategies if names is None else names:
            handle = self._ctx(name)
            try:
                (f,) = ref.baseline() if handle is None else ref.measure()
            finally:
                if handle is not None:
                    handle.disable()
            frac, per_layer = _attended_fraction(handle.runtime if handle else None)
            res[name] = dict(agreement=f.top1_agreement, kl=f.kl, nll=f.nll, attended_fraction=frac,
                             attended_per_layer=per_layer)
        return res


def _job(sess, tok, task, L, idx, *, strategies, samples, seed, lb, done, windows, fid_windows) -> list[dict]:
    """The rows of the samples ``idx`` of one task and length (every strategy not in ``done``): fidelity on a
    window, or generated answers (several samples: one left-padded batch per strategy)."""
    new = []
    if task == FIDELITY:
        for i in idx:
            names = [s for s in strategies if (s, task, L, i) not in done]
            if names:
                if L not in fid_windows:
                    fid_windows[L] = (windows[L] if windows
                                      else text.windows(tok, "eval", L, samples_of(FIDELITY, samples), seed=seed))
                for name, r in sess.fidelity(fid_windows[L][i], names).items():
                    new.append(dict(strategy=name, task=task, length=L, sample=i, score=r["agreement"], **r))
        return new
    if task == "longbench":
        (i,) = idx
        made = {i: lb[i]}
        ids = {i: sess.prompt(lb[i])}
        length = {i: ids[i]["input_ids"].shape[1]}
    else:
        idx = [i for i in idx if not all((s, task, L, i) in done for s in strategies)]
        made = {i: needle.generate(task, tok, L, seed, i) if task in needle.TASKS
                else ruler.generate(task, tok, L, seed * 1000 + i) for i in idx}
        ids = {i: None for i in idx}
        length = {i: L for i in idx}
    for name in strategies:
        todo = [i for i in made if (name, made[i].task, length[i], i) not in done]
        if not todo:
            continue
        if len(todo) == 1:
            answers = [sess.generate(name, made[todo[0]], ids[todo[0]])]
        else:
            answers = sess.generate_batch(name, [made[i] for i in todo])
        for i, (pred, frac, per_layer, secs, n_tok, backend) in zip(todo, answers):
            sample = made[i]
            if task == "longbench":
                sc = longbench.score(sample.meta["dataset"], pred, sample.answers)
            elif task in needle.TASKS:
                sc = needle.score(sample, pred)
            else:
                sc = ruler.string_match_all(pred, sample.answers)
            row = dict(strategy=name, task=sample.task, length=length[i], sample=i, score=sc,
                       attended_fraction=frac, attended_per_layer=per_layer, prediction=pred,
                       answers=sample.answers, prompt_tokens=n_tok, seconds=secs,
                       **({} if backend is None else dict(backend=backend)),
                       **({} if len(todo) == 1 else dict(batch=len(todo))))
            if task in needle.TASKS:
                row.update(depth=sample.meta["depth"], depths=sample.meta["depths"])
            new.append(row)
    return new


def _batches(jobs: list[tuple], size: int) -> list[tuple]:
    """``(task, length, [samples])``: runs of up to ``size`` consecutive samples of one generated task and length
    (fidelity windows and LongBench records one at a time)."""
    out = []
    for task, L, i in jobs:
        last = out[-1] if out else None
        if (last is not None and last[:2] == (task, L) and len(last[2]) < size
                and task not in (FIDELITY, "longbench")):
            last[2].append(i)
        else:
            out.append((task, L, [i]))
    return out


def run(model, tok, *, strategies, tasks, lengths, samples, seed=0, plan=None, budget=None, longbench_file=None,
        longbench_limit=None, omnikv_layer=2, progress=True, windows=None, results: "Results | None" = None,
        backend: str = "auto", batch_size: int = 1) -> list[dict]:
    """All (strategy, task, length, sample) rows; ``samples`` per task and length (None: each task's default,
    :func:`samples_of`).

    ``windows`` (``{length: [1-D token tensors]}``, the fidelity task's samples per length) are its text; default:
    windows of the evaluation split of pydoc_data.topics (``seed`` picks). With ``results``, the rows it holds are
    skipped, every new row is appended to it as soon as its sample is done and its summary files are rewritten;
    the rows returned are then all of its rows. ``backend``: Kascade's (``kascade.enable``'s: "auto", "reference"
    or "triton"); each generated row records the one that ran. ``batch_size``: generated samples of one task and
    length answered together, in left-padded batches of up to this many (each answer as it is alone, up to the
    rounding of the batch's arithmetic; the attended fraction is then the batch's)."""
    bad = [t for t in tasks if t not in TASKS]
    if bad:
        raise ValueError(f"unknown task(s) {bad}; choose from {', '.join(TASKS)}")
    sess = Session(model, tok, strategies, plan=plan, budget=budget, omnikv_layer=omnikv_layer, backend=backend)
    lb = longbench.load(longbench_file, limit=longbench_limit) if longbench_file else []
    done = results.done if results is not None else set()
    jobs = ([(t, L, i) for L in lengths for t in tasks for i in range(samples_of(t, samples))]
            + [("longbench", None, i) for i in range(len(lb))])
    fid_windows = {}
    rows = []
    with tqdm(total=len(jobs), desc="eval", unit="sample", disable=not progress) as bar:  # closed on Ctrl-C
        for task, L, idx in _batches(jobs, batch_size):
            bar.set_postfix_str(f"{task} {L or ''} #{idx[0]}" + (f"-{idx[-1]}" if len(idx) > 1 else ""))
            new = _job(sess, tok, task, L, idx, strategies=strategies, samples=samples, seed=seed, lb=lb,
                       done=done, windows=windows, fid_windows=fid_windows)
            rows += new
            if results is not None and new:
                results.add(new)
                results.write(chart=False)
            bar.update(len(idx))
    return rows if results is None else list(results.rows)


@dataclass(frozen=True)
class Settings:
    """What `kascade eval` runs with (the command's flags). Every value that does not depend on the model is checked
    here; the rest (strategies, the plan's shape, windows of --data) against the model's config and tokenizer."""

    out: str | Path = "kascade-eval"
    model: str | Path | None = None  # None: the embedded default model
    device: str = "cpu"  # cpu runs fp32, anything else bf16
    strategies: tuple[str, ...] | None = None  # None: every strategy that runs on the model
    tasks: tuple[str, ...] | None = None  # None: see ``tasks_to_run``
    lengths: tuple[int, ...] = (2048,)
    samples: int | None = None  # None: each task's default (samples_of)
    seed: int = 0
    plan: str | Path | None = None  # the kascade strategies' plan: a JSON file or a shipped plan's name (None: the
    # model's shipped plan)
    ratio: float | None = None  # budget overrides for every strategy
    k_min: int | None = None
    mass: float | None = None  # a budget by attention mass, for every strategy (ratio then caps it)
    score_dtype: str | None = None  # the anchors' scoring ("fp8" / "int8": FP8 / INT8 scoring), for every strategy
    dense_tail: int | None = None  # a prefill's last queries attended densely, for every strategy
    omnikv_layer: int = 2
    backend: str = "auto"  # Kascade's: auto (Triton on CUDA where it serves the model), reference or triton
    batch_size: int = 1  # generated samples answered together (left-padded)
    longbench: str | Path | None = None
    longbench_limit: int | None = None
    data: str | Path | None = None  # the fidelity task's text (None: pydoc_data.topics' evaluation split)
    text_field: str = "text"
    skip_texts: int = 0  # texts of ``data`` left out from its start

    def __post_init__(self):
        for name in ("strategies", "tasks", "lengths"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, tuple(getattr(self, name)))
        for flag, value, low in (("--samples", self.samples, 1), ("--seed", self.seed, 0),
                                 ("--omnikv-layer", self.omnikv_layer, 1), ("--skip-texts", self.skip_texts, 0),
                                 ("--k-min", self.k_min, 1), ("--longbench-limit", self.longbench_limit, 1),
                                 ("--dense-tail", self.dense_tail, 0), ("--batch-size", self.batch_size, 1)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < low):
                raise ValueError(f"{flag} must be an integer >= {low}, got {value!r}")
        r = self.ratio
        if r is not None and (isinstance(r, bool) or not isinstance(r, (int, float)) or not 0 < r <= 1):
            raise ValueError(f"--ratio must be a fraction of the keys in (0, 1], got {r!r}")
        m = self.mass
        if m is not None and (isinstance(m, bool) or not isinstance(m, (int, float)) or not 0 < m <= 1):
            raise ValueError(f"--mass must be a share of attention in (0, 1], got {m!r}")
        if self.backend not in ("auto", "reference", "triton"):
            raise ValueError(f"--backend must be auto, reference or triton, got {self.backend!r}")
        if self.score_dtype not in SCORE_DTYPES:
            raise ValueError(f"--score-dtype must be fp8 or int8 (or unset: exact scores), got {self.score_dtype!r}")
        for flag, given, known in (("--strategies", self.strategies, STRATEGIES), ("--tasks", self.tasks, TASKS)):
            bad = [x for x in given or () if x not in known]
            if bad or given == ():
                raise ValueError(f"{flag}: {'unknown ' + ', '.join(map(repr, bad)) if bad else 'none given'}; choose "
                                 f"from {', '.join(known)}")
        tasks = self.tasks_to_run
        if not tasks and self.longbench is None:
            raise ValueError("nothing to run: give --tasks or --longbench")
        if self.data is not None and FIDELITY not in tasks:
            raise ValueError("--data is the text of the fidelity task: add fidelity to --tasks")
        if self.data is None and (self.skip_texts or self.text_field != "text"):
            raise ValueError("--skip-texts and --text-field apply to --data")
        if self.longbench is None and self.longbench_limit is not None:
            raise ValueError("--longbench-limit applies to --longbench")
        if not isinstance(self.text_field, str) or not self.text_field:
            raise ValueError(f"--text-field must name a field, got {self.text_field!r}")
        if tasks:
            if not self.lengths:
                raise ValueError("--lengths needs at least one length")
            low = MIN_RULER_LENGTH if set(tasks) - {FIDELITY} else MIN_FIDELITY_LENGTH
            for n in self.lengths:
                if isinstance(n, bool) or not isinstance(n, int) or n < low:
                    why = ("the RULER tasks' instructions and needles need room" if low == MIN_RULER_LENGTH
                           else "the fidelity task scores at least one next token")
                    raise ValueError(f"--lengths must be at least {low} tokens ({why}), got {n!r}")

    @property
    def tasks_to_run(self) -> tuple[str, ...]:
        """``tasks``, else: fidelity with ``data``, nothing more with ``longbench``, else fidelity and
        niah_single_number."""
        if self.tasks is not None:
            return self.tasks
        if self.data is not None:
            return (FIDELITY,)
        return () if self.longbench is not None else (FIDELITY, "niah_single_number")

    @property
    def budget(self) -> dict | None:
        b = {k: v for k, v in dict(ratio=self.ratio, k_min=self.k_min, mass=self.mass,
                                   score_dtype=self.score_dtype, dense_tail=self.dense_tail).items() if v is not None}
        return b or None

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32 if self.device == "cpu" else torch.bfloat16

    def defining(self) -> dict:
        """The settings a row's values depend on (beyond its strategy, task, length and sample): a folder holds rows
        of one such record (:class:`Results`). Files count by their content. The sample count is the fidelity task's
        (its windows are spread over the text by their count; a generated sample depends on its index alone, so a
        run with more samples only adds rows), the same without --samples as with --samples 2."""
        d = dict(model=str(Path(self.model).expanduser().resolve()) if self.model is not None else "default",
                 dtype=str(self.dtype), seed=self.seed, samples=samples_of(FIDELITY, self.samples),
                 plan=self.plan if self.plan in SHIPPED_VARIANTS else _digest(self.plan), ratio=self.ratio, k_min=self.k_min,
                 **({} if self.mass is None else dict(mass=self.mass)),
                 **({} if self.score_dtype is None else dict(score_dtype=self.score_dtype)),
                 **({} if self.dense_tail is None else dict(dense_tail=self.dense_tail)),
                 omnikv_layer=self.omnikv_layer, longbench=_digest(self.longbench), data=_digest(self.data))
        if not (self.device == "cpu" and self.backend in ("auto", "reference")):  # (on a CPU both run the reference)
            d["backend"] = self.backend
        if self.batch_size > 1:  # batched arithmetic can round differently
            d["batch_size"] = self.batch_size
        if self.data is not None:
            d.update(text_field=self.text_field, skip_texts=self.skip_texts)
        return d


def data_windows(tok, texts: list[str], lengths, samples: int, *, skip: int = 0, source="--data") -> dict:
    """``{length: samples windows}`` cut from ``texts[skip:]`` (:func:`kascade.text.cut_windows`); ValueError when
    the texts hold too few."""
    out = {}
    for n in lengths:
        wins = text.cut_windows(tok, texts[skip:], n, samples)
        if len(wins) < samples:
            after = f" after the first {skip}" if skip else ""
            raise ValueError(f"{source}: the texts{after} hold {len(wins)} window(s) of {n} tokens (a window lies "
                             f"within one text); --samples {samples} needs {samples}: give more text, fewer --samples "
                             "or shorter --lengths")
        out[n] = wins
    return out


def evaluate(settings: Settings, *, progress: bool = True) -> dict:
    """Run `kascade eval` (module docstring); ``{summary, markdown, files, rows}``. The output folder is held for
    the run (a second run into it meanwhile is refused), and removed if this run made it and then failed before
    writing into it (:func:`kascade.files.output_folder`)."""
    with output_folder(settings.out, "kascade eval") as out:
        return _evaluate(settings, out, progress)


def _evaluate(s: Settings, out, progress: bool) -> dict:
    texts = load_texts(s.data, s.text_field) if s.data is not None else None
    if texts is not None and len(texts) <= s.skip_texts:
        raise ValueError(f"{s.data} holds {len(texts)} text(s); --skip-texts {s.skip_texts} leaves none")
    if s.longbench is not None:
        longbench.load(s.longbench, limit=s.longbench_limit)  # refuses a malformed record now
    tasks = s.tasks_to_run
    dev = torch.cuda.get_device_name(s.device) if s.device.startswith("cuda") else f"CPU ({platform.machine()})"
    header = (f"machine: {dev}; torch {torch.__version__}; transformers {transformers.__version__}; "
              f"model {s.model or 'SmolLM2-135M-Instruct (default)'}; seed {s.seed}; "
              "samples per length: " + ", ".join(f"{t} {samples_of(t, s.samples)}" for t in tasks)
              + (f"; fidelity on {s.data}" if s.data else "") + f"; Kascade backend {s.backend}"
              + (f"; generated samples in batches of {s.batch_size}" if s.batch_size > 1 else ""))
    results = Results(out, s.defining(), header)
    ready = []

    def prepare(config, tok):
        note = models.beyond_context(config, s.lengths, "kascade eval")
        if note:
            print(note)
        shape = SimpleNamespace(config=config)  # what the strategies read of a model
        fp = ModelFingerprint.from_config(config)
        plan = None if s.plan is None else resolve_plan(s.plan, fp)
        if plan is not None and plan.fingerprint != fp:
            raise ValueError(f"--plan {s.plan} was made for another model: "
                             + "; ".join(plan.fingerprint.differences(fp)))
        strategies = list(s.strategies or available(shape))
        for name in strategies:
            spec = make_strategy(name, shape, plan, omnikv_layer=s.omnikv_layer, budget=s.budget)
            if spec is not None and s.backend == "triton":  # refused now, not after the weights are read
                try:
                    ops.resolve_backend("triton", s.device, s.dtype, fp.head_dim, fp.num_q_heads // fp.num_kv_heads,
                                        spec[0].budget)
                except ValueError as e:
                    raise ValueError(f"--backend triton cannot run strategy {name}: {e}") from None
        windows = None
        if texts is not None:
            windows = data_windows(tok, texts, s.lengths, samples_of(FIDELITY, s.samples), skip=s.skip_texts,
                                   source=str(s.data))
        if set(tasks) - ({FIDELITY} if texts is not None else set()):
            have = len(text.split_ids(tok, "eval"))
            if max(s.lengths) > have:
                raise ValueError(f"--lengths {max(s.lengths)} is longer than the evaluation text of pydoc_data.topics "
                                 f"({have} tokens for this tokenizer)")
        ready.append((strategies, windows, plan))

    model, tok = models.load_model(s.model, device=s.device, dtype=s.dtype, check=prepare)
    if not ready:  # a loader that does not call ``check``
        prepare(model.config, tok)
    strategies, windows, plan = ready[0]
    run(model, tok, strategies=strategies, tasks=tasks, lengths=s.lengths, samples=s.samples, seed=s.seed,
        plan=plan, budget=s.budget, longbench_file=s.longbench, longbench_limit=s.longbench_limit,
        omnikv_layer=s.omnikv_layer, progress=progress, windows=windows, results=results, backend=s.backend,
        batch_size=s.batch_size)
    r = results.write(chart=True)
    r["rows"] = results.rows
    return r
