#!/usr/bin/env python3
"""DeepSpeed async_io peer for the I/O benchmarks (run with the peers venv's python).

Set up by tools/peers/setup_peers.sh; run as

    DS_ACCELERATOR=cpu TORCH_EXTENSIONS_DIR=/var/tmp/infinity-peers/torch_extensions \\
        /var/tmp/infinity-peers/venv/bin/python tools/peers/deepspeed_aio_worker.py JOB_JSON
    ... deepspeed_aio_worker.py - < job.json            (job on stdin)
    ... deepspeed_aio_worker.py --sweep DIR [--total-bytes N] [--file-bytes N]

(the two variables default to those values when unset, see _setup_env).

A job is a JSON object:

    {"op": "write" | "read",
     "paths": ["/dir/f0", ...],       one file per path, each `nbytes` long
     "nbytes": 67108864,              bytes per file: a multiple of 4096 * intra_op_parallelism
     "block_size": 1048576,           bytes per libaio request
     "queue_depth": 32,               requests in flight per DeepSpeed I/O thread
     "intra_op_parallelism": 1,       DeepSpeed I/O threads; each moves nbytes / n of every file
     "single_submit": false,          io_submit one request at a time
     "overlap_events": true,          keep the queue topped up instead of submit-a-batch/wait-all
     "seed": 1,                       picks the data; a read must use the seed its write used
     "fresh": false,                  write only: unlink the paths first (untimed), so the write
                                      creates and extends new files instead of overwriting
     "fsync": false,                  write only: fsync each file inside the timed region
     "verify": true}                  read only: compare each file with the expected pattern

and the answer, printed on stdout as one JSON line (everything else goes to stderr):

    {"seconds": ..., "bytes": ..., "gbps": ..., "verified": true|false|null, ...}

`seconds` is the sum of the times of the I/O calls only (sync_pwrite / sync_pread, plus fsync when
asked); filling the buffer and verifying are outside it. gbps is decimal: bytes / seconds / 1e9.
`verified` is null for writes and for reads with "verify": false.

Data: ONE page-locked buffer (handle.new_cpu_locked_tensor) of nbytes is used for every file. A
random int64 base pattern (seeded) is made once; file `p` holds base XOR key(seed, p), with key a
64-bit hash of the seed and the absolute path, so every file differs and a read run can check what
it got without the writer's help: XOR the buffer with the key again (in place) and compare with the
base.

API notes (deepspeed 0.19.x, csrc/aio/py_lib/py_ds_aio.cpp and deepspeed_py_io_handle.cpp):
- aio_handle(block_size, queue_depth, single_submit, overlap_events, intra_op_parallelism).
- sync_pwrite(buffer, filename, file_offset=0) / sync_pread(buffer, filename, file_offset=0)
  return the count of completed ops (1), or -1 on open/size/divisibility errors, which are only
  printed, never raised: the return value must be checked.
- Completion events are not checked for errors or short transfers (io_event.res is ignored), so a
  failed I/O looks like a success: hence the read verification.
- Writes open with O_WRONLY|O_CREAT|O_DIRECT and no O_TRUNC: writing to an existing file
  overwrites it in place; "fresh" writes need the file removed first.
- sync_pread of more bytes than the file holds hits an assert() in the op (the op is built with
  -O0 and without NDEBUG), which aborts the process; the size is checked here first.
- AsyncIOBuilder().load() loads the pin_memory op first (its page-locked allocator); the pages
  are mlock()ed, so a non-root user needs RLIMIT_MEMLOCK >= nbytes.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time

DEFAULT_PEERS_DIR = "/var/tmp/infinity-peers"
KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
ALIGN = 4096

_JSON_OUT = None  # file object on the original stdout; set by _isolate_stdout()


def _setup_env() -> None:
    peers_dir = os.environ.get("INFINITY_PEERS_DIR", DEFAULT_PEERS_DIR)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(peers_dir, "torch_extensions"))


def _isolate_stdout() -> None:
    """Route fd 1 to stderr so DeepSpeed's and the C++ op's prints cannot corrupt our JSON."""
    global _JSON_OUT
    if _JSON_OUT is not None:
        return
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    _JSON_OUT = os.fdopen(saved, "w")
    sys.stdout = sys.stderr


def _emit(obj) -> None:
    out = _JSON_OUT if _JSON_OUT is not None else sys.stdout
    out.write(json.dumps(obj) + "\n")
    out.flush()


def _log(msg: str) -> None:
    print(f"[deepspeed_aio_worker] {msg}", file=sys.stderr, flush=True)


_AIO_MODULE = None


def load_aio():
    """The compiled async_io module (compiles once into TORCH_EXTENSIONS_DIR)."""
    global _AIO_MODULE
    if _AIO_MODULE is None:
        from deepspeed.ops.op_builder import AsyncIOBuilder

        builder = AsyncIOBuilder()
        if not builder.is_compatible(verbose=True):
            raise RuntimeError("DeepSpeed async_io is not compatible here (is libaio-dev installed?)")
        _AIO_MODULE = builder.load(verbose=False)
        # The op logs an SSD-endurance warning through Python on the first write of the process
        # (GIL + import + logging, inside the first timed call); mark it as already shown.
        import deepspeed.utils

        deepspeed.utils._deepspeed_nvme_write_warning_emitted = True
    return _AIO_MODULE


def new_handle(block_size: int, queue_depth: int, single_submit: bool, overlap_events: bool,
               intra_op_parallelism: int):
    return load_aio().aio_handle(int(block_size), int(queue_depth), bool(single_submit),
                                 bool(overlap_events), int(intra_op_parallelism))


def path_key(seed: int, path: str) -> int:
    """A signed 64-bit key per (seed, file); XORed over the base pattern."""
    digest = hashlib.blake2b(f"{seed}\0{os.path.abspath(path)}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True) or 1


class Pattern:
    """The seeded base data; file-specific data is base ^ path_key(seed, path)."""

    def __init__(self, nbytes: int, seed: int):
        import torch

        gen = torch.Generator().manual_seed(int(seed))
        self.seed = int(seed)
        self.base = torch.randint(-(1 << 63), (1 << 63) - 1, (nbytes // 8,), dtype=torch.int64,
                                  generator=gen)

    def fill(self, buf64, path: str) -> None:
        import torch

        torch.bitwise_xor(self.base, path_key(self.seed, path), out=buf64)

    def check(self, buf64, path: str) -> bool:
        """Whether buf64 holds the data of `path`. Clobbers buf64 (XORs the key back out)."""
        import torch

        buf64.bitwise_xor_(path_key(self.seed, path))
        return bool(torch.equal(buf64, self.base))


def _validate_sizes(nbytes: int, block_size: int, queue_depth: int, iop: int) -> None:
    if nbytes <= 0 or nbytes % (ALIGN * iop):
        raise ValueError(f"nbytes={nbytes} must be a positive multiple of {ALIGN} * "
                         f"intra_op_parallelism ({iop}) for O_DIRECT")
    if block_size <= 0 or block_size % ALIGN:
        raise ValueError(f"block_size={block_size} must be a positive multiple of {ALIGN}")
    if queue_depth <= 0 or iop <= 0:
        raise ValueError("queue_depth and intra_op_parallelism must be positive")


class Runner:
    """One aio handle plus the one locked buffer; runs write/read passes over a list of files."""

    def __init__(self, nbytes: int, seed: int, locked_buffer=None, pattern: Pattern | None = None):
        self.nbytes = int(nbytes)
        self.pattern = pattern if pattern is not None else Pattern(self.nbytes, seed)
        self.buf = locked_buffer
        self._owner = None

    def ensure_buffer(self, handle):
        import torch

        if self.buf is None:
            # numel is counted in elements of the example tensor's dtype (int64 here).
            self.buf = handle.new_cpu_locked_tensor(self.nbytes // 8, torch.empty(0, dtype=torch.int64))
            if self.buf is None or self.buf.numel() * 8 != self.nbytes:
                raise RuntimeError("new_cpu_locked_tensor failed (mlock limit? see stderr)")
            self._owner = handle
        return self.buf

    def free(self) -> None:
        if self.buf is not None and self._owner is not None:
            self._owner.free_cpu_locked_tensor(self.buf)
        self.buf = None
        self._owner = None

    def write(self, handle, paths, fresh: bool = False, fsync: bool = False) -> float:
        buf = self.ensure_buffer(handle)
        if fresh:
            for p in paths:
                try:
                    os.unlink(p)
                except FileNotFoundError:
                    pass
        seconds = 0.0
        for p in paths:
            self.pattern.fill(buf, p)  # untimed
            t0 = time.perf_counter()
            rc = handle.sync_pwrite(buf, p)
            if fsync:
                fd = os.open(p, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
            seconds += time.perf_counter() - t0
            if rc < 0:
                raise RuntimeError(f"sync_pwrite failed on {p} (rc={rc}, see stderr)")
        return seconds

    def read(self, handle, paths, verify: bool = True) -> tuple[float, bool | None]:
        buf = self.ensure_buffer(handle)
        for p in paths:  # the op would abort the process on a short file
            size = os.stat(p).st_size
            if size < self.nbytes:
                raise RuntimeError(f"{p} holds {size} bytes, fewer than nbytes={self.nbytes}")
        seconds = 0.0
        verified: bool | None = True if verify else None
        for p in paths:
            buf.fill_(0)  # untimed; a read that moved nothing cannot pass the check
            t0 = time.perf_counter()
            rc = handle.sync_pread(buf, p)
            seconds += time.perf_counter() - t0
            if rc < 0:
                raise RuntimeError(f"sync_pread failed on {p} (rc={rc}, see stderr)")
            if verify and not self.pattern.check(buf, p):
                _log(f"verification failed for {p}")
                verified = False
        return seconds, verified


def _settings(job: dict) -> dict:
    return {
        "block_size": int(job.get("block_size", MiB)),
        "queue_depth": int(job.get("queue_depth", 32)),
        "intra_op_parallelism": int(job.get("intra_op_parallelism", 1)),
        "single_submit": bool(job.get("single_submit", False)),
        "overlap_events": bool(job.get("overlap_events", True)),
    }


def run_job(job: dict) -> dict:
    op = job.get("op")
    if op not in ("write", "read"):
        raise ValueError('job["op"] must be "write" or "read"')
    paths = [str(p) for p in job.get("paths") or []]
    if not paths:
        raise ValueError('job["paths"] must list at least one file')
    nbytes = int(job.get("nbytes", 64 * MiB))
    s = _settings(job)
    _validate_sizes(nbytes, s["block_size"], s["queue_depth"], s["intra_op_parallelism"])
    handle = new_handle(**s)
    runner = Runner(nbytes, int(job.get("seed", 1)))
    try:
        if op == "write":
            seconds = runner.write(handle, paths, fresh=bool(job.get("fresh", False)),
                                   fsync=bool(job.get("fsync", False)))
            verified = None
        else:
            seconds, verified = runner.read(handle, paths, verify=bool(job.get("verify", True)))
    finally:
        runner.free()
    total = nbytes * len(paths)
    return {"op": op, "seconds": seconds, "bytes": total, "gbps": total / seconds / 1e9,
            "verified": verified, "files": len(paths), "nbytes": nbytes, **s}


def sweep(directory: str, total_bytes: int = GiB, file_bytes: int = 64 * MiB,
          block_sizes=(MiB, 4 * MiB, 8 * MiB), queue_depths=(8, 32, 64),
          parallelisms=(1, 2), seed: int = 1, keep: bool = False) -> dict:
    """Try every (block_size, queue_depth, intra_op_parallelism) on `directory`.

    Per setting, in this order: a fresh write (files unlinked first), a verified read of what it
    wrote, then an overwrite of the same files. Returns every result and the best per kind.
    """
    nfiles = max(1, total_bytes // file_bytes)
    sub = os.path.join(directory, f"ds_aio_sweep_{os.getpid()}")
    os.makedirs(sub, exist_ok=True)
    paths = [os.path.join(sub, f"f{i:04d}.bin") for i in range(nfiles)]
    runner = Runner(file_bytes, seed)
    pin_handle = new_handle(MiB, 8, False, True, 1)  # owns the one locked buffer
    runner.ensure_buffer(pin_handle)
    results = []
    try:
        for bs in block_sizes:
            for qd in queue_depths:
                for iop in parallelisms:
                    s = {"block_size": int(bs), "queue_depth": int(qd), "intra_op_parallelism": int(iop),
                         "single_submit": False, "overlap_events": True}
                    _validate_sizes(file_bytes, bs, qd, iop)
                    h = new_handle(**s)
                    total = file_bytes * nfiles
                    t_w = runner.write(h, paths, fresh=True)
                    t_r, ok = runner.read(h, paths, verify=True)
                    t_o = runner.write(h, paths, fresh=False)
                    row = {**s, "write_gbps": total / t_w / 1e9, "read_gbps": total / t_r / 1e9,
                           "overwrite_gbps": total / t_o / 1e9, "verified": ok}
                    _log(json.dumps(row))
                    results.append(row)
                    del h
    finally:
        runner.free()
        if not keep:
            for p in paths:
                try:
                    os.unlink(p)
                except FileNotFoundError:
                    pass
            try:
                os.rmdir(sub)
            except OSError:
                pass
    best = {}
    for kind in ("write", "overwrite", "read"):
        row = max(results, key=lambda r: r[f"{kind}_gbps"])
        best[kind] = {"gbps": row[f"{kind}_gbps"],
                      **{k: row[k] for k in ("block_size", "queue_depth", "intra_op_parallelism",
                                            "single_submit", "overlap_events")}}
    return {"directory": directory, "files": nfiles, "file_bytes": file_bytes,
            "bytes": nfiles * file_bytes, "verified": all(r["verified"] for r in results),
            "best": best, "results": results}


def _parse_size(text: str) -> int:
    t = text.strip().lower().removesuffix("b").removesuffix("i")
    mult = {"k": KiB, "m": MiB, "g": GiB}.get(t[-1:], 1)
    return int(float(t[:-1] if mult != 1 else t) * mult)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("job", nargs="?", help="job JSON text, or '-' / nothing to read it from stdin")
    ap.add_argument("--sweep", metavar="DIR", help="sweep settings on DIR instead of running a job")
    ap.add_argument("--total-bytes", default="1G", help="sweep: data per pass (default 1G)")
    ap.add_argument("--file-bytes", default="64M", help="sweep: bytes per file (default 64M)")
    ap.add_argument("--block-sizes", default="1M,4M,8M", help="sweep: comma list")
    ap.add_argument("--queue-depths", default="8,32,64", help="sweep: comma list")
    ap.add_argument("--parallelisms", default="1,2", help="sweep: intra_op_parallelism comma list")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args(argv)

    _setup_env()
    _isolate_stdout()
    try:
        if args.sweep:
            out = sweep(args.sweep, _parse_size(args.total_bytes), _parse_size(args.file_bytes),
                        [_parse_size(x) for x in args.block_sizes.split(",")],
                        [int(x) for x in args.queue_depths.split(",")],
                        [int(x) for x in args.parallelisms.split(",")], seed=args.seed)
        else:
            text = args.job if args.job not in (None, "-") else sys.stdin.read()
            out = run_job(json.loads(text))
    except Exception as exc:  # one JSON answer either way, for the caller to parse
        _emit({"error": f"{type(exc).__name__}: {exc}"})
        return 1
    _emit(out)
    return 0 if out.get("verified") is not False else 2


if __name__ == "__main__":
    sys.exit(main())
