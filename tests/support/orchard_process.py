"""``orchard`` run as its own process, the way an operator runs it (``python -m cluster.cli``)."""
from __future__ import annotations

import subprocess
import sys

from tests.support.paths import REPO


def orchard(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cluster.cli", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)
