import csv
import json
import re

import pytest
import torch

import kascade.models
from cli_support import ChatCharTokenizer, CharTokenizer, one_line_error, texts_file, tiny_loader
from conftest import tiny_model
from kascade import KascadePlan, ModelFingerprint
from kascade.cli import build_parser, main


def test_eval_help_explains_every_option(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["eval", "--help"])
    out = capsys.readouterr().out
    for opt in ("--strategies", "--tasks", "--lengths", "--samples", "--seed", "--device", "--plan", "--longbench",
                "--out", "--score-dtype", "e4m3", "int8", "streamingllm", "quest", "omnikv", "fidelity", "niah_multikey"):
        assert opt in out


@pytest.mark.model
def test_eval_end_to_end(tmp_path, default_model, monkeypatch, capsys):
    import kascade.models

    monkeypatch.setattr(kascade.models, "load_model", lambda *a, **k: default_model)
    lb = tmp_path / "lb.jsonl"
    lb.write_text(json.dumps(dict(context="The meeting is on Tuesday. " * 10, input="When is the meeting?",
                                  answers=["Tuesday"], dataset="hotpotqa")) + "\n")
    out = tmp_path / "ev"
    rc = main(["eval", "--strategies", "dense,kascade,streamingllm", "--tasks", "fidelity,niah_single_number",
               "--lengths", "300", "--samples", "1", "--longbench", str(lb), "--out", str(out)])
    assert rc == 0
    res = json.loads((out / "results.json").read_text())
    strategies = {r["strategy"] for r in res["rows"]}
    assert strategies == {"dense", "kascade", "streamingllm"}
    fid = {r["strategy"]: r for r in res["rows"] if r["task"] == "fidelity"}
    assert fid["dense"]["agreement"] == 1.0 and fid["dense"]["kl"] == 0.0  # the baseline row: dense against itself
    # the sparse rows compare against dense and differ from it (300 tokens, 128 keys: prefill tiles select up to 96)
    for name in ("kascade", "streamingllm"):
        assert fid[name]["kl"] > 1e-4 and 0.5 < fid[name]["agreement"] <= 1.0, fid[name]
        assert 0.3 < fid[name]["attended_fraction"] < 0.9, fid[name]
    assert (out / "scores.png").stat().st_size > 1000
    with open(out / "results.csv", newline="") as f:
        assert len(list(csv.DictReader(f))) == len(res["rows"])
    assert "| kascade |" in capsys.readouterr().out


# -- on a tiny random model: refusals before any work, rows kept as they finish, resuming, --data ----------------

@pytest.fixture
def tiny(monkeypatch):
    """A tiny random Llama (4 layers) behind load_model (``tiny.loads`` counts the weight reads)."""
    tiny = tiny_loader(tiny_model("llama"))
    monkeypatch.setattr(kascade.models, "load_model", tiny.load)
    return tiny


def _error(command, argv, capsys) -> str:
    return one_line_error(command, argv, capsys)


FAST = ["--strategies", "dense,streamingllm,oracle", "--tasks", "fidelity", "--lengths", "48", "--k-min", "8",
        "--ratio", "0.25"]


def _longbench(path, answers):
    path.write_text(json.dumps(dict(context="The meeting is on Tuesday.", input="When?", answers=["Tuesday"],
                                    dataset="hotpotqa")) + "\n"
                    + json.dumps(dict(context="x", input="y", answers=answers, dataset="hotpotqa")) + "\n")
    return path


@pytest.mark.parametrize("argv, message", [
    (["--lengths", "-5"], "argument --lengths: must be a positive integer, got '-5'"),
    (["--lengths", "0"], "argument --lengths: must be a positive integer, got '0'"),
    (["--samples", "0"], "argument --samples: must be a positive integer, got '0'"),
    (["--ratio", "2"], "argument --ratio: must be a number in (0, 1]"),
    (["--device", "gpu"], "argument --device: unknown device 'gpu'"),
    (["--tasks", "fidelity,niah_single_number", "--lengths", "100"], "--lengths must be at least 256 tokens"),
    (["--skip-texts", "2"], "--skip-texts and --text-field apply to --data"),
    (["--longbench-limit", "2"], "--longbench-limit applies to --longbench"),
    (["--omnikv-layer", "4", "--strategies", "omnikv"], "omnikv_layer must be in 1..3, got 4"),
    (["--strategies", "kascade-faithful"], "no shipped 'faithful' plan for this model"),
    (["--batch-size", "0"], "argument --batch-size: must be a positive integer, got '0'"),
    (["--backend", "cuda"], "argument --backend: invalid choice: 'cuda'"),
    (["--backend", "triton"], "--backend triton cannot run strategy streamingllm: backend='triton' supports head dims"),
])
def test_bad_arguments_are_refused_in_one_line_before_any_work(tmp_path, tiny, capsys, argv, message):
    err = _error("eval", [*FAST, "--out", str(tmp_path / "out"), *argv], capsys)
    assert message in err
    assert tiny.loads == [] and not (tmp_path / "out" / "rows.jsonl").exists()


def test_bad_files_are_refused_in_one_line_before_any_work(tmp_path, tiny, capsys):
    afile = tmp_path / "afile"
    afile.write_text("x")
    other = KascadePlan.uniform(ModelFingerprint("llama", 30, 9, 3, 64), 6)
    other.save(tmp_path / "other.json")
    cases = [
        (["--out", str(afile)], f"--out {afile} is a file, not a folder"),
        (["--plan", str(tmp_path)], f"argument --plan: no plan file at {tmp_path} (it is a folder)"),
        (["--plan", str(tmp_path / "other.json")], "was made for another model: num_layers: plan has 30, model has 4"),
        (["--data", str(tmp_path)], "argument --data: no file at"),
        (["--data", str(texts_file(tmp_path / "two.jsonl", 2)), "--skip-texts", "2"],
         "two.jsonl holds 2 text(s); --skip-texts 2 leaves none"),
        (["--data", str(tmp_path / "two.jsonl"), "--skip-texts", "1", "--lengths", "200"],
         "hold 1 window(s) of 200 tokens (a window lies within one text); --samples 2 needs 2"),
        (["--data", str(tmp_path / "two.jsonl"), "--tasks", "niah_single_number"],
         "--data is the text of the fidelity task: add fidelity to --tasks"),
        (["--longbench", str(_longbench(tmp_path / "null.jsonl", None)), "--tasks", "fidelity"],
         "null.jsonl:2: 'answers' must be a non-empty list of non-empty strings (the gold answers), got None"),
        (["--longbench", str(_longbench(tmp_path / "empty.jsonl", [])), "--tasks", "fidelity"],
         "empty.jsonl:2: 'answers' must be a non-empty list of non-empty strings (the gold answers), got []"),
    ]
    for argv, message in cases:
        err = _error("eval", [*FAST, "--out", str(tmp_path / "out"), *argv], capsys)
        assert message in err, (argv, err)
    assert tiny.loads == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a torch without a CUDA device")
@pytest.mark.parametrize("command", ["demo", "calibrate", "eval", "bench", "costs"])
def test_every_command_refuses_cuda_without_cuda_in_one_line(command, capsys):
    assert "argument --device: 'cuda': this torch" in _error(command, ["--device", "cuda"], capsys)


@pytest.mark.parametrize("command", ["demo", "eval", "bench"])
def test_every_command_refuses_a_folder_as_plan_in_one_line(command, tmp_path, capsys):
    assert f"no plan file at {tmp_path} (it is a folder)" in _error(command, ["--plan", str(tmp_path)], capsys)


def test_every_help_says_what_each_option_means():
    parser = build_parser()
    commands = parser._subparsers._group_actions[0].choices
    assert set(commands) == {"demo", "calibrate", "eval", "bench", "costs"}
    history = re.compile(r"\b(issue|new|old|now|previously|no longer)\b|#\d", re.IGNORECASE)
    for name, sub in commands.items():
        assert len(sub.description) > 80 and not history.search(sub.description), name
        for action in sub._actions:
            if action.dest in ("help", "parser"):
                continue
            assert action.help and len(action.help) > 20, (name, action.option_strings)
            assert not history.search(action.help), (name, action.option_strings, action.help)
            if action.default not in (None, False):
                assert "default" in action.help, (name, action.option_strings, action.help)


def _rows(out):
    return [json.loads(line) for line in (out / "rows.jsonl").read_text().splitlines()]


def test_rows_are_kept_as_they_finish_and_the_same_command_resumes(tmp_path, tiny, monkeypatch, capsys):
    from kascade.eval import results, runner

    data = texts_file(tmp_path / "d.jsonl", 3)
    out = tmp_path / "ev"
    argv = ["eval", *FAST, "--data", str(data), "--samples", "3", "--out", str(out)]
    scored, real = [], runner.Session.fidelity

    def interrupted(self, window, names=None):
        if len(scored) == 2:
            raise KeyboardInterrupt  # Ctrl-C during the third window
        scored.append(window)
        return real(self, window, names)

    monkeypatch.setattr(runner.Session, "fidelity", interrupted)
    assert main(argv) == 130
    err = capsys.readouterr().err  # the progress bar's line, then the message
    assert err.endswith(f"\nkascade eval: interrupted; the finished rows are in {out}, and the same command resumes "
                        "them\n")
    rows = _rows(out)
    assert [(r["strategy"], r["sample"]) for r in rows] == [(s, i) for i in (0, 1) for s in ("dense", "streamingllm",
                                                                                           "oracle")]
    summary = json.loads((out / "results.json").read_text())
    assert len(summary["rows"]) == 6 and "| oracle |" in (out / "summary.md").read_text()

    monkeypatch.setattr(runner.Session, "fidelity", lambda self, window, names=None: scored.append(window)
                        or real(self, window, names))
    assert main(argv) == 0
    assert len(scored) == 3  # only the third window ran again
    rows = _rows(out)
    assert len(rows) == 9 and len({results.row_key(r) for r in rows}) == 9
    assert {r["agreement"] for r in rows if r["strategy"] == "dense"} == {1.0}
    assert len(json.loads((out / "results.json").read_text())["rows"]) == 9
    capsys.readouterr()

    assert main([*argv, "--lengths", "48", "64"]) == 0  # another length adds its rows to the same folder
    assert len(_rows(out)) == 18 and len(scored) == 6
    capsys.readouterr()
    err = _error("eval", [*argv[1:], "--k-min", "16"], capsys)
    assert f"--out {out} holds results of other settings (--k-min 8 there, 16 now)" in err
    data.write_text(data.read_text() + json.dumps({"text": "more"}) + "\n")
    assert "--data: another file (or the file changed)" in _error("eval", argv[1:], capsys)
    assert len(_rows(out)) == 18


def test_a_folder_in_use_by_another_run_is_refused(tmp_path, tiny, capsys):
    """Two runs into one folder at once would mix their rows (of other settings, or each row twice)."""
    from kascade.files import hold

    data = texts_file(tmp_path / "d.jsonl", 2)
    out = tmp_path / "ev"
    out.mkdir()
    argv = [*FAST, "--data", str(data), "--samples", "2", "--out", str(out)]
    with hold(out, "kascade eval"):
        err = _error("eval", argv, capsys)
    assert f"--out {out} is in use by kascade eval (process " in err
    assert not (out / "rows.jsonl").exists() and tiny.loads == []
    assert main(["eval", *argv]) == 0 and len(_rows(out)) == 6  # released


def test_eval_data_windows_are_disjoint_from_the_calibration_windows(tmp_path, tiny, monkeypatch, capsys):
    """calibrate --data takes its texts from the start of the file (statistics, held-out, search) and prints how many;
    eval --data --skip-texts that many evaluates on windows of the texts after them."""
    from kascade.calibrate import pipeline
    from kascade.eval import runner

    monkeypatch.setattr(pipeline, "load_model", kascade.models.load_model)  # the tiny model
    data = texts_file(tmp_path / "d.jsonl", 7)
    made = []
    real_cut = pipeline.data_windows

    def spy(*a, **k):
        wins, used = real_cut(*a, **k)
        made.extend(wins)
        return wins, used

    monkeypatch.setattr(pipeline, "data_windows", spy)
    assert main(["calibrate", "--data", str(data), "--seq-len", "96", "--k", "8", "--tile", "16", "--k-min", "8",
                 "--samples", "2", "--target-agreement", "0.01", "--holdout", "1", "--max-anchors", "3",
                 "--method", "search", "--search-windows", "1", "--search-evals", "2",
                 "--out", str(tmp_path / "c")]) == 0
    skip = int(re.search(r"--skip-texts (\d+)", capsys.readouterr().out).group(1))
    # 3 windows of 96 tokens per 300-token text: statistics and held-out from text 1, the search's from text 2
    assert skip == 2 and len(made) == 4

    evaluated = []
    real_fid = runner.Session.fidelity
    monkeypatch.setattr(runner.Session, "fidelity", lambda self, w, names=None: evaluated.append(w)
                        or real_fid(self, w, names))
    assert main(["eval", *FAST, "--data", str(data), "--skip-texts", str(skip), "--samples", "3",
                 "--out", str(tmp_path / "e")]) == 0
    assert len(evaluated) == 3

    tok = CharTokenizer()
    texts = [tok(json.loads(line)["text"]).input_ids for line in data.read_text().splitlines()]

    def source(window):
        """(text index, first token) of a window: where in the file it was cut."""
        w = window.tolist()
        found = [(t, s) for t, ids in enumerate(texts) for s in range(len(ids) - len(w) + 1)
                 if ids[s : s + len(w)] == w]
        assert len(found) == 1
        return found[0]

    calibrated = {source(w)[0] for w in made}
    assert calibrated == {0, 1}
    assert {source(w)[0] for w in evaluated} <= set(range(skip, 7))
    # without --skip-texts the same windows would have overlapped the calibration's
    plain = [json.loads(x)["text"] for x in data.read_text().splitlines()]
    assert {source(w)[0] for w in runner.data_windows(tok, plain, [48], 3)[48]} & calibrated
    # calibrate cuts its windows as eval does (it took one window per text)
    assert [w.tolist() for w in made[:3]] == [w.tolist() for w in kascade.text.cut_windows(tok, plain, 96, 3)]


def test_a_refused_run_leaves_no_folder_it_made(tmp_path, tiny, capsys):
    """A run refused after its --out was checked (here: too few texts) used to leave the folders it had made, empty
    but for the lock; one that existed before stays, and so does one with earlier results."""
    data = texts_file(tmp_path / "two.jsonl", 2)
    argv = [*FAST, "--data", str(data), "--skip-texts", "2"]
    out = tmp_path / "new" / "deeper" / "ev"
    assert "--skip-texts 2 leaves none" in _error("eval", [*argv, "--out", str(out)], capsys)
    assert not (tmp_path / "new").exists()
    kept = tmp_path / "kept"
    kept.mkdir()
    assert "--skip-texts 2 leaves none" in _error("eval", [*argv, "--out", str(kept)], capsys)
    assert kept.is_dir()
    ok = tmp_path / "ok"
    assert main(["eval", *FAST, "--data", str(data), "--samples", "2", "--out", str(ok)]) == 0
    capsys.readouterr()
    assert "--skip-texts 2 leaves none" in _error("eval", [*argv, "--out", str(ok)], capsys)
    assert len(_rows(ok)) == 6  # earlier results stay


def test_a_shipped_plan_is_named_with_plan_and_refused_before_the_weights_where_none_ships(tmp_path, tiny, capsys):
    """--plan takes a shipped plan's name (it said "no plan file"); a model without that plan is told so before its
    weights are read."""
    assert build_parser().parse_args(["eval", "--plan", "searched"]).plan == "searched"
    err = _error("eval", [*FAST, "--plan", "searched", "--out", str(tmp_path / "e")], capsys)
    assert "no shipped 'searched' plan for this model" in err and tiny.loads == []
    err = _error("eval", [*FAST, "--plan", "fastest", "--out", str(tmp_path / "e")], capsys)
    assert "argument --plan: no plan file at fastest (give a plan file or a shipped plan: default, searched" in err


def test_resume_knows_the_model_folder_by_any_path(tmp_path, monkeypatch, capsys):
    """The same model folder given once relative and once absolute: the second run resumed nothing and was refused
    ("other settings")."""
    folder = tmp_path / "m"
    tiny_model("llama").save_pretrained(folder)
    monkeypatch.setattr(kascade.models, "load_model", tiny_loader(tiny_model("llama")).load)
    monkeypatch.chdir(tmp_path)
    argv = [*FAST, "--samples", "1", "--out", str(tmp_path / "e")]
    assert main(["eval", *argv, "--model", "m"]) == 0
    assert main(["eval", *argv, "--model", str(folder)]) == 0, capsys.readouterr().err
    assert main(["eval", *argv, "--model", "./m/"]) == 0


@pytest.mark.parametrize("flag", ["--plan", "--longbench"])
def test_a_file_that_is_not_utf8_is_named_in_the_error(tmp_path, tiny, capsys, flag):
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b'\xff\xfe{"context": "x"}\n')
    err = _error("eval", [flag, str(bad), "--out", str(tmp_path / "e")], capsys)
    assert f"{bad}" in err and "is not UTF-8 text" in err and tiny.loads == []


# -- the needle tasks on the tiny model -----------------------------------------------------------------------------

@pytest.fixture
def chat_tiny(monkeypatch):
    """The tiny random Llama with a tokenizer that has a chat template (recording its calls) and a decoder."""
    tiny = tiny_loader(tiny_model("llama"), tokenizer=ChatCharTokenizer())
    monkeypatch.setattr(kascade.models, "load_model", tiny.load)
    return tiny


def test_needle_passkey_end_to_end_on_the_tiny_model(tmp_path, chat_tiny, capsys):
    from kascade.eval import needle

    out = tmp_path / "ev"
    argv = ["eval", "--strategies", "dense,streamingllm", "--tasks", "needle_passkey", "--lengths", "300",
            "--samples", "3", "--k-min", "8", "--ratio", "0.25", "--out", str(out)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    rows = _rows(out)
    assert [(r["strategy"], r["sample"]) for r in rows] == [(s, i) for i in range(3) for s in ("dense", "streamingllm")]
    tok = chat_tiny.load()[1]
    for r in rows:
        sample = needle.generate("needle_passkey", tok, 300, 0, r["sample"])
        assert r["answers"] == sample.answers and r["depth"] == sample.meta["depth"]
        assert r["score"] == needle.score(sample, r["prediction"])
        assert 290 <= r["prompt_tokens"] <= 300  # the chat-formatted prompt, at most --lengths
    # the model saw the prompt through the chat template, generation prompt added (the demo's format)
    asked = [c for c in tok.chats if c["add_generation_prompt"] and "secret passphrase of the archive?" in
             c["messages"][0]["content"]]
    assert asked and all(c["messages"][0]["role"] == "user" for c in asked)
    assert all(r["attended_fraction"] < 1 for r in rows if r["strategy"] == "streamingllm")
    summary = json.loads((out / "results.json").read_text())["summary"]
    sparse = next(s for s in summary if s["strategy"] == "streamingllm")
    dense = next(s for s in summary if s["strategy"] == "dense")
    assert sparse["dense_score"] == dense["score"] and sparse["ci_method"] == "wilson"
    assert sparse["ci_low"] <= sparse["score"] <= sparse["ci_high"]
    assert "| task | length | samples | dense | streamingllm |" in printed
    assert re.search(r"\| needle_passkey \| 300 \| 3 \| \d\.\d{3} \[\d\.\d{3}, \d\.\d{3}\] \| \d\.\d{3} \[", printed)


def test_batched_answers_are_the_answers_of_one_sample_at_a_time(tmp_path, chat_tiny, capsys):
    """--batch-size answers the samples of a task and length in left-padded batches: the same predictions, scores
    and prompt lengths as one at a time (fp32 reference), each row saying its batch; the folder records the batch
    size, so a run of another size is not mixed into it."""
    argv = ["eval", "--strategies", "dense,oracle,streamingllm", "--tasks", "needle_passkey,needle_fact",
            "--lengths", "300", "--samples", "3", "--k-min", "8", "--ratio", "0.25"]
    assert main([*argv, "--out", str(tmp_path / "one")]) == 0
    assert main([*argv, "--out", str(tmp_path / "three"), "--batch-size", "3"]) == 0
    one, three = _rows(tmp_path / "one"), _rows(tmp_path / "three")
    key = lambda r: (r["task"], r["sample"], r["strategy"])  # noqa: E731
    assert sorted(map(key, one)) == sorted(map(key, three)) and len(one) == 18
    by = {key(r): r for r in one}
    for r in three:
        alone = by[key(r)]
        assert (r["prediction"], r["score"], r["prompt_tokens"]) == \
            (alone["prediction"], alone["score"], alone["prompt_tokens"]), key(r)
        assert r["batch"] == 3 and "batch" not in alone
        assert r.get("backend") == alone.get("backend") == (None if r["strategy"] == "dense" else "reference")
    assert json.loads((tmp_path / "three" / "run.json").read_text())["batch_size"] == 3
    assert "batch_size" not in json.loads((tmp_path / "one" / "run.json").read_text())
    capsys.readouterr()
    err = _error("eval", [*argv[1:], "--out", str(tmp_path / "three")], capsys)
    assert "batch_size" in err, err


def test_a_left_padded_batch_answers_each_prompt_as_alone(chat_tiny):
    """Session.generate_batch on prompts of three lengths (two of them padded) gives each one's answer alone, cut at
    its own max_new_tokens and end of text."""
    from kascade.eval import needle, runner

    model, tok = chat_tiny.load()
    samples = [needle.generate(t, tok, n, 0, i) for t, n, i in
               (("needle_passkey", 300, 0), ("needle_fact", 270, 1), ("needle_multikey", 256, 2))]
    sess = runner.Session(model, tok, ["dense", "oracle"], budget=dict(k_min=8, ratio=0.25))
    for name in ("dense", "oracle"):
        batch = sess.generate_batch(name, samples)
        assert len({b[4] for b in batch}) == 3  # three prompt lengths
        for s, b in zip(samples, batch):
            alone = sess.generate(name, s)
            assert (b[0], b[4], b[5]) == (alone[0], alone[4], alone[5])


def test_the_needle_tasks_run_their_default_sample_count_and_resume(tmp_path, chat_tiny, monkeypatch, capsys):
    """Without --samples a needle task runs needle.SAMPLES samples per length (the other tasks keep theirs); the
    answers here are stubbed (the dense answer is right, the sparse one right on even samples only)."""
    from kascade.eval import needle, runner

    answered = []

    def stub(self, name, sample, ids=None):
        answered.append((name, sample.meta["index"]))
        right = name == "dense" or sample.meta["index"] % 2 == 0
        return (sample.answers[0] if right else "no idea"), 1.0, {}, 0.0, 300, None

    monkeypatch.setattr(runner.Session, "generate", stub)
    out = tmp_path / "ev"
    argv = ["eval", "--strategies", "dense,streamingllm", "--tasks", "needle_passkey,fidelity", "--lengths", "300",
            "--k-min", "8", "--ratio", "0.25", "--out", str(out)]
    assert main(argv) == 0
    rows = _rows(out)
    assert len([r for r in rows if r["task"] == "needle_passkey"]) == 2 * needle.SAMPLES == 200
    assert len([r for r in rows if r["task"] == "fidelity"]) == 2 * runner.SAMPLES
    md = capsys.readouterr().out
    assert "| needle_passkey | 300 | 100 | 1.000 [0.963, 1.000] | 0.500 [0.404, 0.596] |" in md
    assert main(argv) == 0 and len(_rows(out)) == 204 and len(answered) == 200  # resumed: nothing ran again


def test_score_dtype_reaches_every_strategys_plan_and_defines_the_rows(tmp_path, tiny, monkeypatch, capsys):
    from kascade.eval import runner

    plans, real = {}, runner.make_strategy

    def spy(name, *a, **kw):
        made = real(name, *a, **kw)
        if made is not None:
            plans[name] = made[0]
        return made

    monkeypatch.setattr(runner, "make_strategy", spy)
    data = texts_file(tmp_path / "d.jsonl", 1)
    out = tmp_path / "ev"
    argv = ["eval", "--strategies", "dense,kascade,oracle", "--tasks", "fidelity", "--lengths", "48", "--k-min", "8",
            "--ratio", "0.25", "--data", str(data), "--samples", "1", "--out", str(out)]
    assert main([*argv, "--score-dtype", "fp8"]) == 0
    assert sorted(plans) == ["kascade", "oracle"]
    assert all(p.score_dtype == "fp8" and p.budget.score_dtype == "fp8" for p in plans.values())
    assert json.loads((out / "run.json").read_text())["score_dtype"] == "fp8"
    capsys.readouterr()
    err = _error("eval", argv[1:], capsys)  # the same folder without the flag: other settings
    assert "score_dtype" in err or "score-dtype" in err, err
    assert "invalid choice: 'bf16'" in _error("eval", [*argv[1:], "--score-dtype", "bf16"], capsys)
    plans.clear()
    assert main([*argv[:-1], str(tmp_path / "exact")]) == 0
    assert plans and all(p.score_dtype is None for p in plans.values())
    assert "score_dtype" not in json.loads((tmp_path / "exact" / "run.json").read_text())
    plans.clear()  # INT8 scoring the same way
    assert main([*argv[:-1], str(tmp_path / "int8"), "--score-dtype", "int8"]) == 0
    assert plans and all(p.score_dtype == "int8" and p.budget.score_dtype == "int8" for p in plans.values())
    assert json.loads((tmp_path / "int8" / "run.json").read_text())["score_dtype"] == "int8"
