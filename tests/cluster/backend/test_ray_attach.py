"""What a frontend attaching to ``orchard up``'s workers reads and holds
(``cluster.backend.ray_attach``): the worker directory (``RUN/workers.json``) written
privately and read back exactly, read errors that say how to fix them, and the owner's lock
that a second holder cannot take while the first lives. Attaching to live Ray actors:
``tests/cluster/backend/test_ray_backend.py``."""
from __future__ import annotations

import os
import stat

import pytest

pytest.importorskip("ray")

from cluster.backend.ray_attach import (DIRECTORY_NAME, WorkerDirectory,  # noqa: E402
                                        owner_lock)

DIRECTORY = WorkerDirectory("10.0.0.1:6379", "orchard-ab12cd34-", "5e" * 32, 4242,
                            "10.0.0.1:50051", ray_auth_mode="token", detached=True,
                            cpus_per_worker=2.0, workers_per_node=3)


class TestTheWorkerDirectory:
    def test_is_read_back_as_written(self, tmp_path):
        path = DIRECTORY.write(tmp_path)
        assert path == tmp_path / DIRECTORY_NAME
        assert WorkerDirectory.read(tmp_path) == DIRECTORY
        assert sorted(p.name for p in tmp_path.iterdir()) == [DIRECTORY_NAME]   # no .tmp left

    def test_is_readable_by_its_owner_only(self, tmp_path):
        path = DIRECTORY.write(tmp_path)
        assert stat.S_IMODE(path.stat().st_mode) == 0o600

    def test_a_missing_one_says_how_to_start_the_workers(self, tmp_path):
        with pytest.raises(ValueError) as missing:
            WorkerDirectory.read(tmp_path)
        assert str(missing.value) == (
            f"no Ray workers to attach to in {tmp_path} (no workers.json): start them with "
            f"`orchard up --detach --run-dir {tmp_path}`")

    @pytest.mark.parametrize("text", ['{"ray_address": "a"}', "not json",
                                      '{"ray_address": "a", "names": "n", "secret": "zz", '
                                      '"owner_pid": 1, "owner": "o"}'])
    def test_a_broken_one_is_refused_naming_the_file(self, tmp_path, text):
        (tmp_path / DIRECTORY_NAME).write_text(text)
        with pytest.raises(ValueError, match=f"^{tmp_path / DIRECTORY_NAME} is not a worker "
                                             r"directory \(.*\); `orchard up` writes it anew"):
            WorkerDirectory.read(tmp_path)

    def test_forgetting_removes_it_and_forgetting_twice_is_no_error(self, tmp_path):
        DIRECTORY.write(tmp_path)
        WorkerDirectory.forget(tmp_path)
        WorkerDirectory.forget(tmp_path)
        assert list(tmp_path.iterdir()) == []


class TestTheOwnerLock:
    def test_a_second_holder_is_refused_while_the_first_lives(self, tmp_path):
        first = owner_lock(tmp_path)
        try:
            assert first is not None
            assert owner_lock(tmp_path, wait=False) is None
        finally:
            os.close(first)
        second = owner_lock(tmp_path, wait=False)   # the owner gone: free
        assert second is not None
        os.close(second)
