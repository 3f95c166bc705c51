"""Kernel launches without most of Triton's per-call host work (eager decoding waits for the host, not the GPU).

``kernel[grid](*args, **constexprs)`` binds every argument by name, specialises each one, builds and hashes a cache
key of all of them and their options, checks the kernel's globals and asks for launch metadata before the compiled
launcher runs. A decode step launches the same few configurations in every layer, so :func:`launch` keeps, per
configuration, the compiled kernel that Triton's own first launch returned and calls its launcher directly next time,
after the one check that can change the compiled code between calls of one configuration: each runtime argument's
specialisation (Triton's own function, on the arguments alone: a tensor's dtype and 16-byte alignment, an integer's
width, divisibility by 16 and being 1). Any difference, a first call, Triton's interpreter or a launch hook (a
profiler) takes Triton's own path. Off unless ``KASCADE_FAST_LAUNCH=1``: not yet measured on a GPU (:data:`FAST`).

The constexprs and launch options come as a dict that names the configuration by its identity: the caller keeps
one dict per configuration (a memoised launch plan's, or :func:`config`'s). Entries are found by that identity and
hold the dict, so a configuration that is dropped and rebuilt is a new entry, never a stale one.
"""

from __future__ import annotations

import functools
import os

from .common import interpreting

# On only with KASCADE_FAST_LAUNCH=1 until it is measured on a GPU (a Python key over a launch's ~40 arguments may
# cost what Triton's own binding does: an earlier direct launcher with a key of its own gained nothing on an H100
# host). Benchmarks set it to compare.
FAST = os.environ.get("KASCADE_FAST_LAUNCH", "0") == "1"
# KASCADE_CHECK_LAUNCH=1: every direct launch first asks Triton which compiled kernel its own launch would run and
# raises if that is not the kept one (the GPU tests' check of the key; costs what the fast path saves)
CHECK = os.environ.get("KASCADE_CHECK_LAUNCH", "0") == "1"
_FAST: dict = {}
_MAX_ENTRIES = 4096

try:  # Triton's own specialisation of one argument, and its driver (absent under some Triton versions: no fast path)
    from triton import knobs as _knobs
    from triton._C.libtriton import native_specialize_impl as _specialize
    from triton.runtime.driver import driver as _driver
except ImportError:  # pragma: no cover - depends on the installed Triton
    _specialize = None


@functools.lru_cache(maxsize=1024)
def _config(items: tuple) -> dict:
    return dict(items)


def config(**consts) -> dict:
    """The one dict of these constexprs and launch options (memoised): a configuration for :func:`launch`."""
    return _config(tuple(consts.items()))


def _signature(backend, args) -> tuple:
    return tuple([_specialize(backend, a, False, True, True) for a in args])


def _backend(fn, device):
    """The backend Triton's own launch of ``fn`` specialises with on ``device`` (``JITFunction.device_caches``, Triton
    3.6), or None where that Triton keeps it elsewhere (then no fast path)."""
    try:
        return fn.device_caches[device][3]
    except (AttributeError, IndexError, KeyError, TypeError):
        return None


def _tail(fn, n_args: int, consts: dict) -> tuple:
    """The constexpr values after the ``n_args`` runtime arguments, in the kernel's parameter order (its launcher
    takes every parameter and skips the constexprs)."""
    params = fn.params
    if any(p.is_constexpr for p in params[:n_args]) or not all(p.is_constexpr for p in params[n_args:]):
        raise TypeError(f"{fn.__name__}: the fast launch needs the runtime arguments first, then the constexprs")
    return tuple(consts[p.name] if p.name in consts else p.default for p in params[n_args:])


def _check(fn, device, args, consts, kernel) -> None:
    """Raise unless Triton's own launch of these arguments would run ``kernel`` (Triton 3.6's launch path)."""
    from triton.runtime.jit import compute_cache_key

    kernel_cache, key_cache, _, _, binder = fn.device_caches[device]
    _, specialization, options = binder(*args, **consts)
    theirs = kernel_cache.get(compute_cache_key(key_cache, specialization, options))
    if hasattr(theirs, "result"):
        theirs = theirs.result()
    if theirs is not kernel:
        raise AssertionError(f"{fn.__name__}: the fast launch kept another compiled kernel than Triton would run")


def enabled() -> bool:
    """Whether :func:`launch` can bypass Triton's launch path at all (compiled kernels, a Triton it knows)."""
    return FAST and _specialize is not None and not interpreting()


def launch(fn, grid: tuple, args: tuple, consts: dict) -> None:
    """``fn[grid](*args, **consts)``, through the compiled launcher when this configuration ran before with
    arguments specialised the same way. ``args``: the runtime arguments, positional, in order; ``consts``: the
    constexprs and launch options (num_warps, num_stages), the caller's one dict of this configuration (see the
    module)."""
    if not enabled() or _knobs.runtime.launch_enter_hook is not None:
        fn[grid](*args, **consts)
        return
    device = _driver.active.get_current_device()
    key = (fn, id(consts), device)  # an entry holds its dict, so no other dict has that id while it lives
    entry = _FAST.get(key)
    if entry is not None and _signature(entry[4], args) == entry[1]:
        kernel, tail = entry[2], entry[3]
        if CHECK:
            _check(fn, device, args, consts, kernel)
        g = grid + (1,) * (3 - len(grid))
        kernel.run(g[0], g[1], g[2], _driver.active.get_current_stream(device), kernel.function,
                   kernel.packed_metadata, None, None, None, *args, *tail)
        return
    kernel = fn[grid](*args, **consts)
    if hasattr(kernel, "result"):
        kernel = kernel.result()
    backend = _backend(fn, device)
    if backend is None:
        return
    if len(_FAST) >= _MAX_ENTRIES:
        _FAST.clear()
    _FAST[key] = (consts, _signature(backend, args), kernel, _tail(fn, len(args), consts), backend)
