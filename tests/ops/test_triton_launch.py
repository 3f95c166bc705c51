"""kascade.ops.triton.launch: a configuration's compiled launcher is called directly only when Triton would launch the
same compiled kernel (same configuration object, same specialisation of every runtime argument); otherwise, and the
first time, Triton's own launch runs. Its bookkeeping is tested here with a stand-in kernel on any machine; the
compiled path against Triton's own launch on the GPU (KASCADE_TEST_DEVICE=cuda)."""

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed")

from kernel_checks import DEVICE, dev  # noqa: E402
from kascade.ops.triton import launch as L  # noqa: E402


class _Param:
    def __init__(self, name, constexpr=False, default=None):
        self.name, self.is_constexpr, self.default = name, constexpr, default


class _Compiled:
    function, packed_metadata = "function", "metadata"

    def __init__(self, calls):
        self.calls = calls

    def run(self, *a):
        self.calls.append(("direct", a))


class _Kernel:
    """A stand-in @triton.jit kernel: ``fn[grid](*args, **consts)`` records the call and returns its compiled kernel."""

    __name__ = "stand_in"

    def __init__(self, params):
        self.params, self.calls = params, []
        self.compiled = _Compiled(self.calls)
        self.device_caches = {0: ({}, {}, "target", "backend", None)}  # Triton 3.6's: the backend is the fourth

    def __getitem__(self, grid):
        def run(*args, **consts):
            self.calls.append(("triton", grid, args, consts))
            return self.compiled
        return run


def _spec(backend, a, *_):  # Triton's rule in small: integers by value 1 and divisibility by 16
    assert backend == "backend"  # the kernel's own backend, as Triton's binder uses
    return ("i32", "1" if a == 1 else "D" if a % 16 == 0 else "") if isinstance(a, int) else ("obj",)


@pytest.fixture
def fake_triton(monkeypatch):
    monkeypatch.setattr(L, "_specialize", _spec)
    monkeypatch.setattr(L, "interpreting", lambda: False)
    monkeypatch.setattr(L, "_knobs", SimpleNamespace(runtime=SimpleNamespace(launch_enter_hook=None)), raising=False)
    active = SimpleNamespace(get_current_device=lambda: 0, get_current_stream=lambda d: 7)
    monkeypatch.setattr(L, "_driver", SimpleNamespace(active=active), raising=False)
    monkeypatch.setattr(L, "_FAST", {})
    monkeypatch.setattr(L, "FAST", True)


def _kernel():
    return _Kernel([_Param("x"), _Param("n"), _Param("A", True), _Param("B", True, default=5)])


def test_second_launch_calls_the_compiled_launcher_with_every_parameter(fake_triton):
    fn, consts = _kernel(), dict(A=3, num_warps=4)
    L.launch(fn, (2, 3), ("t", 32), consts)
    assert fn.calls == [("triton", (2, 3), ("t", 32), consts)]
    L.launch(fn, (2, 3), ("u", 48), consts)  # another tensor and another multiple of 16: the same kernel
    # grid padded to three, the stream, the compiled function and metadata, no launch metadata or hooks, then the
    # runtime arguments and the constexprs in parameter order (B from its default)
    assert fn.calls[1] == ("direct", (2, 3, 1, 7, "function", "metadata", None, None, None, "u", 48, 3, 5))


def test_another_specialisation_or_configuration_takes_tritons_launch(fake_triton):
    fn, consts = _kernel(), dict(A=3)
    L.launch(fn, (1,), ("t", 32), consts)
    L.launch(fn, (1,), ("t", 1), consts)  # 1 is a constant to Triton: another compiled kernel
    L.launch(fn, (1,), ("t", 1), consts)  # ... kept from then on
    other = dict(consts)  # equal keywords, another configuration's dict: looked up by identity
    L.launch(fn, (1,), ("t", 1), other)
    assert [c[0] for c in fn.calls] == ["triton", "triton", "direct", "triton"]


def test_a_launch_hook_or_the_switch_off_always_takes_tritons_launch(fake_triton, monkeypatch):
    fn, consts = _kernel(), dict(A=3)
    L.launch(fn, (1,), ("t", 32), consts)
    monkeypatch.setattr(L._knobs.runtime, "launch_enter_hook", lambda *a: None)
    L.launch(fn, (1,), ("t", 32), consts)
    monkeypatch.setattr(L._knobs.runtime, "launch_enter_hook", None)
    monkeypatch.setattr(L, "FAST", False)
    L.launch(fn, (1,), ("t", 32), consts)
    assert [c[0] for c in fn.calls] == ["triton"] * 3


def test_constexprs_before_runtime_arguments_are_refused(fake_triton):
    fn = _Kernel([_Param("A", True), _Param("x")])
    with pytest.raises(TypeError, match="runtime arguments first"):
        L.launch(fn, (1,), ("t",), {"A": 1})


@pytest.mark.skipif(DEVICE.type != "cuda", reason="the compiled launcher: GPU only")
def test_compiled_fast_launch_equals_tritons_launch(monkeypatch):
    """A decode pass launched through the compiled launcher (its second call) gives Triton's own launch's bits, and a
    query whose address is not 16-byte aligned (another specialisation) is launched by Triton, not the kept kernel."""
    from kascade.ops.triton.decode import sparse_decode

    g = torch.Generator().manual_seed(0)
    B, HQ, H, N, D = 2, 8, 2, 700, 64
    buf = dev(torch.randn(B * HQ * D + 1, generator=g).to(torch.bfloat16))
    k, v = (dev(torch.randn(B, H, N, D, generator=g).to(torch.bfloat16)) for _ in range(2))
    idx = dev(torch.sort(torch.randperm(N, generator=g)[:96]).values.int().expand(B, H, 1, 96).contiguous())
    aligned, shifted = buf[:-1].view(B, HQ, 1, D), buf[1:].view(B, HQ, 1, D)
    monkeypatch.setattr(L, "FAST", False)
    want = [sparse_decode(q, k, v, idx, scale=0.125) for q in (aligned, shifted)]
    monkeypatch.setattr(L, "FAST", True)
    for _ in range(2):
        for q, w in zip((aligned, shifted), want):
            assert torch.equal(sparse_decode(q, k, v, idx, scale=0.125), w)


def test_config_is_one_dict_per_configuration():
    assert L.config(A=1, num_warps=4) is L.config(A=1, num_warps=4)
    assert L.config(A=1, num_warps=4) is not L.config(A=2, num_warps=4)


def test_a_triton_that_keeps_its_backend_elsewhere_gets_no_fast_path(fake_triton):
    fn, consts = _kernel(), dict(A=3)
    del fn.device_caches
    for _ in range(2):
        L.launch(fn, (1,), ("t", 32), consts)
    assert [c[0] for c in fn.calls] == ["triton", "triton"]
