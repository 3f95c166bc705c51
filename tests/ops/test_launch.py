"""kascade.ops.triton.launch: when a launch goes straight to the compiled launcher and when it takes Triton's own
path, with a stand-in kernel that records both (the direct path needs compiled kernels: on a GPU the kernel tests in
GPU mode run through it, and their outputs are checked against the reference)."""

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("triton")
from kascade.ops.triton import launch as L  # noqa: E402


class _Compiled:
    function, packed_metadata = "function", "metadata"

    def __init__(self, log):
        self.log = log

    def run(self, *args):
        self.log.append(("direct", args))


class _Kernel:
    """Parameters X, Y (pointers), n, f (scalars), then the constexprs A and B (B defaults to 7)."""

    __name__ = "stand_in"

    def __init__(self):
        self.log = []
        self.compiled = _Compiled(self.log)
        p = lambda name, c, d=None: SimpleNamespace(name=name, is_constexpr=c, default=d)  # noqa: E731
        self.params = [p("X", False), p("Y", False), p("n", False), p("f", False), p("A", True), p("B", True, 7)]

    def __getitem__(self, grid):
        def run(*args, **consts):
            self.log.append(("triton", grid, args, consts))
            return self.compiled
        return run


@pytest.fixture
def direct(monkeypatch):
    """The direct path on: compiled kernels, no launch hook, a device 0 with stream 5."""
    monkeypatch.setattr(L, "interpreting", lambda: False)
    monkeypatch.setattr(L, "FAST", True)
    drv = SimpleNamespace(get_current_device=lambda: 0, get_current_stream=lambda device: 5)
    monkeypatch.setattr(L, "_driver", SimpleNamespace(active=drv))
    # Triton 3.6's hooks: chains that call nothing until a hook is added
    chains = SimpleNamespace(launch_enter_hook=SimpleNamespace(calls=[]), launch_exit_hook=SimpleNamespace(calls=[]))
    monkeypatch.setattr(L, "_knobs", SimpleNamespace(runtime=chains))
    monkeypatch.setattr(L, "_ENTRIES", {})
    monkeypatch.setattr(L, "_SPECS", {})


def _tensors(dtype=torch.float32):
    return torch.zeros(16, dtype=dtype), torch.zeros(16, dtype=torch.int32)


def test_a_second_launch_alike_goes_to_the_compiled_launcher(direct):
    fn, consts = _Kernel(), L.config(A=3, num_warps=4)
    x, y = _tensors()
    L.launch(fn, (2, 3), (x, y), (10, 0.5), consts)
    assert fn.log[-1] == ("triton", (2, 3), (x, y, 10, 0.5), consts)
    x2, y2 = _tensors()  # other tensors, the same dtypes, aligned
    L.launch(fn, (4,), (x2, y2), (10, 0.5), L.config(A=3, num_warps=4))  # equal constexprs: the same dict
    kind, args = fn.log[-1]
    assert kind == "direct"
    # grid padded to 3-d, the stream, the kernel's handles, no launch metadata or hooks, the pointers as integers,
    # the scalars, then every constexpr in parameter order (B's default)
    assert args == (4, 1, 1, 5, "function", "metadata", None, None, None, x2.data_ptr(), y2.data_ptr(), 10, 0.5, 3, 7)
    assert len(fn.log) == 2


@pytest.mark.parametrize("change", ["scalar", "dtype", "constexprs", "misaligned"])
def test_a_launch_that_may_specialise_otherwise_takes_tritons_path(direct, change):
    fn = _Kernel()
    x, y = _tensors()
    L.launch(fn, (1,), (x, y), (16, 0.5), L.config(A=1))
    scalars, consts = (16, 0.5), L.config(A=1)
    if change == "scalar":
        scalars = (17, 0.5)  # 16 is divisible by 16, 17 is not: Triton specialises them apart
    elif change == "dtype":
        x = torch.zeros(16, dtype=torch.bfloat16)
    elif change == "constexprs":
        consts = {"A": 1}  # equal, but not the configuration's one dict
    else:
        x = torch.zeros(64, dtype=torch.uint8)[1:]  # one byte past an aligned start
        assert x.data_ptr() % 16
    L.launch(fn, (1,), (x, y), scalars, consts)
    assert [e[0] for e in fn.log] == ["triton", "triton"]
    if change == "misaligned":  # kept nowhere: the next such launch asks Triton again
        L.launch(fn, (1,), (x, y), scalars, consts)
        assert [e[0] for e in fn.log] == ["triton"] * 3
    else:  # the new configuration is kept: its next launch is direct
        L.launch(fn, (1,), (x, y), scalars, consts)
        assert fn.log[-1][0] == "direct"


def test_other_scalars_that_specialise_alike_launch_directly_with_their_values(direct):
    """A dynamic cache's steps: the K / V strides change every step, their specialisation does not."""
    fn, consts = _Kernel(), L.config(A=3)
    x, y = _tensors()
    L.launch(fn, (1,), (x, y), (4096 * 128, 0.5), consts)
    L.launch(fn, (1,), (x, y), (4097 * 128, 0.25), consts)  # both divisible by 16, int32
    assert [e[0] for e in fn.log] == ["triton", "direct"]
    assert fn.log[-1][1][-4:] == (4097 * 128, 0.25, 3, 7)  # this launch's values, not the kept one's
    for scalars in ((1, 0.5), (3, 0.5), (1 << 33, 0.5)):  # 1 is compiled in; 3 is not divisible by 16; int64
        L.launch(fn, (1,), (x, y), scalars, consts)
        assert fn.log[-1][0] == "triton", scalars


def test_spec_is_as_fine_as_tritons_own_specialisation():
    """Two scalars with one ``spec`` must compile alike: Triton's specialisation of each (its C++ rule, asked
    directly) is then the same."""
    native = pytest.importorskip("triton._C.libtriton").native_specialize_impl
    from triton.backends.compiler import BaseBackend

    values = [0, 1, 2, 3, 15, 16, 17, 32, 48, 4096 * 128, -1, -16, -17, (1 << 31) - 16, (1 << 31) - 1, 1 << 31,
              (1 << 31) + 16, (1 << 31) + 1, -(1 << 31), -(1 << 31) - 16, (1 << 63) - 16, 1 << 63, (1 << 63) + 1,
              (1 << 64) - 16, 0.0, 1.0, 0.5,
              -2.5, True, False]
    by_spec: dict = {}
    for x in values:
        by_spec.setdefault(L.spec(x), set()).add(native(BaseBackend, x, False, True, True))
    assert all(len(s) == 1 for s in by_spec.values()), by_spec
    assert len(by_spec) >= 8  # not vacuous: the values fall into many classes


def test_unset_hooks_of_an_earlier_triton_are_none(direct, monkeypatch):
    monkeypatch.setattr(L, "_knobs", SimpleNamespace(runtime=SimpleNamespace(launch_enter_hook=None,
                                                                             launch_exit_hook=None)))
    fn, consts = _Kernel(), L.config(A=2)
    x, y = _tensors()
    for _ in range(2):
        L.launch(fn, (1,), (x, y), (4, 1.0), consts)
    assert [e[0] for e in fn.log] == ["triton", "direct"]


@pytest.mark.parametrize("off", ["env", "enter hook", "exit hook", "hook of an earlier triton", "interpreter"])
def test_no_direct_launch_when_off_profiled_or_interpreted(direct, monkeypatch, off):
    if off == "env":
        monkeypatch.setattr(L, "FAST", False)
    elif off.endswith("hook"):  # a profiler's launch hook sees every launch through Triton's path
        hooked = SimpleNamespace(calls=[print])
        runtime = L._knobs.runtime
        monkeypatch.setattr(runtime, "launch_exit_hook" if off == "exit hook" else "launch_enter_hook", hooked)
    elif off == "hook of an earlier triton":  # a plain callable
        monkeypatch.setattr(L._knobs.runtime, "launch_enter_hook", print)
    else:
        monkeypatch.setattr(L, "interpreting", lambda: True)
    fn, consts = _Kernel(), L.config(A=2)
    x, y = _tensors()
    for _ in range(3):
        L.launch(fn, (1,), (x, y), (4, 1.0), consts)
    assert [e[0] for e in fn.log] == ["triton"] * 3


def test_the_runtime_arguments_must_come_before_the_constexprs(direct):
    fn = _Kernel()
    x, y = _tensors()
    with pytest.raises(TypeError, match="runtime arguments first"):
        L.launch(fn, (1,), (x, y), (4,), L.config(A=2))  # f missing: A would sit among the runtime arguments


def test_a_launch_that_returns_no_compiled_kernel_is_not_kept(direct):
    """A stand-in kernel (the host-overhead benchmark's stubs) returns None: nothing to call directly next time."""
    fn, consts = _Kernel(), L.config(A=2)
    fn.compiled = None
    x, y = _tensors()
    for _ in range(2):
        L.launch(fn, (1,), (x, y), (4, 1.0), consts)
    assert [e[0] for e in fn.log] == ["triton", "triton"] and not L._ENTRIES

