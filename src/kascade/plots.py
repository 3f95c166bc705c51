"""Matplotlib for the pictures the commands write (calibration heatmaps, evaluation and benchmark charts)."""

from __future__ import annotations


def pyplot():
    """``matplotlib.pyplot`` on the non-interactive Agg backend; ImportError saying how to install it."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ImportError("plots need matplotlib: pip install 'kascade[plots]'") from None
    return plt
