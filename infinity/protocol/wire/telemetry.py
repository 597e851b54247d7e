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

from dataclasses import dataclass
from typing import Any

from infinity.errors import ProtocolError

from .codec import _bad, _float, _int, _list, _pack, _str, _unpack

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
