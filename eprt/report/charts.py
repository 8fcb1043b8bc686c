"""The quality page's charts, drawn by matplotlib (an optional extra: `pip install "eprt[report]"`).

Each chart is an SVG document, embedded in the page as a data URI: the page stays one file, and
one chart's ids cannot collide with another's. The SVG carries no date and a fixed hash salt,
so the same report draws the same bytes.
"""

from __future__ import annotations

import base64
import io
import re

# an expert marked on the heatmap: (marker, colour, what it means)
UNREACHED = ("x", "#d62728", "no calibration token")
MAX_ROUNDING = ("o", "#1f77b4", "GPTQ kept max rounding")
# beyond so many marked experts, each is a coloured cell rather than a marker: an SVG marker is a
# path of its own (65536 of them made a 16 MB page), a cell is a pixel of the embedded image
MAX_MARKERS = 4096
MAX_LABELS = 64


def available() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def _svg_uri(fig) -> str:
    import matplotlib

    buf = io.BytesIO()
    with matplotlib.rc_context({"svg.hashsalt": "eprt"}):
        fig.savefig(buf, format="svg", metadata={"Date": None}, bbox_inches="tight")
    return "data:image/svg+xml;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def layer_errors(series: dict[str, list[tuple[int, float]]]) -> str:
    """Per-layer relative error, one line per report (label -> [(layer, error)])."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(8, 3.2))
    ax = fig.add_subplot()
    for label, points in series.items():
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=label)
    ax.set_xlabel("layer")
    ax.set_ylabel("relative error of the layer's output")
    ax.set_yscale("log" if all(p[1] > 0 for pts in series.values() for p in pts) else "linear")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(True, alpha=0.3)
    if len(series) > 1:
        ax.legend()
    return _svg_uri(fig)


def expert_tokens(experts: list[dict]) -> str:
    """Layers x experts heatmap of the calibration tokens the router sent each expert, the experts
    that got none marked with a cross, and those GPTQ left at max rounding with a circle."""
    import numpy as np
    from matplotlib.colors import LogNorm, to_rgba
    from matplotlib.figure import Figure

    tokens = np.array([e["tokens"] for e in experts], dtype=float)
    rows, cols = tokens.shape
    fig = Figure(figsize=(min(2 + cols * 0.25, 16), min(1.5 + rows * 0.35, 12)))
    ax = fig.add_subplot()
    reached = tokens[tokens > 0]
    low = reached.min() if reached.size else 1.0
    image = ax.imshow(
        np.where(tokens > 0, tokens, np.nan),
        aspect="auto",
        cmap="viridis",
        norm=LogNorm(vmin=low, vmax=max(tokens.max(), low * 10)),
    )
    fig.colorbar(image, ax=ax, label="calibration tokens")
    for (marker, colour, meaning), key in ((UNREACHED, "unreached"), (MAX_ROUNDING, "gptq_max_rounding")):
        points = [(x, y) for y, e in enumerate(experts) for x in e[key]]
        if len(points) > MAX_MARKERS:  # one cell each, drawn into the image: the SVG stays its size
            cells = np.zeros((rows, cols, 4))
            cells[tuple(zip(*((y, x) for x, y in points)))] = to_rgba(colour)
            ax.imshow(cells, aspect="auto", interpolation="nearest")
            ax.scatter([], [], marker="s", color=colour, label=meaning)
        elif points:
            # a cross is all edge; a circle is hollow, so the cell's colour shows through
            ax.scatter(
                [p[0] for p in points],
                [p[1] for p in points],
                marker=marker,
                s=30,
                label=meaning,
                **({"color": colour} if marker == "x" else {"facecolors": "none", "edgecolors": colour}),
            )
    every = -(-rows // MAX_LABELS)  # a label per row up to MAX_LABELS rows (each is many SVG paths)
    ax.set_yticks(range(0, rows, every), [short_module(e["module"]) for e in experts[::every]])
    ax.set_xlabel("expert")
    if any(e["unreached"] or e["gptq_max_rounding"] for e in experts):
        ax.legend(loc="lower left", bbox_to_anchor=(0, 1.0), ncol=2, frameon=False)
    return _svg_uri(fig)


def expert_errors(rows: list[tuple[str, list[float | None]]]) -> str:
    """Layers x experts heatmap of each routed expert's relative error (module -> errors, None:
    no held-out token reached it, left blank), beside the token map."""
    import numpy as np
    from matplotlib.figure import Figure

    errors = np.array([[np.nan if e is None else e for e in errs] for _, errs in rows], dtype=float)
    count, cols = errors.shape
    fig = Figure(figsize=(min(2 + cols * 0.25, 16), min(1.5 + count * 0.35, 12)))
    ax = fig.add_subplot()
    image = ax.imshow(errors, aspect="auto", cmap="magma", interpolation="nearest")
    fig.colorbar(image, ax=ax, label="relative error")
    every = -(-count // MAX_LABELS)
    ax.set_yticks(range(0, count, every), [short_module(m) for m, _ in rows[::every]])
    ax.set_xlabel("expert")
    return _svg_uri(fig)


def short_module(name: str) -> str:
    """`model.layers.3.mlp.experts` -> `layer 3`."""
    m = re.search(r"layers\.(\d+)\.", name)
    return f"layer {m.group(1)}" if m else name
