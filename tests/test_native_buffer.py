"""AlignedBuffer: alignment, zero fill, the buffer protocol, mlock errors."""

from __future__ import annotations

import gc
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from infinity import _native

REPO = Path(__file__).resolve().parents[1]


def test_address_is_page_aligned_and_memory_zeroed() -> None:
    buf = _native.AlignedBuffer(12345)
    assert buf.address % 4096 == 0
    assert buf.nbytes == len(buf) == 12345
    assert bytes(memoryview(buf)) == bytes(12345)


def test_larger_alignment_is_honoured() -> None:
    buf = _native.AlignedBuffer(5000, alignment=2 << 20)
    assert buf.address % (2 << 20) == 0
    assert bytes(memoryview(buf)) == bytes(5000)


def test_alignment_must_be_a_power_of_two() -> None:
    with pytest.raises(ValueError, match="power of two"):
        _native.AlignedBuffer(4096, alignment=3000)


def test_buffer_protocol_is_writable() -> None:
    buf = _native.AlignedBuffer(4096)
    view = memoryview(buf)
    assert not view.readonly and view.format == "B"
    view[10:13] = b"abc"
    assert bytes(memoryview(buf)[10:13]) == b"abc"


def test_torch_frombuffer_view_keeps_the_buffer_alive() -> None:
    buf = _native.AlignedBuffer(1 << 20)
    t = torch.frombuffer(buf, dtype=torch.uint8)
    address = buf.address
    del buf
    gc.collect()
    t.fill_(7)
    assert t.data_ptr() == address
    assert int(t.sum()) == 7 << 20


def test_zero_bytes_still_gives_a_valid_address() -> None:
    buf = _native.AlignedBuffer(0)
    assert buf.nbytes == 0 and buf.address % 4096 == 0 and buf.address != 0


def test_lock_true_locks_the_pages() -> None:
    buf = _native.AlignedBuffer(1 << 20, lock=True)
    assert buf.locked


@pytest.mark.skipif(shutil.which("setpriv") is None, reason="needs setpriv (util-linux) to drop CAP_IPC_LOCK")
def test_mlock_failure_names_rlimit_memlock_and_ulimit() -> None:
    # Root ignores RLIMIT_MEMLOCK through CAP_IPC_LOCK, so the child drops it.
    script = textwrap.dedent(
        """
        import resource
        from infinity import _native
        resource.setrlimit(resource.RLIMIT_MEMLOCK, (65536, 65536))
        try:
            _native.AlignedBuffer(8 << 20, lock=True)
        except OSError as exc:
            print("ERRNO", exc.errno)
            print(exc)
        else:
            print("LOCKED")
        """
    )
    proc = subprocess.run(
        ["setpriv", "--bounding-set=-ipc_lock", "--inh-caps=-ipc_lock", sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )
    if proc.returncode != 0 and "setpriv" in proc.stderr:
        pytest.skip(f"setpriv cannot drop capabilities here: {proc.stderr.strip()}")
    assert proc.returncode == 0, proc.stderr
    assert "LOCKED" not in proc.stdout
    assert "RLIMIT_MEMLOCK" in proc.stdout and "ulimit -l" in proc.stdout
