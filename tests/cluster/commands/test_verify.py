"""``orchard verify`` (``cluster.commands.verify``): the sizes it refuses before any model
loads. Whether cached and uncached generation agree is ``workers.lab.verify``'s, tested in
``tests/workers/lab/test_verify.py``."""
from __future__ import annotations

import pytest

from cluster.cli import main


class TestWhatItRefuses:
    @pytest.mark.parametrize("extra", [["--block-size", "0"], ["--max-tokens", "0"],
                                       ["--block-size", "-16"]])
    def test_a_block_or_reply_of_no_tokens(self, tmp_path, capsys, extra):
        assert main(["verify", "--model", str(tmp_path), *extra]) == 2
        assert capsys.readouterr().err == (
            "orchard: error: --block-size and --max-tokens must be positive\n")

    def test_one_token_each_passes_the_check(self, tmp_path, capsys):
        assert main(["verify", "--model", str(tmp_path / "none"), "--block-size", "1",
                     "--max-tokens", "1"]) == 2
        assert "must be positive" not in capsys.readouterr().err
