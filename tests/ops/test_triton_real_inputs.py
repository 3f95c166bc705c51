"""Triton selections on the default model's own queries and keys (real attention: sink tokens, peaked and flat
heads), on the test device (the interpreter on the CPU, CUDA in GPU mode), against the reference: the same sets,
ties within rounding aside, in prefill and in decode. Random inputs (the other kernel tests) have flat attention;
real heads put most of their mass on a few keys, which is where the radix select's first histogram (exponents
below a bound of the k-th value) meets its fallback path.
"""

import pytest
import torch

triton = pytest.importorskip("triton", reason="triton is not installed: the Triton kernels cannot be tested")

from kascade.budget import Budget  # noqa: E402
from kascade.integration.hf import attach  # noqa: E402
from kascade.integration.runtime import DenseRuntime  # noqa: E402
from kascade.ops import reference  # noqa: E402
from kascade.ops.triton import decode as td  # noqa: E402
from kascade.ops.triton import prefill as tp  # noqa: E402
from kascade.text import windows  # noqa: E402
from kernel_checks import (check_decode_selection, check_prefill_selection, dev, pooled_decode_rows,  # noqa: E402
                           pooled_prefill_rows)

pytestmark = pytest.mark.model
LAYERS = (1, 9, 18, 29)  # early, middle and last layers of the 30
LENGTH = 288  # 18 tiles of 16
BUDGET = Budget(ratio=0.1, k_min=32, tile=16)  # every tile after the first keeps 16 of its earlier keys


class _Capture(DenseRuntime):
    """The dense runtime (reference geometry, on the CPU), keeping the queries and keys of LAYERS."""

    backend = "reference"

    def __init__(self):
        self.qk = {}

    def attend(self, layer, q, k, v, fwd, scale):
        if layer in LAYERS:
            self.qk[layer] = (q.detach().clone(), k.detach().clone())
        return super().attend(layer, q, k, v, fwd, scale)


@pytest.fixture(scope="module")
def real_qk(default_model):
    model, tok = default_model
    ids = windows(tok, "eval", LENGTH, 1, seed=3)[0][None]
    cap = _Capture()
    with torch.no_grad(), attach(model, cap):
        model(ids)
    return cap.qk


@pytest.mark.parametrize("layer", LAYERS)
def test_selections_on_real_queries_and_keys_match_the_reference(real_qk, layer):
    q, k = real_qk[layer]  # [1, 9, L, 64], [1, 3, L, 64], fp32
    assert q.shape[2] == k.shape[2] == LENGTH
    scale = q.shape[-1] ** -0.5
    kv_start = torch.tensor([0])
    # prefill: every tile of the window
    want = reference.select(q, k, budget=BUDGET, scale=scale, kv_start=kv_start, q_offset=0)
    got = tp.select_prefill(dev(q), dev(k), budget=BUDGET, scale=scale, kv_start=kv_start, q_offset=0)
    pooled = pooled_prefill_rows(q, k, kv_start, 0, scale, BUDGET.tile)
    check_prefill_selection(got, want, pooled, kv_start, 0, LENGTH, BUDGET, f"layer {layer} prefill")
    # decode: the window's last query over all its keys
    qd = q[:, :, -1:].contiguous()
    want = reference.select(qd, k, budget=BUDGET, scale=scale, kv_start=kv_start, q_offset=LENGTH - 1)
    got = td.select_decode(dev(qd), dev(k), budget=BUDGET, scale=scale, kv_start=kv_start, q_offset=LENGTH - 1)
    pooled = pooled_decode_rows(qd, k, kv_start, LENGTH - 1, scale)
    check_decode_selection(got, want, pooled, kv_start, LENGTH - 1, BUDGET, paged=False, what=f"layer {layer} decode")
