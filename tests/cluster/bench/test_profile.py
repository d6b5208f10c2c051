"""``orchard bench profile`` (``cluster.bench.profile``): the command writes a profile the
simulator reads, and refuses a grid it cannot measure before any model loads."""
import pytest

from cluster.cli import main
from router.sim.service import EngineProfile
from tests.support.forged_models import tiny_model


class TestTheCommand:
    def test_the_profile_command_writes_a_profile_the_simulator_reads(self, tmp_path, capsys):
        from cluster.cli import main

        out = tmp_path / "profile.json"
        assert main(["bench", "profile", "--model", str(tiny_model()), "--out", str(out),
                     "--block-size", "4", "--max-batch", "2", "--new-tokens", "4,8",
                     "--cached-tokens", "0,8", "--batch-sizes", "1,2", "--contexts", "8,16",
                     "--draft-widths", "2", "--decode-steps", "2", "--repeats", "1"]) == 0
        assert f"(block 4) to {out}" in capsys.readouterr().out
        assert EngineProfile.read(out).batch_sizes == (1, 2)
        assert EngineProfile.read(out).draft_widths == (2,)


class TestWhatItRefuses:
    @pytest.mark.parametrize("extra, message", [
        (["--block-size", "0"], "--block-size and --max-batch must be positive"),
        (["--max-batch", "0"], "--block-size and --max-batch must be positive"),
        (["--contexts", "8,x"], "--contexts must be comma-separated integers, got '8,x'"),
        (["--draft-widths", "1.5"], "--draft-widths must be comma-separated integers, got '1.5'"),
        (["--batch-sizes", "1,2,4", "--max-batch", "2"],
         "--batch-sizes goes to 4 but --max-batch is 2: the engine never runs a bigger batch"),
    ])
    def test_bad_grids_are_refused_with_the_fix(self, tmp_path, capsys, extra, message):
        out = tmp_path / "profile.json"
        assert main(["bench", "profile", "--model", str(tmp_path / "no-model"), "--out", str(out),
                     *extra]) == 2
        assert capsys.readouterr().err == f"orchard: error: {message}\n"
        assert not out.exists()
