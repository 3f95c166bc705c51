"""Renamed arguments and attributes: a caller that uses the former name gets a :class:`RenamedError` naming the
current one, instead of Python's bare "unexpected keyword" (or a silent fallback that would keep one word meaning
two things).

The per-layer budget multiplier is ``factor`` (a ranked selection's: ``rank_factor``); ``scale`` is the softmax
scale alone.
"""

from __future__ import annotations

import functools

FACTOR = "the per-layer budget multiplier; 'scale' is the softmax scale"
RANK_FACTOR = "the multiple of each row's budget a ranked selection keeps"


class RenamedError(TypeError, AttributeError):
    """A renamed argument or attribute was used by its former name. A TypeError (the call or access names something
    the API does not take); also an AttributeError, so that ``hasattr`` and ``getattr(x, name, default)`` see a
    former attribute as absent."""


def _message(where: str, verb: str, old: str, new: str, why: str) -> str:
    return f"{where} {verb} '{new}', not '{old}' ({why})"


def keywords(why: str, **renames: str):
    """Decorator: calling the function with a keyword of ``renames`` (``former="current"``) raises RenamedError."""

    def wrap(fn):
        where = f"{fn.__qualname__.removesuffix('.__init__')}()"

        @functools.wraps(fn)
        def call(*args, **kwargs):
            if kwargs:
                for old in renames.keys() & kwargs.keys():
                    raise RenamedError(_message(where, "takes", old, renames[old], why))
            return fn(*args, **kwargs)

        return call

    return wrap


class attribute:
    """A class attribute under a former name: reading it raises RenamedError naming ``new``."""

    def __init__(self, new: str, why: str):
        self.new, self.why = new, why

    def __set_name__(self, owner, name):
        self.where, self.old = owner.__name__, name

    def __get__(self, obj, owner=None):
        raise RenamedError(_message(self.where, "has", self.old, self.new, self.why))


def module_getattr(module: str, why: str, **renames: str):
    """A module's ``__getattr__`` that raises a TypeError for the former names in ``renames`` (AttributeError for any
    other missing name). Not a RenamedError: ``from module import name`` turns an AttributeError into an ImportError
    that drops the message."""

    def __getattr__(name):
        if name in renames:
            raise TypeError(_message(module, "has", name, renames[name], why))
        raise AttributeError(f"module {module!r} has no attribute {name!r}")

    return __getattr__
