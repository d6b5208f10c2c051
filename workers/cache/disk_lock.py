"""The disk tier's hold on its directory: an exclusive ``flock`` on ``.lock``, one worker each.

``lock_directory`` creates the directory, takes the lock (a second worker pointed at the same
directory is refused, naming the holder's pid) and proves that files can be created there;
the tier keeps the descriptor open while it runs and closing it releases the lock.
"""
from __future__ import annotations

import fcntl
import os
from pathlib import Path

LOCK_NAME = ".lock"


class DiskDirError(ValueError):
    """The disk tier's directory cannot be used (not writable, or another worker holds it)."""


def lock_directory(directory: Path) -> int:
    """Create ``directory`` and hold its lock; ``DiskDirError`` saying what to change."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd = os.open(directory / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        raise DiskDirError(
            f"cannot use {directory} for the disk tier: {exc.strerror or exc}; set [cache] "
            f"disk_dir to a directory this worker can write, or disk_bytes = 0") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 32).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise DiskDirError(
            f"{directory} is in use by another worker (pid {holder}): give each worker its "
            f"own [cache] disk_dir") from None
    os.ftruncate(fd, 0)
    os.write(fd, str(os.getpid()).encode())
    probe = directory / f".probe-{os.getpid()}"
    try:  # the lock file may exist already: prove that this process can create files here
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        os.close(fd)
        raise DiskDirError(f"cannot write to {directory} for the disk tier: "
                           f"{exc.strerror or exc}; set [cache] disk_dir to a writable "
                           f"directory, or disk_bytes = 0") from None
    return fd
