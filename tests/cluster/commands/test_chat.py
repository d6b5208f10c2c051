"""``orchard chat`` (``cluster.commands.chat``): the turns and reply length it accepts, checked
before any model loads. The chat itself is ``workers.engine.chat``'s."""
from __future__ import annotations

import pytest

from cluster.cli import main
from cluster.commands.chat import QUESTIONS

REFUSED = "orchard: error: --turns must be 1..6 and --max-tokens positive\n"


class TestWhatItRefuses:
    @pytest.mark.parametrize("extra", [["--turns", "0"], ["--turns", "7"],
                                       ["--max-tokens", "0"]])
    def test_turns_past_its_questions_or_no_reply_tokens(self, tmp_path, capsys, extra):
        assert len(QUESTIONS) == 6
        assert main(["chat", "--model", str(tmp_path / "none"), *extra]) == 2
        assert capsys.readouterr().err == REFUSED

    @pytest.mark.parametrize("turns", ["1", "6"])
    def test_the_first_and_last_question_pass_the_check(self, tmp_path, capsys, turns):
        # past the check the engine opens the model: a missing directory is what it refuses
        assert main(["chat", "--model", str(tmp_path / "none"), "--turns", turns]) == 2
        assert capsys.readouterr().err != REFUSED
