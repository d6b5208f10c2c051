"""``orchard demo``, the main job, end to end: a local cluster of 2 workers serves the demo batch
from ``examples/`` through the public API, prints its summary and stops (tiny forged model)."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from cluster.config import write_default_config
from cluster.daemon import STATE_NAME
from tests.forged_models import tiny_model

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_demo_serves_the_batch_with_prefix_hits_and_stops(tmp_path):
    write_default_config(tmp_path, model_dir=str(tiny_model()))
    done = subprocess.run([sys.executable, "-m", "cluster.cli", "demo", "--run-dir", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    out = done.stdout
    assert re.search(r"requests\s+24 \(0 failed", out), out
    hit = float(re.search(r"hit ratio\s+([\d.]+)%", out).group(1))
    assert hit > 20.0, "conversations sharing system prompts must hit the prefix stores"
    cached = int(re.search(r"cached tokens\s+(\d+)", out).group(1))
    computed = int(re.search(r"computed tokens\s+(\d+)", out).group(1))
    prompt = int(re.search(r"prompt tokens\s+(\d+)", out).group(1))
    assert cached + computed == prompt
    served = {w: int(n) for w, n in re.findall(r"(w\d+): (\d+)", out.split("per worker")[1])}
    assert sum(served.values()) == 24 and set(served) <= {"w0", "w1"}
    assert "cluster stopped" in out and not (tmp_path / STATE_NAME).exists()
