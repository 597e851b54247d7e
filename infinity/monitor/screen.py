"""infinity-top's screen: one frame of text lines that fit a terminal of any size.

`frame(snapshot, history, width=, height=, sort=, help=)` is pure (no terminal,
no daemon): every line is built to be shorter than `width` (the last column is
left empty, so a terminal never wraps nor cuts anything), and whole parts are
left out where room runs short, least important first: header fields, tier
details, client columns (the name and the resident bytes stay), then client
rows (the table says how many it left out). A value is never cut: a name too
long for its column is shortened with an ellipsis, which says so. Data is never
markup (a client's name or a path may hold brackets).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from rich.text import Text

from infinity.monitor.collector import BandwidthSample, Snapshot

SPARKS = "▁▂▃▄▅▆▇█"
ELLIPSIS = "…"


# --- values --------------------------------------------------------------------------------

def size(value: Any) -> str:
    """Bytes in binary units, at most 4 significant characters and a unit: "1.2 GiB"."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return "-"
    number = float(value)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(number) < 1024 or unit == "TiB":
            return f"{number:.0f} {unit}" if unit == "B" or abs(number) >= 100 else \
                f"{number:.1f} {unit}"
        number /= 1024
    return "-"  # unreachable


def count(value: Any) -> str:
    """A number with a metric suffix: "3.1k", "12M"."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return "-"
    number = float(value)
    for suffix in ("", "k", "M", "G"):
        if abs(number) < 1000 or suffix == "G":
            if suffix == "" and number == int(number):
                return str(int(number))
            return f"{number:.1f}{suffix}" if abs(number) < 100 else f"{number:.0f}{suffix}"
        number /= 1000
    return "-"  # unreachable


def duration(seconds: Any) -> str:
    if not isinstance(seconds, (int, float)):
        return "-"
    seconds = int(seconds)
    days, rest = divmod(seconds, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    if days:
        return f"{days}d{hours:02d}h"
    if hours:
        return f"{hours}h{minutes:02d}m"
    return f"{minutes}m{secs:02d}s"


def shorten(text: str, width: int) -> str:
    """`text` in at most `width` characters; shortened ones end in an ellipsis, after the last
    whole word where the text has words (a name without spaces is cut where it must be)."""
    if len(text) <= width:
        return text
    if width <= 0:
        return ""
    cut = text[:width - 1]
    space = cut.rfind(" ")
    if space >= width // 2:
        cut = cut[:space].rstrip()
    return cut + ELLIPSIS


def sparkline(values: Sequence[float], width: int) -> str:
    """The last `width` values as bar characters, scaled to their largest."""
    shown = list(values)[-width:] if width > 0 else []
    top = max(shown, default=0.0)
    if top <= 0:
        return SPARKS[0] * len(shown)
    return "".join(SPARKS[min(len(SPARKS) - 1, int(v / top * (len(SPARKS) - 1) + 0.5))]
                   for v in shown)


def _table(value: Any, key: str) -> dict[str, Any]:
    """value[key] when both are maps, else an empty one: a value missing or of another kind
    (an older or newer daemon) shows as "-", never as an error."""
    inner = value.get(key) if isinstance(value, dict) else None
    return inner if isinstance(inner, dict) else {}


def _rows(value: Any, key: str) -> list[dict[str, Any]]:
    inner = value.get(key) if isinstance(value, dict) else None
    return ([row for row in inner if isinstance(row, dict)] if isinstance(inner, (list, tuple))
            else [])


def fit(parts: Sequence[str], width: int, sep: str = "  ") -> str:
    """As many of `parts` as fit in `width`, in order of importance (first first), whole."""
    line = ""
    for part in parts:
        if not part:
            continue
        candidate = part if not line else line + sep + part
        if len(candidate) <= width:
            line = candidate
    return line


# --- the client table ------------------------------------------------------------------------

@dataclass(frozen=True)
class Column:
    header: str
    width: int
    value: Callable[[dict[str, Any]], str]
    sort: Callable[[dict[str, Any]], Any]
    priority: int  # columns of a higher number leave first when the width runs short
    left: bool = False  # text, aligned left (numbers align right)
    flexible: bool = False  # takes the room left, up to FLEX_MAX (one per table)


def _num(key: str) -> Callable[[dict[str, Any]], float]:
    def get(entry: dict[str, Any]) -> float:
        value = entry.get(key)
        return float(value) if isinstance(value, (int, float)) else 0.0
    return get


def _text(key: str) -> Callable[[dict[str, Any]], str]:
    return lambda entry: str(entry.get(key, "-"))


def _hit_rate(client: dict[str, Any]) -> float | None:
    hits = _num("prefetch_hits")(client) + _num("inflight_hits")(client)
    reads = hits + _num("misses")(client)
    return hits / reads if reads else None


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{value * 100:.0f}%"


def _seconds(value: Any) -> str:
    return f"{value:.3f}" if isinstance(value, (int, float)) else "-"


def _namespaces(client: dict[str, Any]) -> str:
    names = client.get("namespaces")
    return ",".join(str(n) for n in names) if isinstance(names, (list, tuple)) and names else "-"


FLEX_MIN = 8  # the flexible column's least width
FLEX_WANT = 16  # ... the width columns of priority MINOR and above leave to give it
FLEX_MAX = 24
MINOR = 5

COLUMNS = (
    Column("NAME", FLEX_MIN, _text("name"), lambda c: str(c.get("name", "")), 0, left=True,
           flexible=True),
    Column("RESIDENT", 9, lambda c: size(c.get("resident_bytes")), _num("resident_bytes"), 0),
    Column("REQ/S", 6, lambda c: count(c.get("requests_per_s")), _num("requests_per_s"), 1),
    Column("STALL S", 8, lambda c: _seconds(c.get("stall_s")), _num("stall_s"), 2),
    Column("PID", 7, _text("pid"), _num("pid"), 3),
    Column("HIT%", 5, lambda c: _percent(_hit_rate(c)), lambda c: _hit_rate(c) or 0.0, 4),
    Column("LEASES", 6, lambda c: count(c.get("leases")), _num("leases"), 5),
    Column("PARAM/S", 7, lambda c: count(c.get("optimizer_parameters_per_s")),
           _num("optimizer_parameters_per_s"), 6),
    # Steps per second: a generating client's tokens per second (a forward per token).
    Column("STEP/S", 6, lambda c: count(c.get("steps_per_s")), _num("steps_per_s"), 6),
    Column("STEPS", 6, lambda c: count(c.get("steps")), _num("steps"), 7),
    Column("NAMESPACES", 10, _namespaces, _namespaces, 8, left=True),
)
# What `s` steps through, in order; the first is the default.
SORTS = ("RESIDENT", "REQ/S", "STALL S", "NAME", "PID")


def _totals(key: str) -> Callable[[dict[str, Any]], Any]:
    return lambda entry: _table(entry, "totals").get(key, "-")


# The scheduler's streams (a client's per namespace it steps in): where each finds its data.
STREAM_COLUMNS = (
    Column("NAMESPACE", FLEX_MIN, _text("namespace"), _text("namespace"), 0, left=True,
           flexible=True),
    Column("CLIENT", FLEX_MIN, _text("client"), _text("client"), 0, left=True, flexible=True),
    Column("STATE", 9, lambda e: str(e.get("state", "-")) if e.get("active") else "gone",
           _text("state"), 1, left=True),
    Column("STEPS", 6, lambda e: count(_totals("steps")(e)), _text("namespace"), 2),
    Column("TRACE", 6, lambda e: count(e.get("trace_entries")), _text("namespace"), 2),
    Column("HITS", 6, lambda e: count(_num("prefetch_hits")(_table(e, "totals"))
                                      + _num("resident_hits")(_table(e, "totals"))),
           _text("namespace"), 3),
    Column("MISSES", 6, lambda e: count(_totals("misses")(e)), _text("namespace"), 3),
    Column("STALL S", 8, lambda e: _seconds(_totals("stall_s")(e)), _text("namespace"), 2),
    Column("IN FLIGHT", 9, lambda e: count(_totals("inflight_hits")(e)), _text("namespace"), 4),
    Column("LOOKAHEAD", 9, lambda e: size(e.get("lookahead_bytes")), _text("namespace"), 5),
)


def _fitted(columns: Sequence[Column], width: int) -> tuple[list[Column], list[int]]:
    """The columns that fit `width`, leaving out the least important first, and their widths:
    the flexible ones share what is left (each within FLEX_MIN .. FLEX_MAX), and a last column
    of text takes the rest."""
    chosen = list(columns)

    def room_left() -> int:
        return width - sum(c.width for c in chosen) - (len(chosen) - 1)

    while len(chosen) > 2 and room_left() < 0:
        chosen.remove(max(chosen, key=lambda c: c.priority))
    # A name needs room to be told apart: minor columns leave for it too.
    while room_left() < FLEX_WANT - FLEX_MIN and max(c.priority for c in chosen) >= MINOR:
        chosen.remove(max(chosen, key=lambda c: c.priority))
    spare = room_left()
    share = spare // max(1, sum(1 for c in chosen if c.flexible))  # the flexible ones split it
    widths = [max(1, min(FLEX_MAX, c.width + share)) if c.flexible else c.width for c in chosen]
    if chosen[-1].left:  # a last column of text (namespaces) takes the rest of the line
        widths[-1] += max(0, width - (sum(widths) + len(widths) - 1))
    if sum(widths) + len(widths) - 1 > width:  # a tiny terminal: halve the two left
        widths = [max(1, (width - 1) // 2)] * len(widths)
    return chosen, widths


def _cell(column: Column, text: str, width: int) -> str:
    text = shorten(text, width)
    return text.ljust(width) if column.left else text.rjust(width)


def table(entries: list[dict[str, Any]], columns: Sequence[Column], *, width: int, rows: int,
          sort: str | None = None, empty: str = "none") -> list[Text]:
    """A header and at most `rows` - 1 entries (a last row counts those left out), sorted by
    the column headed `sort` (numbers largest first), else in the order given."""
    chosen, widths = _fitted(columns, width)
    key = next((c for c in columns if c.header == sort), None)
    ordered = (sorted(entries, key=key.sort, reverse=not key.left and key.header != "PID")
               if key is not None else entries)
    head = Text(" ".join(_cell(c, c.header + ("↓" if c is key else ""), w)
                         for c, w in zip(chosen, widths)).rstrip(), style="bold reverse")
    lines = [head]
    room = rows - 1
    shown = ordered if len(ordered) <= room else ordered[:max(0, room - 1)]
    for entry in shown:
        lines.append(Text(" ".join(_cell(c, c.value(entry), w)
                                   for c, w in zip(chosen, widths)).rstrip()))
    if len(shown) < len(ordered) and room >= 1:
        lines.append(Text(f"... and {len(ordered) - len(shown)} more", style="dim"))
    if not entries and room >= 1:
        lines.append(Text(empty, style="dim"))
    return lines[:rows]


def client_table(clients: list[dict[str, Any]], *, width: int, rows: int, sort: str) -> list[Text]:
    return table(clients, COLUMNS, width=width, rows=rows, sort=sort, empty="no clients attached")


# --- the frame -------------------------------------------------------------------------------

def _bar(fraction: float | None, width: int) -> str:
    if width <= 0:
        return ""
    filled = 0 if fraction is None else max(0, min(width, round(fraction * width)))
    return "█" * filled + "░" * (width - filled)


def _tier_line(label: str, used: Any, capacity: Any, details: list[str], width: int) -> Text:
    fraction = (used / capacity if isinstance(used, (int, float))
                and isinstance(capacity, (int, float)) and capacity > 0 else None)
    figures = f"{_percent(fraction):>4} {size(used)} / {size(capacity)}"
    # A sixth of the width: the details beside it matter more than a longer bar.
    bar_width = max(5, min(40, width // 6, width - len(label) - len(figures) - 6))
    if len(label) + bar_width + len(figures) + 4 > width:
        return Text(fit([label, figures], width, " "))
    head = f"{label} [{_bar(fraction, bar_width)}] {figures}"
    line = fit([head, *details], width)
    style = "red" if fraction is not None and fraction > 0.95 else "green"
    text = Text(line)
    text.stylize(style, len(label) + 1, len(label) + 2 + bar_width + 1)
    return text


def _tier_lines(stats: dict[str, Any], width: int) -> list[Text]:
    tiers = _table(stats, "tiers")
    cpu = _table(tiers, "cpu")
    lines = [_tier_line("cpu ", cpu.get("used_bytes"), cpu.get("budget_bytes"), [
        f"pinned {size((cpu.get('leased_bytes') or 0) + (cpu.get('reserved_bytes') or 0))}",
        f"dirty {size(cpu.get('dirty_bytes'))}",
        f"{count(cpu.get('resident_tensors'))} resident",
        f"{count(cpu.get('num_segments'))} segments"], width)]
    for gpu in _rows(tiers, "gpu"):  # each client's device caches, as it reported them
        lines.append(_tier_line("gpu ", gpu.get("used_bytes"), gpu.get("budget_bytes"), [
            shorten(str(gpu.get("client", "-")), 16), str(gpu.get("device", "-")),
            f"copied {size(gpu.get('copied_bytes'))}"], width))
    nvme = tiers.get("nvme")
    if isinstance(nvme, dict):
        dirs = _rows(nvme, "dirs")
        lines.append(_tier_line("nvme", nvme.get("used_bytes"), nvme.get("capacity_bytes"), [
            f"dirs {len(dirs)}", f"queue {count(nvme.get('queue_depth'))}"], width))
        for i, d in enumerate(dirs):
            lines.append(_tier_line(f" d{i} ", d.get("used_bytes"), d.get("capacity_bytes"),
                                    [f"queue {count(d.get('queue_depth'))}",
                                     shorten(str(d.get("path", "-")), 40)], width))
    return lines


def _bandwidth_lines(history: Sequence[BandwidthSample], width: int, *, disk: bool) -> list[Text]:
    series: list[tuple[str, list[float]]] = [
        ("read ", [s.read for s in history]), ("write", [s.write for s in history])]
    if disk:
        series += [("disk r", [s.disk_read for s in history]),
                   ("disk w", [s.disk_write for s in history])]
    lines = []
    label_width = max(len(label) for label, _ in series)
    # Fixed places for the figures, so that every sparkline starts and ends in one column;
    # the peak leaves first where the width runs short, then the sparkline narrows.
    now_width, peak_width = 11, len("  max 1023 MiB/s")
    peak_shown = width - label_width - now_width - peak_width - 2 >= 10
    spark_width = max(0, min(60, width - label_width - now_width - 2
                             - (peak_width if peak_shown else 0)))
    for label, values in series:
        line = (f"{label.ljust(label_width)} {sparkline(values, spark_width).ljust(spark_width)} "
                f"{(size(values[-1] if values else 0) + '/s').rjust(now_width)}")
        if peak_shown:
            line += f"  max {size(max(values, default=0))}/s"
        lines.append(Text(line[:width], style="cyan"))
    return lines


def _prefetch_line(stats: dict[str, Any], width: int) -> Text:
    clients = _rows(stats, "clients")
    hits = sum(_num("prefetch_hits")(c) + _num("inflight_hits")(c) for c in clients)
    misses = sum(_num("misses")(c) for c in clients)
    stall = sum(_num("stall_s")(c) for c in clients)
    reads = hits + misses
    scheduler = stats.get("scheduler")
    if not isinstance(scheduler, dict):
        return Text(fit(["prefetch: off (no NVMe tier)", f"stall {stall:.3f} s"], width))
    return Text(fit([f"prefetch hit rate {_percent(hits / reads if reads else None)}",
                     f"stall {stall:.3f} s", f"misses {count(misses)}",
                     f"disk {size(scheduler.get('read_bandwidth_bytes_per_s'))}/s est."], width))


HELP = (
    "infinity-top: what infinityd is doing, a new snapshot about once a second.",
    "",
    "  q      quit",
    "  s      sort clients by the next column: RESIDENT, REQ/S, STALL S, NAME, PID",
    "  ?      this help (any key goes back)",
    "",
    "tiers: use of the CPU tier (pinned: leased or reserved; dirty: not on NVMe)",
    "  and of each NVMe directory. read / write: clients' gets and commits of the",
    "  CPU tier per second; disk r / w: the NVMe tier's. HIT%: reads prefetched.",
)


def frame(snapshot: Snapshot, history: Sequence[BandwidthSample] = (), *, width: int = 80,
          height: int = 24, sort: str = SORTS[0], help: bool = False) -> list[Text]:
    """The screen's lines: at most `height`, each shorter than `width`."""
    inner = max(1, width - 1)  # the last column stays empty
    if snapshot.error is not None:
        lines = [Text(fit(["infinity-top", "q quit"], inner), style="bold"),
                 Text(""), *[Text(part, style="yellow") for part in _wrap(
                     f"infinityd: {snapshot.error}", inner)]]
        if history:
            lines += [Text(""), *_bandwidth_lines(history, inner, disk=False)]
        return lines[:height]
    stats = snapshot.stats if isinstance(snapshot.stats, dict) else {}
    daemon = _table(stats, "daemon")
    settings = _table(daemon, "settings")
    clients = _rows(stats, "clients")
    head = Text(fit([f"infinityd {daemon.get('version', '-')}", f"pid {daemon.get('pid', '-')}",
                     f"up {duration(daemon.get('uptime_s'))}",
                     f"clients {len(clients)}", f"{count(daemon.get('requests_per_s'))} req/s",
                     f"protocol {daemon.get('protocol', '-')}"], inner), style="bold")
    dirs = settings.get("nvme_dirs")
    setup = Text(fit([f"cpu tier {size(settings.get('cpu_budget_bytes'))}",
                      f"nvme dirs {len(dirs) if isinstance(dirs, (list, tuple)) else '-'}",
                      f"io {settings.get('io_backend', '-')} "
                      f"qd {settings.get('io_queue_depth', '-')}",
                      f"prefetch {'on' if settings.get('prefetch') else 'off'}",
                      shorten(str(daemon.get("runtime_dir", "-")), 30)], inner), style="dim")
    body: list[Text] = [head, setup, Text("tiers", style="bold underline"),
                        *_tier_lines(stats, inner)]
    body += [Text(fit(["bandwidth", "last minute"], inner), style="bold underline"),
             *_bandwidth_lines(history, inner, disk=isinstance(_table(stats, "tiers").get("nvme"),
                                                               dict)),
             _prefetch_line(stats, inner)]
    errors = _rows(stats, "recent_errors")
    footer = Text(fit([f"q quit  s sort: {sort}  ? help",
                       (f"last error: {errors[-1].get('code', '-')}" if errors else "")], inner),
                  style="reverse")
    if help:
        kept = body[:max(0, height - 1 - len(HELP))]
        shown = [Text(shorten(line, inner)) for line in HELP][:max(0, height - 1 - len(kept))]
        return [*kept, *shown, footer][:height]
    title = Text("clients", style="bold underline")
    room = height - len(body) - 2  # the title and the footer
    if room < 2:  # a small terminal: the clients before the bandwidth
        body = body[:2] + body[2:][:max(0, height - 2 - 2 - 3)]
        room = height - len(body) - 2
    # Room left below the clients goes to the scheduler's streams, then to the recent errors
    # (a large terminal, --once).
    streams = _rows(stats.get("scheduler"), "clients")
    needed = 1 + max(1, len(clients))
    if room - needed < 3:
        return [*body, title, *client_table(clients, width=inner, rows=max(0, room), sort=sort),
                footer][:height]
    lines = [*body, title, *client_table(clients, width=inner, rows=needed, sort=sort)]
    room -= needed
    if streams:
        stream_rows = min(room - 1, 1 + len(streams)) if errors else room - 1
        lines += [Text("prefetch by stream", style="bold underline"),
                  *table(streams, STREAM_COLUMNS, width=inner, rows=stream_rows)]
        room -= 1 + stream_rows
    if errors and room >= 2:
        lines.append(Text("recent errors", style="bold underline"))
        lines += [Text(shorten(_error_line(e), inner), style="yellow")
                  for e in reversed(errors[-(room - 1):])]
    return [*lines, footer][:height]


def _error_line(error: dict[str, Any]) -> str:
    when = error.get("time_s")
    clock = time.strftime("%H:%M:%S", time.localtime(when)) if isinstance(when, (int, float)) \
        else "-"
    return f"{clock} {error.get('code', '-')} {error.get('client', '')}: {error.get('message', '')}"


def _wrap(text: str, width: int) -> list[str]:
    """Words onto lines of at most `width` (a word longer than that is shortened)."""
    lines: list[str] = []
    line = ""
    for word in text.split():
        word = shorten(word, width)
        if line and len(line) + 1 + len(word) > width:
            lines.append(line)
            line = word
        else:
            line = f"{line} {word}" if line else word
    if line:
        lines.append(line)
    return lines


def render_text(lines: list[Text]) -> Text:
    """The lines as one Text (for rich's Live and for printing)."""
    out = Text(no_wrap=True, overflow="crop")
    for i, line in enumerate(lines):
        if i:
            out.append("\n")
        out.append_text(line)
    return out

