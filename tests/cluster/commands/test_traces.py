"""``orchard traces gather`` (``cluster.commands.traces``): without a running cluster or a Ray
address it says how to get one. Gathering itself (through Ray) is tested in
``tests/cluster/telemetry/test_gather.py``."""
from __future__ import annotations

from cluster.cli import main


class TestWhatItRefuses:
    def test_no_cluster_and_no_ray_address(self, tmp_path, capsys):
        assert main(["traces", "gather", "--run-dir", str(tmp_path),
                     "--out", str(tmp_path / "out")]) == 2
        assert capsys.readouterr().err == (
            f"orchard: error: no cluster is running from {tmp_path} (no cluster.json): start "
            f"it with `orchard up --run-dir {tmp_path}` or pass --ray-address\n")
        assert not (tmp_path / "out").exists()
