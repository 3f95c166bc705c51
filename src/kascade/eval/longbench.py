"""LongBench-format data (JSONL with ``context``, ``input``, ``answers``, ``dataset``) and LongBench's metrics."""

from __future__ import annotations

import difflib
import re
import string
from collections import Counter
from pathlib import Path

from ..text import iter_jsonl
from .ruler import Sample

FIELDS = ("context", "input", "answers", "dataset")


def normalize_answer(s: str) -> str:
    """Lower case, no punctuation, no articles, single spaces (SQuAD / LongBench normalisation)."""
    s = s.lower()
    s = "".join(ch for ch in s if ch not in set(string.punctuation))
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


def qa_f1(prediction: str, answer: str) -> float:
    p, g = normalize_answer(prediction).split(), normalize_answer(answer).split()
    common = Counter(p) & Counter(g)
    same = sum(common.values())
    if same == 0:
        return 0.0
    precision, recall = same / len(p), same / len(g)
    return 2 * precision * recall / (precision + recall)


def _lcs(a: list[str], b: list[str]) -> int:
    prev = [0] * (len(b) + 1)
    for x in a:
        cur = [0]
        for j, y in enumerate(b):
            cur.append(prev[j] + 1 if x == y else max(prev[j + 1], cur[j]))
        prev = cur
    return prev[-1]


def rouge_l(prediction: str, answer: str) -> float:
    """ROUGE-L F-measure on whitespace tokens."""
    p, g = prediction.lower().split(), answer.lower().split()
    if not p or not g:
        return 0.0
    lcs = _lcs(p, g)
    if lcs == 0:
        return 0.0
    precision, recall = lcs / len(p), lcs / len(g)
    return 2 * precision * recall / (precision + recall)


def classification_score(prediction: str, answer: str) -> float:
    """1 if the gold class name appears in the prediction, else 0."""
    return float(answer.strip().lower() in prediction.lower())


def code_sim(prediction: str, answer: str) -> float:
    """Edit similarity of the first non-comment line of the prediction to the answer (0..1)."""
    line = next((ln for ln in prediction.lstrip("\n").split("\n") if ln.strip() and not ln.strip().startswith(("#", "//", "`"))), "")
    return difflib.SequenceMatcher(None, line, answer).ratio()


METRICS = {"qa_f1": qa_f1, "rouge_l": rouge_l, "classification": classification_score, "code_sim": code_sim}
DATASET_METRIC = {
    **{d: "qa_f1" for d in ("narrativeqa", "qasper", "multifieldqa_en", "hotpotqa", "2wikimqa", "musique", "triviaqa")},
    **{d: "rouge_l" for d in ("gov_report", "qmsum", "multi_news", "samsum", "vcsum")},
    **{d: "classification" for d in ("trec", "lsht")},
    **{d: "code_sim" for d in ("lcc", "repobench-p")},
}


def metric_of(dataset: str) -> str:
    """The metric a dataset is scored with: LongBench's for its datasets; a dataset of one's own names its metric
    (``"qa_f1"``, ``"rouge_l"``, ``"classification"``, ``"code_sim"``). Anything else is refused (ValueError)."""
    if dataset in DATASET_METRIC:
        return DATASET_METRIC[dataset]
    if dataset in METRICS:
        return dataset
    raise ValueError(f"dataset {dataset!r} has no metric here: one of LongBench's {', '.join(sorted(DATASET_METRIC))}, "
                     f"or, for a dataset of your own, the metric's name ({', '.join(METRICS)})")


def score(dataset: str, prediction: str, answers: list[str]) -> float:
    """LongBench's score: the dataset's metric (:func:`metric_of`), maximised over the gold answers."""
    if not answers:
        raise ValueError("a LongBench sample needs at least one gold answer")
    metric = METRICS[metric_of(dataset)]
    return max(metric(prediction, a) for a in answers)


def _short(value) -> str:
    r = repr(value)
    return r if len(r) <= 60 else r[:57] + "..."


def load(path: str | Path, limit: int | None = None) -> list[Sample]:
    """Samples from a LongBench-format JSONL file (at most ``limit``); ValueError naming the line for a malformed
    record: a missing field, a ``context`` / ``input`` / ``dataset`` that is not a string, ``answers`` that are not
    one non-empty string or a non-empty list of them. The whole file is checked, so a bad record stops a run before
    it starts rather than in its middle."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"no LongBench file at {path}" + (" (it is a folder)" if path.is_dir() else ""))
    out = []
    for n, rec in iter_jsonl(path):
        missing = [f for f in FIELDS if f not in rec]
        if missing:
            raise ValueError(f"{path}:{n}: missing LongBench field(s) {missing}")
        for f in ("context", "input", "dataset"):
            if not isinstance(rec[f], str):
                raise ValueError(f"{path}:{n}: {f!r} must be a string, got {_short(rec[f])}")
        try:
            metric_of(rec["dataset"])
        except ValueError as e:
            raise ValueError(f"{path}:{n}: {e}") from None
        answers = [rec["answers"]] if isinstance(rec["answers"], str) else rec["answers"]
        if not isinstance(answers, list) or not answers or not all(isinstance(a, str) and a.strip() for a in answers):
            raise ValueError(f"{path}:{n}: 'answers' must be a non-empty list of non-empty strings (the gold answers), "
                             f"got {_short(rec['answers'])}")
        if limit is None or len(out) < limit:
            prompt = (f"Read the text below and answer the question.\n\n{rec['context']}\n\n"
                      f"Question: {rec['input']}\nAnswer:")
            out.append(Sample(task=f"longbench/{rec['dataset']}", prompt=prompt, answers=list(answers),
                              max_new_tokens=64, meta=dict(dataset=rec["dataset"], line=n)))
    if not out:
        raise ValueError(f"{path} holds no LongBench records")
    return out
