"""The output folder of a command: checked before any work, held by one run at a time, and not left behind by a run
that made it and then refused (:func:`output_folder`)."""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

LOCK = ".kascade.lock"


def check_out(out: str | Path) -> Path:
    """``out`` as a folder that exists and takes files (created if missing), else ValueError saying why. The
    commands call it before loading a model, so that no run ends, after its work, unable to write the results."""
    out = Path(out).expanduser()
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file, not a folder")
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):
            pass
    except OSError as e:
        raise ValueError(f"--out {out}: cannot write the results there ({e.strerror or e})") from None
    return out


@contextlib.contextmanager
def output_folder(out: str | Path, command: str):
    """:func:`check_out` then :func:`hold`: the commands' output folder for one run. A run that fails before writing
    anything into a folder it made (bad input refused after the folder was checked, a model that does not load)
    removes the folders it made, so that a refusal leaves no trace; a folder that existed before is left as it was.
    A run refused because another run holds the folder removes nothing: two runs starting on the same new path at
    once both made it, as far as each can tell, and the folder is the holder's."""
    out = Path(out).expanduser()
    made = next((p for p in reversed([out, *out.parents]) if not p.exists()), None)  # the topmost folder to make
    try:
        out = check_out(out)  # makes the missing folders, then may still find that they take no files
    except BaseException:
        _remove_made(out, made)
        raise
    with hold(out, command) as held:
        try:
            yield held
        except BaseException:
            _remove_made(out, made)  # while held: no other run is in the folder
            raise


def _remove_made(out: Path, made: Path | None) -> None:
    """Remove ``out`` and its parents up to ``made`` (the topmost folder this run made) if nothing but the lock was
    written there; stop quietly where a folder is not empty (another run's files came in meanwhile)."""
    if made is None or not out.is_dir() or not {p.name for p in out.iterdir()} <= {LOCK}:
        return
    try:
        (out / LOCK).unlink(missing_ok=True)
        for p in [out, *out.parents]:  # up to the first folder this run made
            p.rmdir()
            if p == made:
                break
    except OSError:
        pass


@contextlib.contextmanager
def hold(out: Path, command: str):
    """Hold the folder ``out`` for one run of ``command``: a second run into it, from any process, is refused
    (ValueError) while this one lasts, so two runs never mix their files. The hold is an advisory lock on
    ``out/.kascade.lock``, released by the operating system when the process ends, however it ends."""
    f = open(out / LOCK, "a+")
    try:
        if not _try_lock(f):
            f.seek(0)
            who = f.read().strip() or "another process"
            raise ValueError(f"--out {out} is in use by {who}: wait for it to finish, or give another --out")
        f.seek(0)
        f.truncate()
        f.write(f"{command} (process {os.getpid()})\n")
        f.flush()
        yield out
    finally:
        f.close()  # releases the lock


def _try_lock(f) -> bool:
    try:
        import fcntl
    except ImportError:  # Windows
        import msvcrt

        f.seek(0)
        try:
            msvcrt.locking(f.fileno(), msvcrt.LK_NBLCK, 1)
            return True
        except OSError:
            return False
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError:
        return False
