"""Charts are drawn with matplotlib, which the demo and benchmarks need but a production router,
agent or engine does not: it comes with the ``demo`` extra (``pip install 'kvroute[demo]'``).
Without it a command that would draw a chart says so in one line and does everything else."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path
from typing import Any

MISSING = "no chart: matplotlib is not installed (pip install 'kvroute[demo]')"


def available() -> bool:
    """Whether matplotlib can be imported."""
    try:
        return importlib.util.find_spec("matplotlib") is not None
    except ValueError:  # a module without a spec (replaced at run time)
        return False


def pyplot() -> Any:
    """matplotlib's pyplot, drawing to files only (the Agg backend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def written(draw: Callable[[], object], path: Path) -> str:
    """``draw()`` when matplotlib is there; the line to print about the chart at ``path``."""
    if not available():
        return MISSING
    draw()
    return f"chart written to {path.resolve()}"
