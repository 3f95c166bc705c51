"""examples/jax_decoder.py: a plain-JAX decoder running Kascade layer by layer."""

import importlib.util
import pathlib
import sys

import numpy as np
import pytest

pytest.importorskip("jax.numpy")  # not "jax": see test_jax_reference.py
import torch  # noqa: E402

from kascade import ops  # noqa: E402
from kascade.reuse import layer_selection  # noqa: E402

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


def test_layers_attend_what_the_plan_says(capsys):
    out = example.main(ratio=0.5, **{**TINY, "tile": 4, "verbose": True})
    assert "sequence 0 (prompt 24 tokens)" in capsys.readouterr().out
    plan = out["plan"]
    for sels in out["selections"]:  # prefill, then every decode step
        assert set(sels) == set(range(plan.num_layers))
        assert np.asarray(sels[2].attended_counts()).sum() > 0, "the anchor selects keys"
        # Reuse layers: the torch reuse rule (kascade.reuse) applied to the anchors' selections.
        torch_sels = {a: ops.Selection(torch.tensor(np.asarray(sels[a].indices)).long(),
                                       torch.tensor(np.asarray(sels[a].row_start)).long(), sels[a].tile,
                                       sels[a].decode) for a in plan.anchors}
        for layer in range(plan.num_layers):
            if not plan.is_anchor(layer):
                want = layer_selection(plan, layer, torch_sels, step=None).indices.numpy()
                np.testing.assert_array_equal(np.asarray(sels[layer].indices), want)
                assert not np.array_equal(np.asarray(sels[layer].indices), torch_sels[plan.anchor_of(layer)].indices)
    last = np.asarray(out["selections"][-1][2].attended_counts())[:, :, 0]  # the last decode step's anchor
    n = np.array(TINY["prompt_lengths"]) + TINY["steps"] - 1
    assert (last < n[:, None]).all(), "the sparse budget keeps fewer keys than a dense step"
