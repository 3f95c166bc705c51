"""Kernel launches with less of Triton's per-call host work, for the eager decode step (batch 1 waits for the host).

``kernel[grid](*args, **constexprs)`` binds every argument by name, specialises each one (a tensor's dtype and
16-byte alignment, an integer's value class), builds and hashes a cache key of all of them and the options, checks the
kernel's globals, asks for launch metadata, and its compiled launcher then asks the driver about every pointer. On an
H100 host that is 27.5 us for the decode split kernel (53 parameters), of which the launcher's own work is 7.4 us
and the binding and key 14.4 us, of a reuse layer's whole eager call of 65.6 us (``python -m
benchmarks.launch_profile``, 2026-12-07).

:func:`launch` keeps, per launch configuration, the compiled kernel that Triton's own first launch returned, and calls
its launcher directly while the arguments are those that specialise the same way: the same pointer dtypes, every
pointer 16-byte aligned, and scalars of the same specialisation (:func:`spec`: an integer's is whether it is 1,
whether 16 divides it and its width; floats are not specialised). A launch with exactly a kept launch's scalars finds
its entry at once; other values of the same specialisation (a dynamic cache's strides, which change every step) find
it through their specialisation. Pointers go to the launcher as integers (no driver query a pointer: the ops check
their tensors' device before any launch). Anything else -- a first call, a misaligned pointer, a scalar that
specialises otherwise, Triton's interpreter, a launch hook (a profiler) -- takes Triton's own path, which then keeps
the new entry.

A configuration is the caller's one dict of constexprs and launch options (:func:`config` memoises them): entries are
found by its identity and hold it, so a dict dropped and rebuilt is a new entry, never a stale one.

``KASCADE_TRITON_LAUNCH=triton`` (or ``launch.FAST = False``) sends every launch through Triton's own path.
"""

from __future__ import annotations

import functools
import os

from .common import interpreting

FAST = os.environ.get("KASCADE_TRITON_LAUNCH", "fast") != "triton"
_ENTRIES: dict = {}  # by the scalars' values
_SPECS: dict = {}  # by the scalars' specialisations
_MAX_ENTRIES = 4096  # a dynamic cache's steps each bring new scalars (strides): emptied when it grows

try:  # what the direct path needs of Triton (3.x); without it every launch is Triton's own
    from triton import knobs as _knobs
    from triton.runtime.driver import driver as _driver
except ImportError:  # pragma: no cover - depends on the installed Triton
    _knobs = None


@functools.lru_cache(maxsize=1024)
def _config(items: tuple) -> dict:
    return dict(items)


def config(**consts) -> dict:
    """The one dict of these constexprs and launch options (memoised): a configuration for :func:`launch`."""
    return _config(tuple(consts.items()))


def spec(x) -> object:
    """What Triton's compilation sees of a scalar argument, or finer: two scalars with one ``spec`` run one compiled
    kernel. An integer: whether it is 1 (compiled in as a constant), whether 16 divides it, and its width (int32,
    int64, uint64); a float or a bool: its type (not specialised). Tested against Triton's own rule."""
    if type(x) is int:
        return (x == 1, x % 16 == 0, -(1 << 31) <= x < (1 << 31), x < (1 << 63))
    return type(x)


def _tail(fn, n_args: int, consts: dict) -> tuple:
    """The constexpr values after the ``n_args`` runtime arguments, in the kernel's parameter order (the compiled
    launcher takes every parameter and skips the constexprs)."""
    params = fn.params
    if any(p.is_constexpr for p in params[:n_args]) or not all(p.is_constexpr for p in params[n_args:]):
        raise TypeError(f"{fn.__name__}: launch() needs the runtime arguments first, then the constexprs")
    return tuple(consts[p.name] if p.name in consts else p.default for p in params[n_args:])


def _unhooked(hook) -> bool:
    """Whether a launch hook of Triton's knobs has nothing to call: None (earlier releases) or an empty
    ``HookChain`` (3.6: the knob is always a chain, its ``calls`` the hooks added, e.g. by a profiler)."""
    return hook is None or getattr(hook, "calls", None) == []


def _direct() -> bool:
    if not FAST or _knobs is None or interpreting():
        return False
    rt = _knobs.runtime
    return _unhooked(rt.launch_enter_hook) and _unhooked(rt.launch_exit_hook)


def launch(fn, grid: tuple, tensors: tuple, scalars: tuple, consts: dict) -> None:
    """``fn[grid](*tensors, *scalars, **consts)``: the kernel's pointer parameters first (``tensors``, on the current
    CUDA device), then its scalar ones, then its constexprs and launch options (``consts``, the caller's one dict of
    this configuration: :func:`config`). ``scalars``: ints and floats of a fixed type per position (they are compared
    by value, then by :func:`spec`; ``True == 1``: a flag goes in ``consts``)."""
    if not _direct():
        fn[grid](*tensors, *scalars, **consts)
        return
    ptrs = [t.data_ptr() for t in tensors]
    aligned = not any(p & 15 for p in ptrs)
    if aligned:
        device = _driver.active.get_current_device()
        key = (fn, id(consts), device, tuple([t.dtype for t in tensors]), scalars)
        entry = _ENTRIES.get(key)  # it holds ``consts``: no other dict takes that id while it is kept
        if entry is None:
            skey = key[:4] + (tuple(map(spec, scalars)),)
            entry = _SPECS.get(skey)
            if entry is not None:
                _keep(_ENTRIES, key, entry)
        if entry is not None:
            kernel, tail = entry[1], entry[2]
            g = grid + (1,) * (3 - len(grid))
            kernel.run(g[0], g[1], g[2], _driver.active.get_current_stream(device), kernel.function,
                       kernel.packed_metadata, None, None, None, *ptrs, *scalars, *tail)
            return
    kernel = fn[grid](*tensors, *scalars, **consts)
    if not aligned or kernel is None:  # None: no compiled kernel to keep (a stand-in's launch)
        return
    if hasattr(kernel, "result"):
        kernel = kernel.result()
    entry = (consts, kernel, _tail(fn, len(tensors) + len(scalars), consts))
    _keep(_ENTRIES, key, entry)
    _keep(_SPECS, skey, entry)  # made above: a kept entry would have been found by it


def _keep(entries: dict, key: tuple, entry: tuple) -> None:
    if len(entries) >= _MAX_ENTRIES:
        entries.clear()
    entries[key] = entry
