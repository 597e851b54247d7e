"""A line chart drawn with text, for the terminal: the demo's loss curve.

`line_chart(values)` returns rows of characters: a y axis with its range, the series drawn with
braille dots (2 x 4 dots per character cell, so a 60-column chart shows 120 points), and an x
axis. No plotting library: rich prints it as it is.
"""

from __future__ import annotations

from typing import Sequence

# Braille dot bits by (column, row) inside a cell: columns 0-1, rows 0-3 from the top.
_DOTS = ((0x01, 0x02, 0x04, 0x40), (0x08, 0x10, 0x20, 0x80))


def line_chart(values: Sequence[float], *, width: int = 60, height: int = 10,
               label: str = "") -> str:
    """The series as a braille line chart of `width` x `height` cells (plus its axes)."""
    if not values:
        return "(no values)"
    low, high = min(values), max(values)
    span = high - low or 1.0
    dots_x, dots_y = width * 2, height * 4
    cells = [[0] * width for _ in range(height)]

    def dot(x: int, y: int) -> None:  # y counted from the bottom
        row = height - 1 - y // 4
        cells[row][x // 2] |= _DOTS[x % 2][3 - y % 4]

    previous: tuple[int, int] | None = None
    count = len(values)
    for index, value in enumerate(values):
        x = round(index * (dots_x - 1) / max(1, count - 1))
        y = round((value - low) / span * (dots_y - 1))
        if previous is not None:  # join the points, so the curve reads as a line
            (x0, y0), steps = previous, max(abs(x - previous[0]), abs(y - previous[1]), 1)
            for step in range(1, steps):
                dot(x0 + (x - x0) * step // steps, y0 + (y - y0) * step // steps)
        dot(x, y)
        previous = (x, y)
    top, bottom = f"{high:.3g}", f"{low:.3g}"
    margin = max(len(top), len(bottom))
    rows = []
    for number, row in enumerate(cells):
        axis = top if number == 0 else bottom if number == height - 1 else ""
        rows.append(f"{axis:>{margin}} ┤" + "".join(chr(0x2800 + bits) for bits in row))
    rows.append(" " * margin + " └" + "─" * width)
    first, last = "1", str(count)
    rows.append(" " * (margin + 2) + first + " " * max(1, width - len(first) - len(last)) + last
                + (f"  {label}" if label else ""))
    return "\n".join(rows)
