"""Grouped bar charts and line charts as small standalone SVG files (no plotting library
needed)."""

from __future__ import annotations

from collections.abc import Sequence
from html import escape

_COLOURS = ("#2b6cb0", "#dd6b20", "#38a169", "#805ad5", "#718096")


def bar_chart(
    title: str,
    groups: Sequence[str],
    series: Sequence[tuple[str, Sequence[float]]],
    *,
    unit: str = "",
    width: int = 720,
    height: int = 360,
) -> str:
    """Bars of each series side by side for every group, with values written on the bars."""
    left, top, plot_w, plot_h = _plot_area(width, height)
    peak = max((v for _, values in series for v in values), default=1.0) or 1.0
    group_w = plot_w / max(len(groups), 1)
    bar_w = group_w * 0.8 / max(len(series), 1)
    out = [
        *_frame(title, width, height),
        f'<line x1="{left}" y1="{top + plot_h}" x2="{left + plot_w}" y2="{top + plot_h}" '
        'stroke="#333"/>',
    ]
    for tick in range(5):
        value = peak * tick / 4
        y = top + plot_h - plot_h * tick / 4
        out.append(
            f'<line x1="{left}" y1="{y:.1f}" x2="{left + plot_w}" y2="{y:.1f}" stroke="#eee"/>'
        )
        out.append(f'<text x="{left - 6}" y="{y + 4:.1f}" text-anchor="end">{_short(value)}</text>')
    for g, group in enumerate(groups):
        x0 = left + g * group_w + group_w * 0.1
        for s, (_, values) in enumerate(series):
            value = values[g] if g < len(values) else 0.0
            h = plot_h * value / peak
            x = x0 + s * bar_w
            y = top + plot_h - h
            colour = _COLOURS[s % len(_COLOURS)]
            out.append(
                f'<rect x="{x:.1f}" y="{y:.1f}" width="{bar_w * 0.92:.1f}" height="{h:.1f}" '
                f'fill="{colour}"/>'
            )
            out.append(
                f'<text x="{x + bar_w * 0.46:.1f}" y="{y - 4:.1f}" text-anchor="middle" '
                f'font-size="10">{_short(value)}</text>'
            )
        out.append(
            f'<text x="{x0 + group_w * 0.4:.1f}" y="{top + plot_h + 18}" '
            f'text-anchor="middle">{escape(group)}</text>'
        )
    out += _legend([name for name, _ in series], left, height - 18)
    out += _unit(unit, top + plot_h / 2)
    out.append("</svg>")
    return "\n".join(out) + "\n"


def line_chart(
    title: str,
    xs: Sequence[float],
    series: Sequence[tuple[str, Sequence[float]]],
    *,
    unit: str = "",
    x_unit: str = "",
    width: int = 720,
    height: int = 300,
) -> str:
    """Each series as a line over ``xs`` (same length), from zero up to the highest value."""
    left, top, plot_w, plot_h = _plot_area(width, height)
    peak = max((v for _, values in series for v in values), default=1.0) or 1.0
    x_max = max(xs, default=1.0) or 1.0
    out = _frame(title, width, height)
    for tick in range(5):
        y = top + plot_h - plot_h * tick / 4
        out.append(
            f'<line x1="{left}" y1="{y:.1f}" x2="{left + plot_w}" y2="{y:.1f}" stroke="#eee"/>'
        )
        label = _short(peak * tick / 4)
        out.append(f'<text x="{left - 6}" y="{y + 4:.1f}" text-anchor="end">{label}</text>')
        x = left + plot_w * tick / 4
        out.append(
            f'<text x="{x:.1f}" y="{top + plot_h + 16}" text-anchor="middle">'
            f"{_short(x_max * tick / 4)}</text>"
        )
    for s, (_, values) in enumerate(series):
        points = " ".join(
            f"{left + plot_w * x / x_max:.1f},{top + plot_h - plot_h * v / peak:.1f}"
            for x, v in zip(xs, values, strict=True)
        )
        colour = _COLOURS[s % len(_COLOURS)]
        out.append(f'<polyline points="{points}" fill="none" stroke="{colour}" stroke-width="2"/>')
    out += _legend([name for name, _ in series], left, height - 12)
    if x_unit:
        out.append(
            f'<text x="{left + plot_w}" y="{top + plot_h + 32}" text-anchor="end">'
            f"{escape(x_unit)}</text>"
        )
    out += _unit(unit, top + plot_h / 2)
    out.append("</svg>")
    return "\n".join(out) + "\n"


def _plot_area(width: int, height: int) -> tuple[int, int, int, int]:
    """Where the plot goes inside the margins (axis labels left, title above, legend below):
    left, top, width, height."""
    left, right, top, bottom = 70, 20, 50, 60
    return left, top, width - left - right, height - top - bottom


def _frame(title: str, width: int, height: int) -> list[str]:
    """The opening of an SVG image: a white background and the title."""
    return [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="12">',
        f'<rect width="{width}" height="{height}" fill="white"/>',
        f'<text x="{width / 2}" y="22" text-anchor="middle" font-size="15">{escape(title)}</text>',
    ]


def _legend(names: Sequence[str], left: int, y: float) -> list[str]:
    out, x = [], left
    for s, name in enumerate(names):
        colour = _COLOURS[s % len(_COLOURS)]
        out.append(f'<rect x="{x}" y="{y - 10}" width="12" height="12" fill="{colour}"/>')
        out.append(f'<text x="{x + 16}" y="{y}">{escape(name)}</text>')
        x += 24 + 7 * len(name)
    return out


def _unit(unit: str, middle: float) -> list[str]:
    """The y axis' unit, written upwards beside it."""
    if not unit:
        return []
    return [
        f'<text x="14" y="{middle}" transform="rotate(-90 14 {middle})" '
        f'text-anchor="middle">{escape(unit)}</text>'
    ]


def _short(value: float) -> str:
    if value >= 1_000_000:
        return f"{value / 1_000_000:.1f}M"
    if value >= 10_000:
        return f"{value / 1000:.0f}k"
    if value >= 1000:
        return f"{value / 1000:.1f}k"
    if value >= 10:
        return f"{value:.0f}"
    return f"{value:.2g}"
