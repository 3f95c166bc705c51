"""Where the JAX tests of the Triton backend run their arrays: JAX's CPU under Triton's interpreter (TRITON_INTERPRET=1,
set by tests/conftest.py), or JAX's GPU with KASCADE_TEST_DEVICE=cuda."""

import os

import pytest

ON_GPU = os.environ.get("KASCADE_TEST_DEVICE", "cpu").strip().lower().startswith("cuda")


def kernel_device():
    """The JAX device whose arrays the Triton backend takes in this test run (skips the test where there is none)."""
    import jax

    if not ON_GPU:
        if os.environ.get("TRITON_INTERPRET", "0") != "1":
            pytest.skip("needs Triton's interpreter (TRITON_INTERPRET=1) or KASCADE_TEST_DEVICE=cuda")
        return jax.devices("cpu")[0]
    try:
        return jax.devices("gpu")[0]
    except RuntimeError:
        pytest.skip("KASCADE_TEST_DEVICE=cuda but JAX sees no GPU")
