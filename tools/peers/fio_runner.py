"""fio as a benchmark peer: O_DIRECT writes, overwrites and reads of N files in one directory.

Standard library only, so it runs from Infinity's own venv. fio itself is a Debian package
(tools/peers/setup_peers.sh installs it); every run function returns ``(None, reason)`` when fio
is missing, and ``(gbps, detail)`` otherwise, gbps in decimal GB/s (1e9 bytes per second).

    from tools.peers import fio_runner            # or import it by path
    gbps, detail = fio_runner.write_fresh("/var/tmp/x", nfiles=64, ioengine="io_uring",
                                          bs=1 << 20, iodepth=32, numjobs=1)
    gbps, detail = fio_runner.read("/var/tmp/x", nfiles=64, ...)
    best = fio_runner.sweep("/var/tmp/x")         # best over io_uring/libaio, bs, iodepth, numjobs

Command line: ``python3 tools/peers/fio_runner.py --sweep DIR`` or
``python3 tools/peers/fio_runner.py DIR --mode read --nfiles 64 ...``; prints JSON.

File layout (the choices that decide what fio measures):
- The files are named explicitly, ``fio_0000.dat`` ..., and handed out to the jobs in contiguous
  shares through ``filename=a:b:...`` per job section, so the same files are used whatever
  numjobs a write and a later read have. (fio's own names, jobname.jobnum.filenum, would change
  with numjobs, and a read would then lay out and read new files.)
- ``file_service_type=sequential``: each job finishes one file before it starts the next, as
  DeepSpeed's and our engine's per-file calls do; the queue stays full across file boundaries.
- Fresh writes: the files are unlinked first (untimed) and fio runs with ``fallocate=none`` and the
  default ``overwrite=0``. fio then creates each file empty during setup (no fallocate, no
  ftruncate, no layout) and the timed writes allocate and extend it: the same work as DeepSpeed's
  O_CREAT writes of new files. (fio's default fallocate would preallocate extents and make
  "fresh" writes partly overwrites.)
- Overwrites and reads run on files that exist at full size with all their blocks allocated (not
  sparse), i.e. written by an earlier write run. fio would otherwise "lay out" a missing or short
  file itself before the timed phase and then read (or overwrite) that, which is not the data a
  write run produced; so this module checks the files first and, when ``prepare=True`` (default),
  writes them with a fresh-write run (untimed, reported as ``prepared``) or raises FioError.
  ``overwrite=1`` is deliberately not used: it makes fio lay out (fully write) a new file before
  the timed phase, which would hide a never-written file instead of reporting it.
- No fsync: O_DIRECT data goes to the (virtual) device, as with DeepSpeed; pass
  ``extra={"end_fsync": 1}`` to include a final fsync.
- GB/s = total bytes moved by all jobs / the longest job's runtime (fio reports runtime in ms,
  so runs shorter than ~0.5 s lose precision). File creation during fio's setup is not timed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
DEFAULT_FILE_SIZE = 64 * MiB
MODES = ("write", "overwrite", "read")


class FioError(RuntimeError):
    """fio ran but failed, or the files it was asked to read or overwrite are not there."""


def fio_binary() -> tuple[str | None, str]:
    """(path, "") when fio can run, else (None, reason)."""
    path = os.environ.get("FIO") or shutil.which("fio")
    if not path:
        return None, "fio not found on PATH (install it: apt-get install -y fio, or tools/peers/setup_peers.sh)"
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30)
    except OSError as exc:
        return None, f"fio at {path} cannot run: {exc}"
    if out.returncode != 0:
        return None, f"fio at {path} --version failed: {out.stderr.strip()}"
    return path, ""


def file_names(nfiles: int) -> list[str]:
    return [f"fio_{i:04d}.dat" for i in range(nfiles)]


def file_paths(directory: str, nfiles: int) -> list[str]:
    return [os.path.join(directory, n) for n in file_names(nfiles)]


def remove_files(directory: str, nfiles: int) -> None:
    for p in file_paths(directory, nfiles):
        try:
            os.unlink(p)
        except FileNotFoundError:
            pass


def files_written(directory: str, nfiles: int, file_size: int) -> tuple[bool, str]:
    """Whether every file exists at full size with all its blocks allocated (not sparse)."""
    for p in file_paths(directory, nfiles):
        try:
            st = os.stat(p)
        except FileNotFoundError:
            return False, f"{p} is missing"
        if st.st_size < file_size:
            return False, f"{p} holds {st.st_size} bytes, fewer than {file_size}"
        if st.st_blocks * 512 < file_size:
            return False, f"{p} is sparse ({st.st_blocks * 512} of {file_size} bytes allocated)"
    return True, ""


def _shares(names: list[str], numjobs: int) -> list[list[str]]:
    """Contiguous shares of the files, one per job, as even as possible."""
    numjobs = max(1, min(numjobs, len(names)))
    q, r = divmod(len(names), numjobs)
    out, i = [], 0
    for j in range(numjobs):
        n = q + (1 if j < r else 0)
        out.append(names[i:i + n])
        i += n
    return out


def build_command(fio: str, directory: str, mode: str, nfiles: int, file_size: int, ioengine: str,
                  bs: int, iodepth: int, numjobs: int, extra: dict | None = None) -> list[str]:
    rw = "read" if mode == "read" else "write"
    cmd = [fio, "--output-format=json",
           # global options, before the first --name
           f"--directory={directory}", f"--rw={rw}", "--direct=1", f"--ioengine={ioengine}",
           f"--bs={int(bs)}", f"--iodepth={int(iodepth)}", f"--filesize={int(file_size)}",
           "--file_service_type=sequential", "--fallocate=none", "--overwrite=0",
           "--unlink=0", "--allow_file_create=" + ("1" if mode == "write" else "0")]
    for k, v in (extra or {}).items():
        cmd.append(f"--{k}={v}")
    for j, share in enumerate(_shares(file_names(nfiles), numjobs)):
        cmd += [f"--name=peer{j}", f"--filename={':'.join(share)}", f"--nrfiles={len(share)}",
                f"--size={len(share) * int(file_size)}"]
    return cmd


def parse_output(text: str, mode: str) -> dict:
    """Total bytes, seconds and GB/s from fio's --output-format=json text."""
    start = text.find("{")  # fio may print notes before the JSON
    if start < 0:
        raise FioError(f"no JSON in fio output: {text[:500]!r}")
    data = json.loads(text[start:])
    key = "read" if mode == "read" else "write"
    jobs = data.get("jobs") or []
    if not jobs:
        raise FioError("fio reported no jobs")
    errors = [j.get("error") for j in jobs if j.get("error")]
    if errors:
        raise FioError(f"fio job error(s): {errors}")
    total = sum(int(j[key]["io_bytes"]) for j in jobs)
    runtime_ms = max(int(j[key]["runtime"]) for j in jobs)
    if total <= 0 or runtime_ms <= 0:
        raise FioError(f"fio moved {total} bytes in {runtime_ms} ms")
    seconds = runtime_ms / 1000.0
    return {"bytes": total, "seconds": seconds, "gbps": total / seconds / 1e9,
            "jobs": len(jobs), "fio_version": data.get("fio version")}


def run_fio(directory: str, mode: str, *, nfiles: int = 64, file_size: int = DEFAULT_FILE_SIZE,
            ioengine: str = "io_uring", bs: int = MiB, iodepth: int = 32, numjobs: int = 1,
            prepare: bool = True, extra: dict | None = None,
            timeout: float = 900) -> tuple[float | None, dict | str]:
    """One fio run over `nfiles` files of `file_size` bytes in `directory`.

    mode: "write" (fresh: files removed first), "overwrite" or "read" (files must have been written;
    see the module notes). Returns (gbps, detail) or (None, reason) when fio is missing.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}")
    fio, reason = fio_binary()
    if fio is None:
        return None, reason
    if file_size % 4096 or bs % 4096 or file_size % bs:
        raise ValueError("file_size and bs must be multiples of 4096, file_size a multiple of bs")
    os.makedirs(directory, exist_ok=True)
    prepared = False
    if mode == "write":
        remove_files(directory, nfiles)
    else:
        ok, why = files_written(directory, nfiles, file_size)
        if not ok:
            if not prepare:
                raise FioError(f"{mode} needs files written first: {why}")
            gb, det = run_fio(directory, "write", nfiles=nfiles, file_size=file_size,
                              ioengine=ioengine, bs=bs, iodepth=iodepth, numjobs=numjobs,
                              extra=extra, timeout=timeout)
            if gb is None:
                return None, det
            prepared = True
    cmd = build_command(fio, directory, mode, nfiles, file_size, ioengine, bs, iodepth, numjobs, extra)
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        raise FioError(f"fio timed out after {timeout} s") from exc
    if out.returncode != 0:
        raise FioError(f"fio exited {out.returncode}: {out.stderr.strip()[-2000:]}")
    res = parse_output(out.stdout, mode)
    if res["bytes"] != nfiles * file_size:
        raise FioError(f"fio moved {res['bytes']} bytes, expected {nfiles * file_size}")
    if mode != "read":
        ok, why = files_written(directory, nfiles, file_size)
        if not ok:
            raise FioError(f"after the {mode} run: {why}")
    res.update({"mode": mode, "ioengine": ioengine, "bs": int(bs), "iodepth": int(iodepth),
                "numjobs": int(numjobs), "nfiles": int(nfiles), "file_size": int(file_size),
                "prepared": prepared, "command": " ".join(cmd)})
    return res["gbps"], res


def write_fresh(directory: str, **kw) -> tuple[float | None, dict | str]:
    """Writes of new files (existing ones are removed first, untimed)."""
    return run_fio(directory, "write", **kw)


def overwrite(directory: str, **kw) -> tuple[float | None, dict | str]:
    """Writes over existing, fully written files."""
    return run_fio(directory, "overwrite", **kw)


def read(directory: str, **kw) -> tuple[float | None, dict | str]:
    """Reads of files an earlier write run wrote."""
    return run_fio(directory, "read", **kw)


def sweep(directory: str, *, total_bytes: int = GiB, file_size: int = DEFAULT_FILE_SIZE,
          ioengines=("io_uring", "libaio"), block_sizes=(MiB, 4 * MiB, 8 * MiB), iodepths=(8, 32, 64),
          numjobs=(1, 2), keep: bool = False, log=None) -> tuple[dict | None, dict | str]:
    """fio's best per mode over the given settings, on ~total_bytes as file_size files.

    Per setting: a fresh write, a read of what it wrote, then an overwrite. Settings fio rejects
    (e.g. io_uring blocked by a sandbox) are recorded in "failed" and skipped. Returns
    (summary, "") or (None, reason) when fio is missing or nothing ran.
    """
    fio, reason = fio_binary()
    if fio is None:
        return None, reason
    nfiles = max(1, total_bytes // file_size)
    sub = os.path.join(directory, f"fio_sweep_{os.getpid()}")
    os.makedirs(sub, exist_ok=True)
    results, failed = [], []
    try:
        for eng in ioengines:
            for bs in block_sizes:
                for qd in iodepths:
                    for nj in numjobs:
                        s = {"ioengine": eng, "bs": int(bs), "iodepth": int(qd), "numjobs": int(nj)}
                        row = dict(s)
                        try:
                            for mode in ("write", "read", "overwrite"):
                                gb, _ = run_fio(sub, mode, nfiles=nfiles, file_size=file_size,
                                                prepare=False, **s)
                                row[f"{mode}_gbps"] = gb
                        except (FioError, ValueError) as exc:
                            failed.append({**s, "error": str(exc)[:500]})
                            if log:
                                log(f"failed {s}: {exc}")
                            continue
                        results.append(row)
                        if log:
                            log(json.dumps(row))
    finally:
        if not keep:
            remove_files(sub, nfiles)
            try:
                os.rmdir(sub)
            except OSError:
                pass
    if not results:
        return None, f"no fio setting ran: {failed[:3]}"
    best = {}
    for mode in MODES:
        row = max(results, key=lambda r: r[f"{mode}_gbps"])
        best[mode] = {"gbps": row[f"{mode}_gbps"],
                      **{k: row[k] for k in ("ioengine", "bs", "iodepth", "numjobs")}}
    return {"directory": directory, "nfiles": nfiles, "file_size": file_size,
            "bytes": nfiles * file_size, "best": best, "results": results, "failed": failed}, ""


def _parse_size(text: str) -> int:
    t = str(text).strip().lower().removesuffix("b").removesuffix("i")
    mult = {"k": KiB, "m": MiB, "g": GiB}.get(t[-1:], 1)
    return int(float(t[:-1] if mult != 1 else t) * mult)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="fio peer runner (O_DIRECT, N files); prints JSON")
    ap.add_argument("directory", nargs="?")
    ap.add_argument("--sweep", metavar="DIR", help="sweep settings on DIR")
    ap.add_argument("--mode", choices=MODES, default="write")
    ap.add_argument("--nfiles", type=int, default=64)
    ap.add_argument("--file-size", default="64M")
    ap.add_argument("--ioengine", default="io_uring")
    ap.add_argument("--bs", default="1M")
    ap.add_argument("--iodepth", type=int, default=32)
    ap.add_argument("--numjobs", type=int, default=1)
    ap.add_argument("--total-bytes", default="1G", help="sweep: data per pass")
    ap.add_argument("--ioengines", default="io_uring,libaio", help="sweep: comma list")
    ap.add_argument("--block-sizes", default="1M,4M,8M", help="sweep: comma list")
    ap.add_argument("--iodepths", default="8,32,64", help="sweep: comma list")
    ap.add_argument("--numjobs-list", default="1,2", help="sweep: comma list")
    args = ap.parse_args(argv)

    def log(msg):
        print(f"[fio_runner] {msg}", file=sys.stderr, flush=True)

    try:
        if args.sweep:
            res, why = sweep(args.sweep, total_bytes=_parse_size(args.total_bytes),
                             file_size=_parse_size(args.file_size),
                             ioengines=args.ioengines.split(","),
                             block_sizes=[_parse_size(x) for x in args.block_sizes.split(",")],
                             iodepths=[int(x) for x in args.iodepths.split(",")],
                             numjobs=[int(x) for x in args.numjobs_list.split(",")], log=log)
            out = res if res is not None else {"gbps": None, "reason": why}
        elif args.directory:
            gb, det = run_fio(args.directory, args.mode, nfiles=args.nfiles,
                              file_size=_parse_size(args.file_size), ioengine=args.ioengine,
                              bs=_parse_size(args.bs), iodepth=args.iodepth, numjobs=args.numjobs)
            out = det if gb is not None else {"gbps": None, "reason": det}
        else:
            ap.error("give a directory or --sweep DIR")
    except (FioError, ValueError) as exc:
        print(json.dumps({"error": str(exc)}))
        return 1
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
