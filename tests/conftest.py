# GPU mode of the Triton kernel tests (compiled on CUDA tensors, shapes and fuzz cases x4; add -n 16 with xdist):
#   KASCADE_TEST_DEVICE=cuda python3 -m pytest tests/ops/test_triton_*.py tests/integration/test_hf_triton.py
import os
import pathlib
import sys

import pytest

# Let tests import helpers that live next to them (tests/ops/brute_force.py and friends).
sys.path.insert(0, str(pathlib.Path(__file__).parent / "ops"))

# Where the Triton kernel tests run (tests/ops/kernel_checks.py hands every tensor they make to this device).
# "cpu" (default, CI): the kernels run in Triton's interpreter on CPU tensors, which needs TRITON_INTERPRET=1 before
# triton is first imported, i.e. here: pytest imports this file before any test module. "cuda" (or "cuda:N"): the
# kernels are compiled and run on the GPU, with shapes and case counts multiplied by TEST_SCALE.
TEST_DEVICE = os.environ.get("KASCADE_TEST_DEVICE", "").strip().lower() or "cpu"
if TEST_DEVICE.split(":")[0] not in ("cpu", "cuda"):
    raise pytest.UsageError(f"KASCADE_TEST_DEVICE must be 'cpu' or 'cuda[:N]', got {TEST_DEVICE!r}")
if TEST_DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"
elif os.environ.get("TRITON_INTERPRET", "0") == "1":
    raise pytest.UsageError("KASCADE_TEST_DEVICE=cuda runs the compiled kernels: unset TRITON_INTERPRET")
# Size multiplier of the kernel tests' shapes (N, L) and of the fuzz's case count: 1 on the CPU (the interpreter is
# slow), 4 on a GPU; KASCADE_TEST_SCALE overrides it.
TEST_SCALE = int(os.environ.get("KASCADE_TEST_SCALE", "1" if TEST_DEVICE == "cpu" else "4"))
if TEST_SCALE < 1:
    raise pytest.UsageError(f"KASCADE_TEST_SCALE must be >= 1, got {TEST_SCALE}")


def pytest_report_header(config):
    mode = "Triton interpreter on the CPU" if TEST_DEVICE == "cpu" else f"compiled on {TEST_DEVICE}"
    return f"kascade kernel tests: {mode}, size scale {TEST_SCALE} (KASCADE_TEST_DEVICE, KASCADE_TEST_SCALE)"


def pytest_sessionstart(session):
    if TEST_DEVICE != "cpu":
        import torch

        if not torch.cuda.is_available():
            raise pytest.UsageError(f"KASCADE_TEST_DEVICE={TEST_DEVICE} but torch sees no CUDA device")


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
    # Random weights: the end-of-sequence token is an arbitrary token here. A generation must not stop (or pad) when
    # it happens to come up, or generate() and a decoder that ignores it (GraphDecoder) produce different lengths.
    model.generation_config.eos_token_id = None
    return model


@pytest.fixture
def forwards(monkeypatch):
    """Every forward pass's :class:`kascade.Forward` (its step, plan, and the selections left at its end), in order,
    as the runtime begins them."""
    from kascade.attention import Attention

    passes, begin = [], Attention.begin
    monkeypatch.setattr(Attention, "begin", lambda self, fwd, *a: (begin(self, fwd, *a), passes.append(fwd))[0])
    return passes


@pytest.fixture
def op_calls(monkeypatch):
    """The runtime's calls of the public ops: ``[(name, args, kwargs, result)]`` in order (outermost calls only: an
    op that calls another is recorded once)."""
    from kascade import ops

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
        monkeypatch.setattr(ops, name, spy(name, getattr(ops, name)))
    return calls
