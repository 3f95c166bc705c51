"""examples/jax_decoder.py: a plain-JAX decoder running Kascade layer by layer."""

import importlib.util
import pathlib
import sys

import numpy as np
import pytest

pytest.importorskip("jax.numpy")  # not "jax": see test_jax_reference.py


_PATH = pathlib.Path(__file__).parents[2] / "examples" / "jax_decoder.py"
_spec = importlib.util.spec_from_file_location("example_jax_decoder", _PATH)
example = sys.modules["example_jax_decoder"] = importlib.util.module_from_spec(_spec)  # dataclasses look it up
_spec.loader.exec_module(example)

# Prompts whose lengths are multiples of the tile: then ratio 1 keeps every key of every tile (a partial last tile
# would keep k(N) - T earlier keys, fewer than it has).
TINY = dict(layers=3, dim=32, q_heads=4, kv_heads=2, head_dim=8, prompt_lengths=(24, 16), steps=3, k_min=1,
            tile=8, verbose=False)


def test_full_budget_gives_the_dense_decoder():
    full = example.main(ratio=1.0, **TINY)
    dense = example.main(dense=True, **TINY)
    assert full["plan"].anchors == (0, 2) and full["plan"].head_map[1] == (1, 0)
    np.testing.assert_allclose(full["prefill_logits"], dense["prefill_logits"], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(full["decode_logits"], dense["decode_logits"], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(full["tokens"], dense["tokens"])
    assert np.abs(dense["decode_logits"]).max() > 0.1  # the logits are not trivially equal


def test_a_sparse_plan_runs_and_changes_the_outputs(capsys):
    """Below the full budget the decoder's reuse layers attend fewer keys (which keys: tests/jax/test_jax_attention.py
    against the PyTorch runtime): the logits move away from dense, the printout says how many keys were kept
    (27 keys at the last step of the 24-token prompt: floor(0.5 * 27) = 13)."""
    out = example.main(ratio=0.5, **{**TINY, "tile": 4, "verbose": True})
    dense = example.main(dense=True, **{**TINY, "tile": 4})
    printed = capsys.readouterr().out
    assert "sequence 0 (prompt 24 tokens)" in printed and "attend 13 of its 27 keys per KV head" in printed
    assert out["plan"].anchors == (0, 2)
    assert np.abs(out["prefill_logits"] - dense["prefill_logits"]).max() > 1e-3
    assert np.abs(out["decode_logits"] - dense["decode_logits"]).max() > 1e-3
