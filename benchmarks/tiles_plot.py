"""The tiles question's picture: atom-steps/s and peak memory against atoms, log-log, native beside the bridge.

Drawn with matplotlib where it imports, else as a small SVG written by hand (same panels, decade ticks).
"""

from __future__ import annotations

import dataclasses
import math
import pathlib
from collections.abc import Sequence

GIB = 1 << 30


@dataclasses.dataclass(frozen=True)
class Point:
    """One size of the tiles question (NaN where a run was not made: native past its memory)."""

    atoms: int
    tiles: int
    time_s: float  # the bridge's E+F
    predicted: float  # bytes: one tile's intermediates, as the memory model predicts them
    measured: float  # and as measured
    held: float  # bytes JAX holds beside the tiles (the block's tables; 0 where not measured)
    nve_s: float
    native_s: float
    native_peak: float


def series(points: Sequence[Point]) -> list[tuple[int, str, str, list[tuple[float, float]]]]:
    """(panel, label, colour, [(atoms, y)]) of each line: panel 0 atom-steps/s, panel 1 peak GiB; finite y only."""
    lines = [(0, "bridge (tiles)", "#1f77b4", [(p.atoms, p.atoms / p.time_s) for p in points]),
             (0, "native", "#d62728", [(p.atoms, p.atoms / p.native_s) for p in points]),
             (1, "bridge, measured", "#1f77b4", [(p.atoms, (p.measured + p.held) / GIB) for p in points]),
             (1, "bridge, predicted", "#7f7f7f", [(p.atoms, (p.predicted + p.held) / GIB) for p in points]),
             (1, "native", "#d62728", [(p.atoms, p.native_peak / GIB) for p in points])]
    return [(k, lab, c, [(x, y) for x, y in xy if y == y and 0 < y < math.inf]) for k, lab, c, xy in lines]


YLABELS = ("atom-steps / s (E+F)", "peak memory (GiB; bridge: a tile + JAX's tables)")


def write_plot(points: Sequence[Point], path: pathlib.Path, title: str) -> pathlib.Path:
    """Draw `points` to `path` (an .svg); returns the path."""
    try:
        import matplotlib
    except ImportError:
        path.write_text(svg(points, title))
        return path
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    for k, label, colour, xy in series(points):
        if xy:
            axes[k].loglog(*zip(*xy), "o-" if "predicted" not in label else "s--", color=colour, label=label)
    for ax, ylabel in zip(axes, YLABELS):
        ax.set_xlabel("atoms")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def svg(points: Sequence[Point], title: str, width: int = 900, height: int = 380) -> str:
    """The two panels as an SVG document, drawn by hand (no matplotlib): log-log axes with decade ticks."""
    lines = series(points)
    panel_w, top, bottom, left = width // 2, 40, height - 50, 70
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" '
           'font-size="11">', f'<text x="{width // 2}" y="18" text-anchor="middle" font-size="14">{_esc(title)}</text>']
    xs = [x for _, _, _, xy in lines for x, _ in xy]
    for k, ylabel in enumerate(YLABELS):
        ys = [y for kk, _, _, xy in lines if kk == k for _, y in xy]
        x0, x1 = left + k * panel_w, (k + 1) * panel_w - 20
        if not xs or not ys:
            continue
        fx, fy = _scale(xs, x0, x1), _scale(ys, bottom, top)
        out.append(f'<rect x="{x0}" y="{top}" width="{x1 - x0}" height="{bottom - top}" fill="none" stroke="black"/>')
        for d, pos in fx.ticks:
            out.append(f'<line x1="{pos:.1f}" y1="{bottom}" x2="{pos:.1f}" y2="{bottom + 4}" stroke="black"/>'
                       f'<text x="{pos:.1f}" y="{bottom + 16}" text-anchor="middle">1e{d}</text>')
        for d, pos in fy.ticks:
            out.append(f'<line x1="{x0 - 4}" y1="{pos:.1f}" x2="{x0}" y2="{pos:.1f}" stroke="black"/>'
                       f'<text x="{x0 - 6}" y="{pos + 4:.1f}" text-anchor="end">1e{d}</text>')
        out.append(f'<text x="{(x0 + x1) // 2}" y="{height - 12}" text-anchor="middle">atoms</text>'
                   f'<text x="{x0 - 50}" y="{(top + bottom) // 2}" text-anchor="middle" '
                   f'transform="rotate(-90 {x0 - 50} {(top + bottom) // 2})">{ylabel}</text>')
        legend_y = top + 14
        for kk, label, colour, xy in lines:
            if kk != k or not xy:
                continue
            pts = " ".join(f"{fx(x):.1f},{fy(y):.1f}" for x, y in xy)
            out.append(f'<polyline points="{pts}" fill="none" stroke="{colour}" stroke-width="1.5"/>')
            out += [f'<circle cx="{fx(x):.1f}" cy="{fy(y):.1f}" r="3" fill="{colour}"/>' for x, y in xy]
            out.append(f'<text x="{x0 + 8}" y="{legend_y}" fill="{colour}">{_esc(label)}</text>')
            legend_y += 14
    return "\n".join(out + ["</svg>"]) + "\n"


class _scale:
    """A log10 axis from the data's decades to pixels [a, b], with its decade ticks."""

    def __init__(self, values: Sequence[float], a: float, b: float) -> None:
        lo, hi = math.floor(math.log10(min(values))), math.ceil(math.log10(max(values)))
        self.lo, self.hi, self.a, self.b = lo, max(hi, lo + 1), a, b
        self.ticks = [(d, self(10.0 ** d)) for d in range(self.lo, self.hi + 1)]

    def __call__(self, v: float) -> float:
        return self.a + (self.b - self.a) * (math.log10(v) - self.lo) / (self.hi - self.lo)


def _esc(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
