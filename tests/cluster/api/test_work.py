"""``cluster.api.work``: the one path a job or a request takes whatever protocol carried it.

A request's tokenizing runs off the event loop (the tokenizer's pool): a 1 MiB prompt held
in the tokenizer stalls no other tenant's calls (a real frontend over a LocalBackend, its
tokenizer a ``HeldTokenizer``). And, read from the source, ``Work`` reaches the jobs room
through its public interfaces only.
"""
from __future__ import annotations

import ast
import re
import threading
import time

import pytest

from cluster.api.client import OrchardError, chat_request
from tests.support.grpc_api import FILLER, MIB, held_frontend
from tests.support.paths import REPO

API = REPO / "cluster" / "api"


@pytest.fixture(scope="module")
def api_hostile(tmp_path_factory):
    with held_frontend(tmp_path_factory) as harness:
        yield harness


class TestTokenizingOffTheLoop:
    def test_a_1_mib_prompt_does_not_stall_another_tenants_calls(self, api_hostile):
        text = (FILLER * (MIB // len(FILLER) + 1))[:MIB]
        big: dict = {}

        def send_big() -> None:
            with api_hostile.client("acme") as acme:
                try:
                    list(acme.generate(chat_request("", [{"role": "user", "content": text}], 4)))
                except OrchardError as exc:
                    big["error"] = (exc.code, exc.message)
                big["done"] = time.perf_counter()

        held = api_hostile.tokenizer
        held.entered.clear()
        held.release.clear()   # the big prompt stays in the tokenizer until beta is answered
        try:
            with api_hostile.client("beta") as beta:
                beta.jobs()  # connected before the big prompt goes out
                thread = threading.Thread(target=send_big)
                thread.start()
                assert held.entered.wait(60), "the big prompt never reached the tokenizer"
                for i in range(5):  # answered while the big prompt is being tokenized
                    beta.jobs()
                    events = list(beta.generate(chat_request(f"s{i}", [{"role": "user",
                                                                      "content": "hi"}], 1)))
                    assert events[-1].result.ok
                assert "done" not in big, "the big prompt finished before the small calls"
        finally:
            held.release.set()
        thread.join(60)
        assert big["error"][0] == "INVALID_ARGUMENT"
        assert re.fullmatch(r"request\.prompt: \d+ tokens reach the model's context "
                            r"of 2048; shorten the prompt", big["error"][1]), big["error"][1]


class TestBoundaries:
    def test_work_reaches_the_jobs_room_through_its_public_interfaces_only(self):
        tree = ast.parse((API / "work.py").read_text())
        imported = {(node.module, a.name) for node in ast.walk(tree)
                    if isinstance(node, ast.ImportFrom) and node.module.startswith("cluster.jobs")
                    for a in node.names}
        assert imported == {("cluster.jobs.direct", "DirectRequests"),
                            ("cluster.jobs.store", "JobRecord"), ("cluster.jobs.store", "StoredResult")}

