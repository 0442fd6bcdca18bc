"""Charts saved as PNG files small enough to commit beside the results they plot.

A chart of lines and markers has few colours of its own; the anti-aliased edges add thousands of
near ones. Quantised to a palette of COLOURS (median cut, no dithering) it looks the same in far
fewer bytes, which matters where dozens of charts travel with the source tree.
"""

from __future__ import annotations

import io
import os
from pathlib import Path

from mira.store.files import temporary_beside

COLOURS = 128


def save_png(figure, path: str | Path, dpi: float | None = None) -> None:
    """Write a matplotlib figure to `path` as a palette PNG of at most COLOURS colours, whole or not
    at all (a temporary file renamed into place)."""
    from PIL import Image  # a dependency of matplotlib, which made the figure

    rendered = io.BytesIO()
    figure.savefig(rendered, format="png", dpi=dpi)
    rendered.seek(0)
    image = Image.open(rendered).convert("RGB").quantize(COLOURS, method=Image.Quantize.MEDIANCUT,
                                                         dither=Image.Dither.NONE)
    path = Path(path)
    fd, tmp = temporary_beside(path)
    try:
        with os.fdopen(fd, "wb") as file:
            image.save(file, format="PNG", optimize=True)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
