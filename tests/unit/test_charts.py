"""mira.charts: a saved chart is a small palette PNG that looks as matplotlib drew it."""

import io

import matplotlib
import numpy as np
from PIL import Image

from mira.charts import COLOURS, save_png

matplotlib.use("Agg")
from matplotlib import pyplot  # noqa: E402


def line_chart():
    """A chart like mira bench's: log-scaled lines with markers, error bars, a legend and a grid."""
    figure, axis = pyplot.subplots(figsize=(6, 4))
    x = np.arange(6)
    for i, style in enumerate(["-", "--", ":"]):
        y = 10.0 ** (x / 3 + i / 2)
        axis.errorbar(x, y, yerr=y / 10, linestyle=style, marker="o", capsize=3, label=f"config {i}")
    axis.set_yscale("log")
    axis.grid(alpha=0.3)
    axis.legend()
    axis.set_title("decode tokens/s by budget")
    return figure


def rgb(data) -> np.ndarray:
    return np.asarray(Image.open(data).convert("RGB"), dtype=np.int16)


def test_saved_chart_is_a_palette_png_that_matches_the_full_colour_render(tmp_path):
    figure = line_chart()
    full = io.BytesIO()
    figure.savefig(full, format="png", dpi=100)  # the reference: matplotlib's own full-colour PNG
    path = tmp_path / "chart.png"
    save_png(figure, path, dpi=100)
    pyplot.close(figure)

    saved = Image.open(path)
    assert saved.mode == "P" and len(saved.getcolors(maxcolors=256)) <= COLOURS
    full.seek(0)
    reference, ours = rgb(full), rgb(path)
    assert ours.shape == reference.shape
    difference = np.abs(ours - reference).max(axis=-1)  # per pixel, the worst channel, in levels of 255
    assert difference.mean() < 1.0 and np.quantile(difference, 0.999) <= 24
    assert path.stat().st_size < 0.6 * full.getbuffer().nbytes
    assert [p.name for p in tmp_path.iterdir()] == ["chart.png"]  # no temporary file left behind
