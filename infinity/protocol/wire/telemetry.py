"""The telemetry stream's message: one snapshot of the daemon, as `stats` reports it.

infinityd publishes one `TelemetrySnapshot` per `telemetry.interval_s` on the runtime folder's
telemetry socket (ZeroMQ PUB, `RuntimeLayout.telemetry_endpoint`); subscribers (infinity-top)
take every message. One msgpack frame, no topic frame:

    ["telemetry", TELEMETRY_VERSION, seq, time_s, interval_s, stats]

`seq` counts the daemon's snapshots from 1 (a gap means a subscriber missed some; a smaller
one, that the daemon restarted), `time_s` is the daemon's wall clock when it was taken,
`interval_s` the stream's period, and `stats` the map a `stats` request returns at that
moment. The version is the stream's own: a subscriber of another version is told so, in
words, rather than shown a map it would misread.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, ClassVar, Sequence

from infinity.errors import ProtocolError

from .codec import _bad, _float, _int, _list, _pack, _str, _unpack

MAX_DEVICES = 64  # device figures in one report at most (one per device a client computes on)
TELEMETRY_KIND = "telemetry"
TELEMETRY_VERSION = 1
# Sections every snapshot's stats carry (a subscriber may rely on these being maps or lists).
TELEMETRY_SECTIONS = ("daemon", "tiers", "clients", "counters", "telemetry")


@dataclass(frozen=True, slots=True)
class TelemetrySnapshot:
    seq: int
    time_s: float
    interval_s: float
    stats: dict[str, Any]

    def encode(self) -> bytes:
        return _pack([TELEMETRY_KIND, TELEMETRY_VERSION, self.seq, self.time_s, self.interval_s,
                      self.stats])

    @classmethod
    def decode(cls, data: bytes) -> TelemetrySnapshot:
        """ProtocolError when `data` is not a snapshot of this version."""
        value = _list(_unpack(data, "a telemetry message"), "telemetry message")
        if len(value) < 2 or value[0] != TELEMETRY_KIND:
            raise ProtocolError("a telemetry message starts with \"telemetry\" and its version; "
                                "is this the telemetry socket of an infinityd?")
        version = _int(value[1], "telemetry version")
        if version != TELEMETRY_VERSION:
            raise ProtocolError(f"the daemon publishes telemetry version {version}; this "
                                f"monitor reads version {TELEMETRY_VERSION}: run the "
                                f"infinity-top of the same release as infinityd")
        _list(value, "telemetry message", 6)
        stats = value[5]
        if type(stats) is not dict:
            raise _bad("telemetry stats", "a map", stats)
        for section in TELEMETRY_SECTIONS:
            if not isinstance(stats.get(section), (dict, tuple, list)):
                raise _bad(f"telemetry stats[{_str(section, 'section')!r}]", "a map or a list",
                           stats.get(section))
        return cls(_int(value[2], "telemetry seq", minimum=1), _float(value[3], "telemetry time"),
                   _float(value[4], "telemetry interval"), stats)


# --- what a client reports of itself ------------------------------------------------------

@dataclass(frozen=True, slots=True)
class DeviceFigures:
    """One device's figures of a client's GPU tier (its device caches on that device, summed):
    [device, budget_bytes, used_bytes, max_used_bytes, hits, inflight_hits, misses,
    prefetched, evictions, copied_bytes]."""

    device: str
    budget_bytes: int = 0
    used_bytes: int = 0
    max_used_bytes: int = 0
    hits: int = 0
    inflight_hits: int = 0
    misses: int = 0
    prefetched: int = 0
    evictions: int = 0
    copied_bytes: int = 0

    def to_wire(self) -> list[Any]:
        return [getattr(self, f.name) for f in fields(self)]

    @classmethod
    def from_wire(cls, value: Any, where: str) -> DeviceFigures:
        names = [f.name for f in fields(cls)]
        items = _list(value, where, len(names))
        return cls(_str(items[0], where + " device"),
                   *(_int(v, f"{where} {name}") for v, name in zip(items[1:], names[1:])))

    def as_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True, slots=True)
class DeviceReport:
    """A client's GPU tier, which the daemon cannot see (device memory is the client's): sent
    with its heartbeats while it has device caches, for `stats` and the telemetry; no reply."""

    OP: ClassVar[str] = "device_report"
    devices: tuple[DeviceFigures, ...]

    def body(self) -> list[Any]:
        return [d.to_wire() for d in self.devices]

    @classmethod
    def from_body(cls, body: Sequence[Any]) -> DeviceReport:
        items = _list(body, "device_report")
        if len(items) > MAX_DEVICES:
            raise ProtocolError(f"malformed device_report: {len(items)} devices, at most "
                                f"{MAX_DEVICES}")
        return cls(tuple(DeviceFigures.from_wire(v, f"device_report item {i}")
                         for i, v in enumerate(items)))
