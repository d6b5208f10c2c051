"""The run directory is the owner's alone: 0700, files 0600, and a refusal naming the fix."""
from tests.support.paths import REPO
import os
import stat
import subprocess
import sys

import pytest

from cluster.api.client import token_request
from cluster.rundir import check_private, make_private, narrow_files
from tests.support.forged_models import tiny_model
from tests.support.frontend_harness import ACME_CONFIG, running_frontend


def _mode(path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_a_run_directory_others_can_read_is_refused_with_the_fix(tmp_path):
    run_dir = tmp_path / "run dir"
    run_dir.mkdir()
    run_dir.chmod(0o755)
    with pytest.raises(ValueError) as err:
        check_private(run_dir)
    assert str(err.value) == (
        f"the run directory {run_dir} is open to other users (mode 0755); it holds every "
        f"tenant's prompts, outputs and API keys. Fix it with: chmod -R go-rwx '{run_dir}'")
    subprocess.run(["chmod", "-R", "go-rwx", str(run_dir)], check=True)  # the fix given works
    check_private(run_dir)


def test_files_are_narrowed_to_the_owner(tmp_path):
    (tmp_path / "traces").mkdir()
    (tmp_path / "traces").chmod(0o755)  # whatever the umask an earlier test left
    (tmp_path / "traces" / "a.jsonl").write_text("{}")
    (tmp_path / "traces" / "a.jsonl").chmod(0o644)
    (tmp_path / "orchard.toml").write_text("")
    (tmp_path / "orchard.toml").chmod(0o600)
    assert sorted(p.name for p in narrow_files(tmp_path)) == ["a.jsonl", "traces"]
    assert _mode(tmp_path / "traces") == 0o700
    assert _mode(tmp_path / "traces" / "a.jsonl") == 0o600


def test_make_private_creates_0700_and_files_come_out_0600(tmp_path):
    script = (
        "import sys, sqlite3\n"
        "from pathlib import Path\n"
        "from cluster.rundir import make_private\n"
        "run = Path(sys.argv[1]); make_private(run)\n"
        "(run / 'x.txt').write_text('x')\n"
        "sqlite3.connect(run / 'db.sqlite3').execute('create table t (x)')\n")
    run_dir = tmp_path / "fresh" / "run"
    subprocess.run([sys.executable, "-c", script, str(run_dir)], check=True,
                   cwd=str(REPO))
    assert _mode(run_dir) == 0o700
    assert {p.name: _mode(p) for p in run_dir.iterdir()} == {"x.txt": 0o600, "db.sqlite3": 0o600}


def test_the_frontend_refuses_an_open_run_directory(tmp_path):
    run_dir = tmp_path / "open"
    run_dir.mkdir(mode=0o755)
    run_dir.chmod(0o755)
    (run_dir / "orchard.toml").write_text(ACME_CONFIG)
    with pytest.raises(ValueError, match=r"open to other users \(mode 0755\).*chmod -R go-rwx"):
        with running_frontend(run_dir, tiny_model(), workers=1):
            pass
    assert not (run_dir / "jobs.sqlite3").exists()


def test_everything_a_serving_frontend_writes_is_the_owners_alone(tmp_path):
    run_dir = tmp_path / "run"
    make_private(run_dir)
    (run_dir / "orchard.toml").write_text(ACME_CONFIG)
    os.umask(0o022)  # as a user's shell has it: the frontend must not depend on it
    (run_dir / "orchard.toml").chmod(0o644)
    with running_frontend(run_dir, tiny_model(), workers=1) as api:
        with api.client("acme") as acme:
            job = acme.submit([token_request("a", [1, 2, 3], 2)])
            acme.wait(job.job_id, poll_s=0.05, timeout_s=60)
    os.umask(0o022)
    modes = {str(p.relative_to(run_dir)): _mode(p) for p in run_dir.rglob("*")}
    assert "jobs.sqlite3" in modes and any(name.startswith("traces/") for name in modes)
    assert {name: mode for name, mode in modes.items()
            if mode != (0o700 if (run_dir / name).is_dir() else 0o600)} == {}
    assert _mode(run_dir) == 0o700
