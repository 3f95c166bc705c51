"""`kascade demo`: greedy answers through model.generate (timed per token) and the teacher-forced comparison."""

import pytest
import torch
from transformers import DynamicCache

from conftest import tiny_model
from kascade import demo
from kascade.cli import main
from kascade.models import cache_kwargs


class _Tokenizer:
    pad_token_id = eos_token_id = 2

    def decode(self, ids, **kw):
        return " ".join(map(str, ids))


class _Bar:
    n = 0

    def update(self, k):
        self.n += k


def test_greedy_answers_as_a_hand_written_greedy_loop():
    model = tiny_model("llama")
    ids = torch.randint(3, 97, (1, 50), generator=torch.Generator().manual_seed(0))
    bar = _Bar()
    r = demo.greedy(model, _Tokenizer(), ids, 8, bar)
    with torch.no_grad():  # prefill into a cache, then one forward per token until eos or 8 tokens
        cache = cache_kwargs(model, DynamicCache())
        nxt = model(ids, use_cache=True, **cache).logits[0, -1].argmax()
        new = [int(nxt)]
        while len(new) < 8 and new[-1] != 2:
            nxt = model(nxt.view(1, 1), use_cache=True, **cache).logits[0, -1].argmax()
            new.append(int(nxt))
    assert r.answer == " ".join(map(str, new)) and r.new_tokens == len(new) and r.decode_steps == len(new) - 1
    assert bar.n == len(new) and r.prefill_s > 0 and r.decode_s >= 0


@pytest.mark.model
@pytest.mark.parametrize("plan", [None, "searched"])
def test_demo_end_to_end(default_model, monkeypatch, capsys, plan):
    """With the model's default plan, and with a shipped plan named on the command line (it was refused as "no plan
    file")."""
    from kascade.plan import shipped_plan

    def load(*a, check=None, **k):  # as load_model: the check before the weights
        check(default_model[0].config, default_model[1])
        return default_model

    monkeypatch.setattr(demo, "load_model", load)
    argv = ["demo", "--tokens", "600", "--max-new-tokens", "4", "--compare-last", "64"]
    assert main(argv + (["--plan", plan] if plan else [])) == 0
    out = capsys.readouterr().out
    assert shipped_plan(default_model[0], plan or "default").source in out
    assert "teacher-forced on the prompt's last 64 positions: top-1 agreement" in out
    lines = {ln.split()[0]: ln for ln in out.splitlines() if ln.startswith(("dense ", "kascade "))}
    assert set(lines) == {"dense", "kascade"}


def test_a_plan_for_another_model_is_refused_before_the_weights(tmp_path, monkeypatch, capsys):
    """The plan is checked against the model's config before the weights are read (it was after: ~20 s)."""
    from cli_support import one_line_error, tiny_loader

    from kascade import KascadePlan, ModelFingerprint

    loader = tiny_loader(tiny_model("llama"))
    monkeypatch.setattr(demo, "load_model", loader.load)
    KascadePlan.uniform(ModelFingerprint("llama", 30, 9, 3, 64), 6).save(tmp_path / "plan.json")
    err = one_line_error("demo", ["--plan", str(tmp_path / "plan.json")], capsys)
    assert "--plan was made for another model" in err and "num_layers: plan has 30" in err
    assert loader.loads == []
