"""A real ext4 file system on a loop device, whose faults a test causes for real.

`loop_ext4()` makes a small image file on the real disk, formats it, attaches it to a loop
device and mounts it with `errors=remount-ro` (what a store's file system should be mounted
with); the test gets a `LoopFs` and, through it, faults that take the kernel's own paths:

- `make_read_only()`: ext4's error path (`/sys/fs/ext4/<dev>/trigger_fs_error`, what ext4
  does when it finds its metadata damaged or a journal write fails): with errors=remount-ro
  the file system turns read-only at once, and every write, fdatasync and create gets EROFS;
- `shut_down()`: `EXT4_IOC_SHUTDOWN` without flushing the log (xfstests' "godown"), which
  stands in for a device that died: every read, write and fdatasync gets EIO from then on;
- `fail_writes()` / `heal()`: the loop device's writes fail at the block layer (its image
  file is made immutable, so the loop driver's writes to it are refused): "I/O error, dev
  loopN ... op WRITE" in the kernel log, what dm-flakey's error_writes does. ext4 reports it
  as EIO, to an O_DIRECT write at once, and to the fdatasync after buffered writes (once);
- `repair()`: unmount, `e2fsck -fy` and mount again (only when nothing holds files open);
  also what drops the page cache, so what is read next comes from the device.

Everything is undone on exit, whatever happened: the mount, the loop device, the image. A
test skips, saying why, where it cannot run (not root, no losetup / mkfs.ext4 / mount).
"""

from __future__ import annotations

import fcntl
import os
import shutil
import struct
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

MiB = 1024 * 1024
EXT4_IOC_SHUTDOWN = 0x8004587D  # _IOR('X', 125, __u32)
EXT4_GOING_FLAGS_NOLOGFLUSH = 2
_TOOLS = ("losetup", "mkfs.ext4", "mount", "umount", "e2fsck", "chattr")


def _run(*command: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command, capture_output=True, text=True)


class LoopFs:
    """A mounted ext4 on a loop device; `path` is its mount folder (empty but for lost+found)."""

    def __init__(self, image: str, device: str, path: str) -> None:
        self.image = image
        self.device = device
        self.path = path
        self.mounted = False
        self._immutable = False

    def mount(self) -> None:
        # commit=300: the journal commits only when a sync asks for it, never on its own timer
        # while `fail_writes` lasts (a failed journal write would turn the file system
        # read-only, a fault other than the one the test means).
        done = _run("mount", "-t", "ext4", "-o", "errors=remount-ro,commit=300", self.device,
                    self.path)
        if done.returncode != 0:
            raise AssertionError(f"mount {self.device} failed: {done.stderr.strip()}")
        self.mounted = True

    @property
    def options(self) -> list[str]:
        """The mount's options as the kernel shows them now (`ro`, `emergency_ro`, `shutdown`)."""
        with open("/proc/self/mountinfo") as f:
            for line in f:
                fields = line.split()
                if fields[4] == self.path:
                    superblock = line.split(" - ")[1].split()[2]
                    return fields[5].split(",") + superblock.split(",")
        return []

    def make_read_only(self) -> None:
        """ext4's real error path: with errors=remount-ro the file system is read-only at once."""
        trigger = f"/sys/fs/ext4/{os.path.basename(self.device)}/trigger_fs_error"
        if not os.path.exists(trigger):
            pytest.skip(f"this kernel has no {trigger}; the test needs it to turn ext4 read-only")
        with open(trigger, "w") as f:
            f.write("infinity test: turn read-only")
        # (6.x kernels show it as the superblock's `emergency_ro`; older ones as `ro`)
        assert {"ro", "emergency_ro"} & set(self.options), f"{self.path} is writable: {self.options}"

    def shut_down(self) -> None:
        """A dead device, as ext4 shows it: every I/O on the file system is EIO from now on."""
        fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.ioctl(fd, EXT4_IOC_SHUTDOWN, struct.pack("I", EXT4_GOING_FLAGS_NOLOGFLUSH))
        finally:
            os.close(fd)

    def fail_writes(self) -> None:
        """The device refuses every write from now on, until `heal()`; reads still work."""
        done = _run("chattr", "+i", self.image)
        if done.returncode != 0:
            pytest.skip(f"chattr +i is refused on {self.image} ({done.stderr.strip()}): the "
                        f"loop image must be on a file system with the immutable flag")
        self._immutable = True

    def heal(self) -> None:
        """The device writes again (after `fail_writes`)."""
        if self._immutable:
            subprocess.run(["chattr", "-i", self.image], check=True)
            self._immutable = False

    def repair(self) -> None:
        """Unmount, check and fix the file system (`e2fsck -fy`), and mount it again; the page
        cache goes with the unmount. Stop every process that holds a file there first."""
        self.heal()
        self.unmount()
        checked = _run("e2fsck", "-fy", self.device)
        if checked.returncode not in (0, 1):  # 1: errors fixed
            raise AssertionError(f"e2fsck {self.device} exited {checked.returncode}:\n"
                                 f"{checked.stdout}{checked.stderr}")
        self.mount()

    def unmount(self) -> None:
        if self.mounted:
            done = _run("umount", self.path)
            if done.returncode != 0:  # still busy (a process left behind): detach it anyway
                _run("umount", "-l", self.path)
            self.mounted = False

    def available_bytes(self) -> int:
        stat = os.statvfs(self.path)
        return stat.f_bavail * stat.f_frsize


@contextmanager
def loop_ext4(size_bytes: int = 48 * MiB, *, under: str) -> Iterator[LoopFs]:
    """A fresh ext4 of `size_bytes` on a loop device, its image in a new folder `under` (a real
    disk's folder, not a tmpfs: `fail_writes` needs the immutable flag), mounted; everything is
    removed afterwards."""
    if os.geteuid() != 0:
        pytest.skip("a loop-device file system needs root (losetup, mount)")
    missing = [tool for tool in _TOOLS if shutil.which(tool) is None]
    if missing:
        pytest.skip(f"a loop-device file system needs {', '.join(missing)}, not installed here")
    folder = tempfile.mkdtemp(prefix="infinity-loop-", dir=under)
    image, path = os.path.join(folder, "ext4.img"), os.path.join(folder, "mnt")
    os.mkdir(path)
    fs: LoopFs | None = None
    try:
        with open(image, "wb") as f:
            f.truncate(size_bytes)
        made = _run("mkfs.ext4", "-q", "-F", image)
        if made.returncode != 0:
            pytest.skip(f"mkfs.ext4 failed here: {made.stderr.strip()}")
        attached = _run("losetup", "--find", "--show", image)
        if attached.returncode != 0:
            pytest.skip(f"no loop device here (losetup: {attached.stderr.strip()})")
        fs = LoopFs(image, attached.stdout.strip(), path)
        fs.mount()
        yield fs
    finally:
        if fs is not None:
            fs.heal()
            fs.unmount()
            _run("losetup", "-d", fs.device)
        shutil.rmtree(folder, ignore_errors=True)
