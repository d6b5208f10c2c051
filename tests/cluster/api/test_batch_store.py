"""``cluster.api.batch_store``: the Batch API's files and batches in the run directory, every
read scoped to a tenant (another tenant's id is not found), the clock injected; a file's bytes
private (0600 in a 0700 folder), a batch's output files written once, batches paged newest
first."""
from __future__ import annotations

import pytest

from cluster.api.batch_store import BatchStore, FileNotFound
from cluster.jobs.store import JobNotFound
from tests.conftest import Clock


@pytest.fixture
def clock() -> Clock:
    return Clock(1_000)


@pytest.fixture
def store(tmp_path, clock):
    store = BatchStore(tmp_path, clock)
    yield store
    store.close()


class TestFiles:
    def test_a_file_is_recorded_with_its_size_and_time_and_read_back_whole(self, store, clock):
        clock.now = 1_234
        record = store.add_file("acme", "in.jsonl", "batch", [b"ab", b"", b"cde"])
        assert (record.tenant, record.filename, record.purpose, record.bytes,
                record.created_s) == ("acme", "in.jsonl", "batch", 5, 1_234)
        assert record.file_id.startswith("file-")
        assert store.file(record.file_id, "acme") == record
        assert store.content(record.file_id, "acme") == b"abcde"

    def test_its_bytes_are_private_to_the_run_dirs_owner(self, store, tmp_path):
        record = store.add_file("acme", "in.jsonl", "batch", [b"x"])
        assert (tmp_path / "files").stat().st_mode & 0o777 == 0o700
        assert (tmp_path / "files" / record.file_id).stat().st_mode & 0o777 == 0o600
        assert (tmp_path / "batches.sqlite3").stat().st_mode & 0o777 == 0o600

    def test_another_tenants_file_is_not_found(self, store):
        record = store.add_file("acme", "in.jsonl", "batch", [b"x"])
        for read in (store.file, store.content):
            with pytest.raises(FileNotFound) as caught:
                read(record.file_id, "beta")
            assert str(caught.value) == f"file_id: no file {record.file_id!r}"

    def test_a_staged_file_is_nobodys_until_recorded(self, store):
        staged = store.write([b"abc"])
        with pytest.raises(FileNotFound):
            store.file(staged.file_id, "acme")
        assert store.record(staged, "acme", "f", "batch").bytes == 3

    def test_pieces_that_fail_leave_no_part_behind(self, store, tmp_path):
        def pieces():
            yield b"part"
            raise ValueError("over the cap")

        with pytest.raises(ValueError, match="over the cap"):
            store.write(pieces())
        assert list((tmp_path / "files").iterdir()) == []


def _batch(store: BatchStore, job_id: str, tenant: str = "acme"):
    return store.add_batch(tenant, job_id, "/v1/chat/completions", "file-in", "24h", {})


class TestBatches:
    def test_a_batch_reads_back_as_added_with_its_metadata(self, store, clock):
        clock.now = 2_000
        made = store.add_batch("acme", "job-1", "/v1/chat/completions", "file-in", "24h",
                               {"team": "a"})
        assert store.batch(made.batch_id, "acme") == made
        assert (made.job_id, made.metadata, made.created_s, made.output_file_id,
                made.error_file_id) == ("job-1", {"team": "a"}, 2_000, "", "")

    def test_another_tenants_batch_is_not_found(self, store):
        made = _batch(store, "job-1")
        with pytest.raises(JobNotFound) as caught:
            store.batch(made.batch_id, "beta")
        assert str(caught.value) == f"batch_id: no batch {made.batch_id!r}"

    def test_batches_page_newest_first_after_a_cursor(self, store):
        ids = [_batch(store, f"job-{i}").batch_id for i in range(4)]
        _batch(store, "job-b", tenant="beta")
        assert [b.batch_id for b in store.batches("acme", 2)] == [ids[3], ids[2]]
        assert [b.batch_id for b in store.batches("acme", 2, after=ids[2])] == [ids[1], ids[0]]
        assert store.batches("acme", 2, after=ids[0]) == []

    def test_a_cursor_from_another_tenant_is_not_found(self, store):
        theirs = _batch(store, "job-b", tenant="beta")
        with pytest.raises(JobNotFound):
            store.batches("acme", 10, after=theirs.batch_id)

    def test_outputs_are_written_once_and_an_empty_side_gets_no_file(self, store):
        made = _batch(store, "job-1")
        done = store.set_outputs(made, b'{"ok": 1}\n', b"")
        assert done.error_file_id == "" and done.output_file_id.startswith("file-")
        output = store.file(done.output_file_id, "acme")
        assert (output.filename, output.purpose) == (f"{made.batch_id}_output.jsonl",
                                                     "batch_output")
        assert store.content(done.output_file_id, "acme") == b'{"ok": 1}\n'
        assert store.set_outputs(done, b"other", b"errors") == done   # once only
        assert store.batch(made.batch_id, "acme") == done

    def test_a_batch_that_failed_whole_has_only_an_error_file(self, store):
        done = store.set_outputs(_batch(store, "job-1"), b"", b'{"error": 1}\n')
        assert done.output_file_id == ""
        assert store.content(done.error_file_id, "acme") == b'{"error": 1}\n'
        assert store.file(done.error_file_id, "acme").filename.endswith("_error.jsonl")
