import pathlib
import sys

import pytest

# Let tests import helpers that live next to them (tests/ops/brute_force.py and friends).
sys.path.insert(0, str(pathlib.Path(__file__).parent / "ops"))


@pytest.fixture(scope="session")
def default_model():
    """The real default model (SmolLM2-135M-Instruct, fp32 on CPU), loaded once per test session."""
    import kascade

    return kascade.load_default_model()


def tiny_model(family: str = "llama", **overrides):
    """A randomly initialised model of a given family, small enough to build in a blink."""
    import torch
    import transformers

    cfg_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    }[family]
    kw = dict(vocab_size=97, hidden_size=48, intermediate_size=64, num_hidden_layers=4, num_attention_heads=6,
              num_key_value_heads=2, head_dim=8, max_position_embeddings=512)
    if family == "mistral":
        kw["sliding_window"] = None
    kw.update(overrides)
    torch.manual_seed(0)
    model = model_cls(cfg_cls(**kw)).eval()
    return model


@pytest.fixture
def forward_states(monkeypatch):
    """Every forward's state (step, plan, the selections left at its end), in order, as the runtime makes them."""
    from kascade.integration.runtime import KascadeRuntime

    states, begin = [], KascadeRuntime.begin
    monkeypatch.setattr(KascadeRuntime, "begin", lambda self, *a: states.append(begin(self, *a)) or states[-1])
    return states


@pytest.fixture
def op_calls(monkeypatch):
    """The runtime's calls of the public ops: ``[(name, args, kwargs, result)]`` in order (outermost calls only: an
    op that calls another is recorded once)."""
    from kascade.integration import runtime

    calls, depth = [], [0]

    def spy(name, orig):
        def call(*a, **kw):
            depth[0] += 1
            try:
                out = orig(*a, **kw)
            finally:
                depth[0] -= 1
            if depth[0] == 0:
                calls.append((name, a, kw, out))
            return out
        return call

    for name in ("dense_select", "select", "dense_attention", "sparse_attention"):
        monkeypatch.setattr(runtime.ops, name, spy(name, getattr(runtime.ops, name)))
    return calls
