"""Where a Triton-backend call of the JAX ops spends its time besides the kernels, on any machine (CPU included).

    python -m benchmarks.jax_overhead

The kernels (``kascade.ops.dense_attention`` / ``sparse_attention``) are replaced by no-ops returning an empty
output, so what is timed is the JAX-side argument checks, the DLPack exchanges and the bridge; then the pieces one
by one, and the torch op's own per-call work (planning a step, checking a selection's values); then a reuse layer of
the planned path (``kascade.jax.Attention`` and ``kascade.Attention``, backend "triton", one step plan per pass) with
the same no-op kernels: what a JAX layer pays beyond the PyTorch runtime's layer. Decode at
Llama-3.1-8B shapes, B=1, 128K keys, a selection of 8 x 13,107 keys. Median microseconds of 30 calls. On the CPU the
arrays live on the CPU (Triton's interpreter mode lets the bridge take them); the kernels never run.
"""

import os
import statistics
import time

os.environ["TRITON_INTERPRET"] = "1"  # the bridge takes CPU arrays only in interpreter mode

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import torch  # noqa: E402

import kascade  # noqa: E402
import kascade.jax as kj  # noqa: E402
from kascade import KascadePlan, ModelFingerprint, ops  # noqa: E402

B, HQ, H, N, D, K = 1, 32, 8, 131072, 128, 13107


def t_us(fn, n: int = 30) -> float:
    fn()
    ts = []
    for _ in range(n):
        a = time.perf_counter()
        r = fn()
        if not isinstance(r, (torch.Tensor, tuple)):
            jax.block_until_ready(r)
        ts.append(time.perf_counter() - a)
    return statistics.median(ts) * 1e6


def main() -> None:
    key = jax.random.PRNGKey(0)
    q = jax.random.normal(key, (B, HQ, 1, D), jnp.bfloat16)
    k = jax.random.normal(key, (B, H, N, D), jnp.bfloat16)
    idx = jnp.tile(jnp.arange(K, dtype=jnp.int32)[None, None, None, :], (B, H, 1, 1))
    sel = kj.Selection(idx, jnp.zeros(B, jnp.int32), 32, True)
    rows = {}
    real = ops.sparse_attention, ops.dense_attention
    ops.sparse_attention = lambda q, k, v, sel, **kw: torch.empty_like(q)
    ops.dense_attention = lambda q, k, v, **kw: torch.empty_like(q)
    try:
        rows["kj.dense_attention, kernel stubbed"] = t_us(lambda: kj.dense_attention(q, k, k, backend="triton"))
        rows["kj.sparse_attention, kernel stubbed"] = t_us(lambda: kj.sparse_attention(q, k, k, sel, backend="triton"))
    finally:
        ops.sparse_attention, ops.dense_attention = real
    rows["JAX-side argument checks (_geometry)"] = t_us(lambda: kj._geometry(q, k, k, None, None, "triton"))
    rows["torch.from_dlpack(k)"] = t_us(lambda: torch.from_dlpack(k))
    out = torch.zeros(B, HQ, 1, D, dtype=torch.bfloat16)
    rows["jax.dlpack.from_dlpack(output)"] = t_us(lambda: jax.dlpack.from_dlpack(out))
    tq, tk = torch.from_dlpack(q), torch.from_dlpack(k)
    tsel = ops.Selection(torch.from_dlpack(idx), torch.zeros(B, dtype=torch.long), 32, True)
    step = ops.plan_step(tq, tk, backend="reference")
    rows["torch op: plan_step"] = t_us(lambda: ops.plan_step(tq, tk, backend="reference"))
    rows[f"torch op: selection value checks ({H} x {K} keys)"] = t_us(lambda: ops._check_selection_values(tsel, step))
    rows.update(planned_reuse_layer(q, k, tq, tk, tsel))
    print(f"{jax.devices()[0].platform}, jax {jax.__version__}, torch {torch.__version__}")
    for name, us in rows.items():
        print(f"{us:9.0f} us  {name}")


def planned_reuse_layer(q, k, tq, tk, tsel) -> dict:
    """Layer 2 (a reuse layer) of a pass of the planned path, kernels stubbed, in both frameworks."""
    plan = KascadePlan(ModelFingerprint("bench", 3, HQ, H, D), (0, 1), (tuple(range(H)),) * 3, ratio=0.1)
    real = ops.sparse_attention, ops.dense_select, ops.plan_step, ops.select
    ops.sparse_attention = lambda q, k, v, sel, **kw: torch.empty_like(q)
    ops.select = lambda q, k, **kw: tsel
    ops.dense_select = lambda q, k, v, **kw: (torch.empty_like(q), tsel)
    ops.plan_step = lambda q, k, **kw: real[2](q, k, **{**kw, "backend": "reference"})  # no decode metadata kernel
    rows = {}
    try:
        jattn, tattn = kj.Attention(plan, backend="triton"), kascade.Attention(plan, backend="triton")
        jf, tf = kj.Forward(), kascade.Forward()
        for layer in (0, 1):  # layer 0 plans the pass, layer 1 (an anchor) selects
            jattn(layer, q, k, k, jf)
            tattn(layer, tq, tk, tk, tf)
        rows["kj.Attention reuse layer, kernel stubbed"] = t_us(lambda: jattn(2, q, k, k, jf))
        rows["kascade.Attention reuse layer, kernel stubbed"] = t_us(lambda: tattn(2, tq, tk, tk, tf))
    finally:
        ops.sparse_attention, ops.dense_select, ops.plan_step, ops.select = real
    return rows


if __name__ == "__main__":
    main()
