"""The output folder of a command, checked before any work."""

from __future__ import annotations

import tempfile
from pathlib import Path


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
