"""``infra/netns_pull.py``: a pull between two workers in two namespaces, its command line and
the request both sides run. The run itself needs root and namespaces
(``tests/cluster/backend/test_pull.py``)."""
from __future__ import annotations

import pytest

from router.kv.key import Namespace
from tests.support.netns_hosts import load_infra

netns_pull = load_infra("netns_pull")
BASE = ["--model", "m", "--host", "10.213.1.2", "--secret", "ab"]


class TestTheCommandLine:
    def test_a_holder_with_its_defaults(self):
        args = netns_pull.parse(["holder", *BASE])
        assert (args.role, args.link, args.tokens, args.vocab, args.seed, args.max_tokens) == (
            "holder", "10gbit", 200, 250, 7, 8)

    def test_a_receiver_needs_the_holders_host_and_port(self, capsys):
        with pytest.raises(SystemExit) as refused:
            netns_pull.parse(["receiver", *BASE, "--holder", "10.213.1.1"])
        assert refused.value.code == 2
        assert "receiver: --holder HOST:PORT is required" in capsys.readouterr().err
        assert netns_pull.parse(["receiver", *BASE, "--holder", "10.213.1.1:7000"]).holder == (
            "10.213.1.1:7000")

    def test_a_prompt_shorter_than_a_block_is_refused(self, capsys):
        with pytest.raises(SystemExit):
            netns_pull.parse(["holder", *BASE, "--tokens", "15"])
        assert "--tokens must be at least one block (16)" in capsys.readouterr().err
        assert netns_pull.parse(["holder", *BASE, "--tokens", "16"]).tokens == 16


class TestTheRequest:
    def test_both_sides_draw_the_same_prompt_from_the_seed(self):
        args = netns_pull.parse(["holder", *BASE, "--tokens", "32", "--vocab", "5",
                                 "--max-tokens", "3"])
        ns = Namespace("t", "m", "r")
        held, pulled = netns_pull._request(ns, "held", args), netns_pull._request(ns, "pulled", args)
        assert held.prompt == pulled.prompt and len(held.prompt) == 32
        assert set(held.prompt) <= {1, 2, 3, 4}
        assert (held.request_id, held.sampling.max_tokens) == ("held", 3)
