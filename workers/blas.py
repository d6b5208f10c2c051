"""Make MLX's CPU backend use OpenBLAS on Linux, in every process that imports ``workers``.

The Linux ``mlx[cpu]`` wheel links the reference BLAS, about 25x slower than OpenBLAS for
matmuls. Loading Debian's OpenBLAS with ``RTLD_GLOBAL`` *before* ``mlx`` is first imported makes
its ``cblas_*`` symbols win. ``workers/__init__.py`` calls :func:`ensure_openblas`, so every
process that reaches MLX through ``workers`` (the CLI, tests, Ray actor processes) gets it.
On macOS MLX uses Accelerate and Metal, and none of this applies.
"""
from __future__ import annotations

import ctypes
import os
import sys

OPENBLAS_PATHS = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libblas.so.3",
)

_loaded: str | None = None


def ensure_openblas() -> str | None:
    """Load OpenBLAS globally on Linux; return its path, or None where it does not apply.

    Raises ``RuntimeError`` if ``mlx`` was imported first (too late to swap BLAS), and when
    OpenBLAS is missing on Linux, with the package to install.
    """
    global _loaded
    if _loaded is not None or not sys.platform.startswith("linux"):
        return _loaded
    path = next((p for p in OPENBLAS_PATHS if os.path.exists(p)), None)
    if path is None:
        raise RuntimeError(
            "OpenBLAS not found: install Debian's libopenblas0-pthread "
            "(apt-get install -y libopenblas0-pthread); MLX's bundled BLAS is ~25x slower")
    if "mlx.core" in sys.modules and not _maps_contain("openblas"):
        raise RuntimeError("mlx was imported before workers.blas: import workers first")
    ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    _loaded = path
    return path


def _maps_contain(fragment: str) -> bool:
    try:
        with open("/proc/self/maps", encoding="utf-8") as maps:
            return any(fragment in line for line in maps)
    except OSError:
        return False


def openblas_in_use() -> bool:
    """True when this process has OpenBLAS mapped (always True off Linux)."""
    return not sys.platform.startswith("linux") or _maps_contain("openblas")
