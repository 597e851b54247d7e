"""A benchmark subject in its own process, driven by JSON lines (standard library only).

The benchmarks interleave their subjects round by round, and some subjects cannot live in the
benchmark's process: DeepSpeed needs the peers' venv (tools/peers/setup_peers.sh), and a training
run is best kept apart so that its memory and its /proc/<pid>/io counters are its own. Such a
subject runs as a worker that reads one JSON request per line on stdin and answers one JSON line
on stdout; whatever else it or its libraries print goes to stderr.

- `serve(handlers)`: the worker side. Each request is {"op": NAME, ...}; `handlers[NAME](request)`
  returns the answer's dict. An exception becomes {"error": "..."} and the worker goes on; "quit"
  (or the end of stdin) ends it.
- `Worker(argv, env=...)`: the benchmark side. `call(op, **fields)` sends a request and returns
  the answer, raising `WorkerError` on {"error": ...} or when the worker died. The worker runs in
  a session of its own, so `close()` ends it and everything it started (a daemon, DeepSpeed's
  threads) with one signal to the group, also when the benchmark itself fails.

Both sides run on any Python 3.9+ with nothing installed, so the peers' venv can import this.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from typing import Any, Callable, Dict, List, Optional


class WorkerError(RuntimeError):
    """A worker answered with an error, or died."""


def proc_io_bytes(pid: int | str = "self") -> Dict[str, int]:
    """read_bytes / write_bytes of a process from /proc/<pid>/io: what it made the block layer
    read and write (O_DIRECT and page-cache write-back alike; page-cache hits are not counted)."""
    fields: Dict[str, int] = {}
    with open(f"/proc/{pid}/io") as f:
        for line in f:
            key, _, value = line.partition(":")
            fields[key.strip()] = int(value)
    return {"read_bytes": fields.get("read_bytes", 0), "write_bytes": fields.get("write_bytes", 0)}


def proc_cpu_ms(pid: int | str = "self") -> int:
    """CPU time (user + system, all threads) a process used so far, in milliseconds, from
    /proc/<pid>/stat."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    ticks = int(fields[11]) + int(fields[12])  # utime, stime: the stat line's 14th and 15th
    return ticks * 1000 // os.sysconf("SC_CLK_TCK")


def proc_counters(pid: int | str = "self") -> Dict[str, int]:
    """`proc_io_bytes` and the CPU time (`cpu_ms`) of a process: a training worker's counters."""
    return {**proc_io_bytes(pid), "cpu_ms": proc_cpu_ms(pid)}


def serve(handlers: Dict[str, Callable[[Dict[str, Any]], Dict[str, Any]]]) -> int:
    """Answer requests from stdin until "quit" or its end; returns the exit status."""
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # libraries' prints (DeepSpeed's, torch's) cannot corrupt the answers
    sys.stdout = sys.stderr
    for line in sys.stdin:
        if not line.strip():
            continue
        request = json.loads(line)
        op = request.get("op")
        if op == "quit":
            out.write(json.dumps({"ok": True}) + "\n")
            out.flush()
            return 0
        try:
            handler = handlers[op]
            answer = handler(request)
        except Exception as exc:  # answered, so the benchmark can say what failed
            import traceback

            traceback.print_exc(file=sys.stderr)
            answer = {"error": f"{type(exc).__name__}: {exc}"}
        out.write(json.dumps(answer) + "\n")
        out.flush()
    return 0


class Worker:
    """One worker process and its pipe."""

    def __init__(self, argv: List[str], *, env: Optional[Dict[str, str]] = None,
                 stderr_path: Optional[str] = None, name: str = "worker") -> None:
        self.name = name
        self.stderr_path = stderr_path
        self._stderr = open(stderr_path, "ab") if stderr_path else None
        self.process = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        stderr=self._stderr, env=env, text=True, bufsize=1,
                                        start_new_session=True)

    @property
    def pid(self) -> int:
        return self.process.pid

    def call(self, op: str, **fields: Any) -> Dict[str, Any]:
        assert self.process.stdin is not None and self.process.stdout is not None
        try:
            self.process.stdin.write(json.dumps({"op": op, **fields}) + "\n")
            self.process.stdin.flush()
        except BrokenPipeError:
            pass  # reported below, with the exit status
        line = self.process.stdout.readline()
        if not line:
            status = self.process.wait()
            raise WorkerError(f"{self.name} exited with status {status} during {op!r}"
                              + self._tail())
        answer = json.loads(line)
        if "error" in answer:
            raise WorkerError(f"{self.name} failed in {op!r}: {answer['error']}" + self._tail())
        return answer

    def _signal_group(self, sig: int) -> bool:
        """Send `sig` to the worker's process group; False once the group is empty."""
        try:
            os.killpg(self.process.pid, sig)
        except ProcessLookupError:
            return False
        except PermissionError:  # a zombie leader still listed: its group is done
            return False
        return True

    def _tail(self) -> str:
        if not self.stderr_path:
            return ""
        try:
            with open(self.stderr_path, "rb") as f:
                f.seek(max(0, os.path.getsize(self.stderr_path) - 3000))
                return "; its stderr ends with:\n" + f.read().decode("utf-8", "replace")
        except OSError:
            return ""

    def close(self, timeout_s: float = 30.0) -> None:
        """Ask the worker to quit, then end its whole process group whatever it did."""
        if self.process.poll() is None:
            try:
                assert self.process.stdin is not None
                self.process.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.process.stdin.close()
            except (BrokenPipeError, OSError, ValueError):
                pass
            deadline = time.monotonic() + timeout_s
            while self.process.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
        # What it started (e.g. a daemon) too: a polite signal, then time to stop, then a kill.
        for sig, grace_s in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
            if not self._signal_group(sig):
                break
            deadline = time.monotonic() + grace_s
            while time.monotonic() < deadline:
                self.process.poll()  # reaps the worker, which else stays in the group
                if not self._signal_group(0):
                    break
                time.sleep(0.05)
        if self.process.poll() is None:
            self.process.wait(10)
        if self._stderr is not None:
            self._stderr.close()
