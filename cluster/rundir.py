"""The run directory's privacy: every tenant's prompts and outputs live in it.

``jobs.sqlite3`` holds each request's prompt and result, the trace and metric files hold
decoded text around cache misses, and ``orchard.toml`` holds the API keys. So the directory is
``0700`` and every file in it ``0600``:

- ``make_private(run_dir)`` runs before a serving process writes anything there: it sets the
  process's umask to ``077`` (so SQLite's journal files, traces and metrics, and the files of
  every process started afterwards, Ray's workers included, are created for the owner only),
  creates the directory ``0700`` if it is missing, and refuses, with the command that fixes
  it, a directory that others can read or enter; files already in it that others could read
  are narrowed to ``0600``.
"""
from __future__ import annotations

import os
import stat
from pathlib import Path

PRIVATE_UMASK = 0o077
DIR_MODE = 0o700


def make_private(run_dir: Path) -> None:
    """Make ``run_dir`` the owner's alone, or raise ``ValueError`` saying how."""
    os.umask(PRIVATE_UMASK)
    run_dir.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
    check_private(run_dir)
    narrow_files(run_dir)


def check_private(run_dir: Path) -> None:
    mode = stat.S_IMODE(run_dir.stat().st_mode)
    if mode & 0o077:
        raise ValueError(
            f"the run directory {run_dir} is open to other users (mode {mode:04o}); it holds "
            f"every tenant's prompts, outputs and API keys. Fix it with: "
            f"chmod -R go-rwx {_shell_quoted(run_dir)}")


def narrow_files(run_dir: Path) -> list[Path]:
    """Take group and other permissions off what is under ``run_dir``; returns what changed."""
    changed = []
    for root, dirs, files in os.walk(run_dir):
        for name in (*dirs, *files):
            path = Path(root) / name
            try:
                info = path.lstat()
            except FileNotFoundError:  # removed meanwhile
                continue
            if stat.S_ISLNK(info.st_mode) or not stat.S_IMODE(info.st_mode) & 0o077:
                continue
            path.chmod(stat.S_IMODE(info.st_mode) & 0o700)
            changed.append(path)
    return changed


def _shell_quoted(path: Path) -> str:
    text = str(path)
    return text if all(c.isalnum() or c in "/._-" for c in text) else "'" + text.replace(
        "'", "'\\''") + "'"
