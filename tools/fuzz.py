"""Fuzz infinityd's control socket with raw frames from outside the client library.

    .venv/bin/python tools/fuzz.py [--frames 50000] [--seed 1] [--sockets 8] [--dir /var/tmp]
                                   > fuzz.json

A private daemon (CPU tier only) gets `--frames` frames over `--sockets` DEALER sockets (half
of them said hello first, with the daemon's secret, so frames reach the handlers as well as the
handshake's checks), each
frame one of:

- `garbage`: random bytes of random length (0 to 4 KiB), or several such frames at once;
- `mutated`: a valid request of a random operation (every op but shutdown, with plausible
  names, dtypes and shapes) with bytes flipped, cut or appended;
- `confused`: a msgpack [op, id, body] whose op is real or not and whose id and body are random
  msgpack values (wrong types, nesting, huge or negative numbers, long strings);
- `valid`: a well-formed request, so that the daemon also does real work in between.

Before the storm a reference client puts tensors of every storable dtype (seeded values, odd
shapes); after it, the same client reads them back and compares bit for bit, and puts and gets a
new one. The reference tensors live in a namespace no frame names (the valid requests put,
get and delete in namespaces of their own). Every `--sample-every` frames the daemon's RSS, anonymous memory and open file count are
sampled (/proc); the figures after the warm-up (the first fifth) are compared with the end.

Printed: frames by kind, replies seen, whether the daemon was alive throughout, the reference
tensors lost or wrong (must be 0), the daemon's `malformed` counter, anonymous memory and open
files at warm-up and at the end, and their growth. Exit status 1 if the daemon died or a tensor
was lost or wrong.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import tempfile
import time
from typing import Any

import msgpack
import psutil
import torch
import zmq
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

import infinity
from bench_launch import daemon_figures, start_daemon
from infinity.config import MiB
from infinity.protocol import wire
from infinity.protocol.paths import RuntimeLayout

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int8, torch.uint8,
          torch.int16, torch.int32, torch.int64, torch.bool]
# The reference tensors' namespace: no frame the fuzzer makes names it (valid requests act on
# their own namespaces; a mutation would have to spell this out), so each must survive.
REFERENCE_NAMESPACE = "reference-tensors-the-fuzzer-never-names"
OPS = ["hello", "attach", "heartbeat", "detach", "bye", "stats", "get", "release", "reserve",
       "commit", "commit_renew", "commit_durable", "flush_store", "stream_open", "stream_chunk",
       "stream_close", "abort", "prefetch", "delete", "exists", "list", "step", "get_ahead",
       "upcoming", "namespace", "adam_step", "verify", "not_an_op"]


def seeded_tensor(index: int) -> torch.Tensor:
    dtype = DTYPES[index % len(DTYPES)]
    generator = torch.Generator().manual_seed(index)
    shape = (3 + index % 5, 7 + index % 3)
    values = torch.randint(-100, 100, shape, generator=generator)
    return values.to(dtype) if dtype != torch.bool else values > 0


def valid_requests(rng: random.Random, request_id: int) -> bytes:
    namespace = rng.choice(["default", "fuzz", "f" * rng.randint(1, 40)])
    name = rng.choice(["x", "ref-3", "fuzz-" + str(rng.randrange(50)), "n" * rng.randint(1, 64)])
    dtype = rng.choice(["float32", "int8", "bfloat16", "float64", "bool", "complex64"])
    shape = tuple(rng.randint(0, 9) for _ in range(rng.randint(0, 3)))
    ref = wire.TensorRef(namespace, name)
    message: wire.Request = rng.choice([
        wire.Stats(), wire.Heartbeat(),
        wire.Get((wire.GetItem(namespace, name, rng.random() < 0.3),)),
        wire.Reserve((wire.ReserveItem(namespace, name, dtype, shape),)),
        wire.Commit((ref,)), wire.Abort((ref,)), wire.Delete((ref,)), wire.Exists((ref,)),
        wire.Prefetch((ref,)), wire.ListTensors((wire.ListItem(namespace),)),
        wire.Release((rng.randrange(1, 1 << 20),)),
    ])
    return wire.encode_request(request_id, message)


def random_value(rng: random.Random, depth: int = 0) -> Any:
    kind = rng.randrange(9 if depth < 3 else 6)
    if kind == 0:
        return rng.choice([0, -1, 1 << 63, -(1 << 63), (1 << 64) - 1, rng.randrange(-99, 99)])
    if kind == 1:
        return rng.choice([0.0, float("nan"), float("inf"), -1e308, rng.random()])
    if kind == 2:
        return "s" * rng.choice([0, 1, 255, 1024, 70_000])
    if kind == 3:
        return bytes(rng.randrange(256) for _ in range(rng.randint(0, 32)))
    if kind == 4:
        return rng.choice([None, True, False])
    if kind == 5:
        return rng.choice(["float32", "default", "x", "\x00", "é" * 5])
    if kind == 6:
        return [random_value(rng, depth + 1) for _ in range(rng.randint(0, 6))]
    if kind == 7:
        return {str(i): random_value(rng, depth + 1) for i in range(rng.randint(0, 4))}
    return [[random_value(rng, depth + 1) for _ in range(3)] for _ in range(rng.randint(1, 3))]


def mutate(rng: random.Random, data: bytes) -> bytes:
    """`data` after one to four edits, each a byte replaced, the tail cut off, or bytes added."""
    frame = bytearray(data)

    def replace_byte() -> None:
        if frame:
            frame[rng.randrange(len(frame))] = rng.randrange(256)

    def cut_tail() -> None:
        del frame[rng.randrange(len(frame) + 1):]

    def add_bytes() -> None:
        frame.extend(rng.randbytes(rng.randint(1, 16)))

    for _ in range(rng.randint(1, 4)):
        rng.choices((replace_byte, cut_tail, add_bytes), weights=(2, 1, 1))[0]()
    return bytes(frame)


def hello(sock: zmq.Socket[bytes], secret: bytes) -> None:
    sock.send(wire.encode_request(1, wire.Hello(wire.PROTOCOL_VERSION, "fuzz", os.getpid(),
                                                psutil.Process().create_time(), secret)))
    reply = wire.decode_reply(sock.recv())
    if reply.failure is not None:
        raise SystemExit(f"the fuzzer's hello was refused: {reply.failure.message}")


def drain(sock: zmq.Socket[bytes]) -> int:
    count = 0
    while True:
        try:
            sock.recv(zmq.NOBLOCK)
            count += 1
        except zmq.Again:
            return count


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frames", type=int, default=50_000)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--sockets", type=int, default=8)
    parser.add_argument("--references", type=int, default=200)
    parser.add_argument("--sample-every", type=int, default=1000)
    parser.add_argument("--dir", default="/var/tmp")
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)
    console = Console(stderr=True)
    folder = tempfile.mkdtemp(prefix="infinity-fuzz-", dir=args.dir)
    process, config = start_daemon(folder, {
        "daemon.runtime_dir": os.path.join(folder, "rt"), "daemon.log_level": "warning",
        "cpu.budget_bytes": 256 * MiB, "cpu.segment_bytes": 32 * MiB})
    context = zmq.Context()
    sockets: list[zmq.Socket[bytes]] = []
    result: dict[str, Any] = {"frames": args.frames, "seed": args.seed}
    try:
        client = infinity.connect(config=config, name="reference")
        references = {f"ref-{i}": seeded_tensor(i) for i in range(args.references)}
        client.put_many(references, namespace=REFERENCE_NAMESPACE)
        layout = RuntimeLayout(config.daemon.runtime_dir)
        endpoint, secret = layout.control_endpoint, layout.read_secret()
        for index in range(args.sockets):
            sock = context.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RCVTIMEO, 5000)
            sock.connect(endpoint)
            if index % 2 == 0:
                hello(sock, secret)
            sockets.append(sock)
        kinds = {"garbage": 0, "mutated": 0, "confused": 0, "valid": 0}
        replies = 0
        samples: list[dict[str, int]] = []
        alive = True
        columns = (TextColumn("fuzzing"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
        with Progress(*columns, console=console) as progress:
            task = progress.add_task("frames", total=args.frames)
            for sent in range(args.frames):
                sock = sockets[sent % len(sockets)]
                kind = rng.choices(list(kinds), weights=[3, 4, 4, 1])[0]
                kinds[kind] += 1
                request_id = rng.randrange(2, 1 << 30)
                if kind == "garbage":
                    parts = [bytes(rng.randrange(256) for _ in range(rng.choice([0, 1, 9, 300,
                                                                                 4096])))
                             for _ in range(rng.choice([1, 1, 1, 3]))]
                    sock.send_multipart(parts)
                elif kind == "mutated":
                    sock.send(mutate(rng, valid_requests(rng, request_id)))
                elif kind == "confused":
                    frame = [rng.choice(OPS + [random_value(rng)]), random_value(rng),
                             random_value(rng)]
                    sock.send(msgpack.packb(frame[:rng.randint(0, 3)] if rng.random() < 0.1
                                            else frame))
                else:
                    sock.send(valid_requests(rng, request_id))
                if sent % 64 == 63:
                    replies += sum(drain(s) for s in sockets)
                if sent % args.sample_every == args.sample_every - 1:
                    if process.poll() is not None:
                        alive = False
                        break
                    samples.append(daemon_figures(process.pid))
                    progress.update(task, completed=sent + 1)
            progress.update(task, completed=args.frames)
        time.sleep(0.5)  # the last frames are served (replies are not awaited one by one)
        replies += sum(drain(s) for s in sockets)
        alive = alive and process.poll() is None
        lost = wrong = 0
        if alive:
            for name, value in references.items():
                try:
                    with client.get(name, namespace=REFERENCE_NAMESPACE) as view:
                        wrong += int(not (view.dtype == value.dtype and torch.equal(view, value)))
                except infinity.errors.NotFoundError:
                    lost += 1
            check = seeded_tensor(12345)
            client.put("after-fuzz", check, namespace="fuzz")
            with client.get("after-fuzz", namespace="fuzz") as view:
                wrong += int(not torch.equal(view, check))
            result["malformed_counted"] = client.stats()["counters"]["malformed"]
        client.close()
        warm = samples[len(samples) // 5] if samples else {}
        end = samples[-1] if samples else {}
        result.update({
            "frames_by_kind": kinds, "replies": replies, "daemon_alive": alive,
            "references": len(references), "references_lost": lost, "references_wrong": wrong,
            "after_warmup": warm, "at_end": end,
            "anon_growth_bytes": end.get("anon_bytes", 0) - warm.get("anon_bytes", 0),
            "open_files_growth": end.get("open_files", 0) - warm.get("open_files", 0),
        })
        print(json.dumps(result, indent=2))
        return 0 if alive and lost == 0 and wrong == 0 else 1
    finally:
        for sock in sockets:
            sock.close(linger=0)
        context.term()
        if process.poll() is None:
            process.terminate()
            process.wait(30)
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
