import json
import re

import pytest

from kascade.eval import longbench, ruler


@pytest.fixture(scope="module")
def tok(default_model):
    return default_model[1]


@pytest.mark.model
@pytest.mark.parametrize("task", ruler.TASKS)
def test_ruler_generators_are_deterministic_and_scorable(tok, task):
    a = ruler.generate(task, tok, 600, seed=3)
    b = ruler.generate(task, tok, 600, seed=3)
    c = ruler.generate(task, tok, 600, seed=4)
    assert a.prompt == b.prompt and a.answers == b.answers
    assert a.prompt != c.prompt
    n = len(tok(a.prompt).input_ids)
    assert 300 < n <= 600, n
    for ans in a.answers:
        assert ans.lower() in a.prompt.lower()  # the answer is in the haystack
    assert ruler.string_match_all(" ".join(a.answers), a.answers) == 1.0
    assert ruler.string_match_all("I do not know.", a.answers) == 0.0


def test_string_match_all_counts_parts():
    assert ruler.string_match_all("the numbers are 1234567 and 7654321", ["1234567", "7654321"]) == 1.0
    assert ruler.string_match_all("only 1234567", ["1234567", "7654321"]) == 0.5


def test_longbench_metrics():
    assert longbench.qa_f1("The Eiffel Tower", "eiffel tower") == 1.0
    assert longbench.qa_f1("a red car", "blue bike") == 0.0
    assert 0 < longbench.qa_f1("Paris in France", "Paris") < 1
    assert longbench.rouge_l("the cat sat on the mat", "the cat sat on the mat") == 1.0
    assert longbench.rouge_l("dogs bark", "the cat sat") == 0.0
    assert longbench.classification_score("I think this is Location.", "location") == 1.0
    assert longbench.classification_score("Number", "location") == 0.0
    assert longbench.code_sim("return a + b\n", "return a + b") == 1.0
    assert longbench.code_sim("# comment\nfoo()", "bar") < 0.5
    assert longbench.score("hotpotqa", "Paris", ["London", "Paris"]) == 1.0


def test_longbench_loader(tmp_path):
    f = tmp_path / "lb.jsonl"
    recs = [dict(context="Alice lives in Paris. " * 20, input="Where does Alice live?", answers=["Paris"],
                 dataset="hotpotqa"),
            dict(context="def add(a, b):\n", input="", answers=["    return a + b"], dataset="lcc")]
    f.write_text("\n".join(json.dumps(r) for r in recs) + "\n")
    samples = longbench.load(f)
    assert [s.task for s in samples] == ["longbench/hotpotqa", "longbench/lcc"]
    assert "Where does Alice live?" in samples[0].prompt and samples[0].answers == ["Paris"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(dict(context="x", input="y", dataset="trec")) + "\n")
    with pytest.raises(ValueError, match="bad.jsonl:1: missing LongBench field"):
        longbench.load(bad)


@pytest.mark.parametrize("answers, shown", [(None, "None"), ([], "[]"), ([""], "['']"), (["a", 3], "['a', 3]"),
                                            ({"a": 1}, "{'a': 1}")])
def test_longbench_records_without_usable_answers_are_refused(tmp_path, answers, shown):
    """Not scored against the string 'None' (null), nor left to fail at scoring time after other samples ran."""
    f = tmp_path / "lb.jsonl"
    good = dict(context="Alice lives in Paris.", input="Where?", answers=["Paris"], dataset="hotpotqa")
    f.write_text(json.dumps(good) + "\n" + json.dumps({**good, "answers": answers}) + "\n")
    with pytest.raises(ValueError, match=re.escape(f"lb.jsonl:2: 'answers' must be a non-empty list of non-empty "
                                                   f"strings (the gold answers), got {shown}")):
        longbench.load(f)
    with pytest.raises(ValueError, match="lb.jsonl:2: 'answers' must be"):
        longbench.load(f, limit=1)  # the whole file is checked, not only the records used


def test_a_longbench_dataset_without_a_metric_is_refused_by_line(tmp_path):
    """LongBench's count and retrieval datasets (whose metrics are not here) and misspelt names were scored with
    QA F1, silently; a dataset of one's own names its metric."""
    f = tmp_path / "lb.jsonl"
    good = dict(context="Alice lives in Paris.", input="Where?", answers=["Paris"], dataset="hotpotqa")
    for name in ("passage_count", "hotpot_qa"):
        f.write_text(json.dumps(good) + "\n" + json.dumps({**good, "dataset": name}) + "\n")
        with pytest.raises(ValueError, match=f"lb.jsonl:2: dataset '{name}' has no metric here"):
            longbench.load(f)
    f.write_text(json.dumps({**good, "dataset": "rouge_l"}) + "\n")
    assert longbench.load(f)[0].task == "longbench/rouge_l"
    assert longbench.score("rouge_l", "Alice lives in Paris", ["Paris"]) == longbench.rouge_l("Alice lives in Paris",
                                                                                              "Paris")


def test_longbench_fields_must_be_strings_and_scores_need_answers(tmp_path):
    f = tmp_path / "lb.jsonl"
    f.write_text(json.dumps(dict(context=None, input="y", answers="x", dataset="trec")) + "\n")
    with pytest.raises(ValueError, match="lb.jsonl:1: 'context' must be a string, got None"):
        longbench.load(f)
    f.write_text(json.dumps(dict(context="c", input="y", answers="x", dataset="trec")) + "\n")
    assert longbench.load(f)[0].answers == ["x"]  # one answer as a plain string
    with pytest.raises(ValueError, match="at least one gold answer"):
        longbench.score("hotpotqa", "Paris", [])
