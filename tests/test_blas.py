"""MLX must run on OpenBLAS, not the wheel's bundled reference BLAS, in every process."""
from __future__ import annotations

import subprocess
import sys
import time

import pytest

import workers  # noqa: F401  (OpenBLAS before mlx)
import mlx.core as mx

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux only")

# OpenBLAS does a 1024x1024 float32 matmul in ~15 ms here, the reference BLAS in ~500 ms.
# The bound sits far from both, so a loaded machine does not flip the verdict.
MATMUL_BOUND_S = 0.15

_PROBE = """
import time, workers, mlx.core as mx
a = mx.random.normal((1024, 1024)); b = mx.random.normal((1024, 1024)); mx.eval(a, b)
mx.eval(a @ b)
best = min((lambda t: (mx.eval(a @ b), time.perf_counter() - t)[1])(time.perf_counter())
           for _ in range(5))
maps = open('/proc/self/maps').read()
print('openblas' in maps, best)
"""


def _best_matmul_s() -> float:
    a = mx.random.normal((1024, 1024))
    b = mx.random.normal((1024, 1024))
    mx.eval(a, b, a @ b)
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        mx.eval(a @ b)
        best = min(best, time.perf_counter() - t)
    return best


def test_openblas_is_mapped_and_fast_in_this_process():
    with open("/proc/self/maps") as maps:
        assert "openblas" in maps.read()
    assert _best_matmul_s() < MATMUL_BOUND_S


def test_a_process_that_imports_workers_uses_openblas():
    out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True,
                         timeout=120, check=True).stdout.split()
    assert out[0] == "True"
    assert float(out[1]) < MATMUL_BOUND_S


def test_mlx_first_is_refused():
    code = "import mlx.core; import workers"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "import workers first" in proc.stderr
