"""The job store's schema (``cluster.jobs.schema``) on plain SQLite connections: a new store's
tables and version, a store from a newer orchard refused, an older store's columns added with
their defaults, and a failed upgrade leaving the store as it was."""
from __future__ import annotations

import sqlite3

import pytest

from cluster.jobs.schema import VERSION, open_schema

V2_JOBS = """CREATE TABLE jobs (
    job_id TEXT PRIMARY KEY, tenant TEXT NOT NULL, state TEXT NOT NULL, total INTEGER NOT NULL,
    model TEXT NOT NULL, created_ms INTEGER NOT NULL, finished_ms INTEGER NOT NULL DEFAULT 0,
    completed INTEGER NOT NULL DEFAULT 0, failed INTEGER NOT NULL DEFAULT 0)"""


def _db(tmp_path) -> sqlite3.Connection:
    return sqlite3.connect(tmp_path / "jobs.sqlite3", isolation_level=None)


def _tables(db: sqlite3.Connection) -> list[str]:
    return [r[0] for r in db.execute(
        "SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name")]


class TestNewStore:
    def test_a_new_store_has_every_table_at_this_version(self, tmp_path):
        db = _db(tmp_path)
        open_schema(db)
        assert _tables(db) == ["frontends", "intakes", "job_keys", "job_requests", "jobs",
                               "results"]
        assert db.execute("PRAGMA user_version").fetchone()[0] == VERSION == 4
        assert db.execute("PRAGMA auto_vacuum").fetchone()[0] == 2  # incremental
        open_schema(db)  # at this version already: nothing to do
        assert db.execute("PRAGMA user_version").fetchone()[0] == 4

    def test_a_store_from_a_newer_orchard_is_refused_saying_so(self, tmp_path):
        db = _db(tmp_path)
        db.execute("PRAGMA user_version = 5")
        with pytest.raises(ValueError, match=r"^the job store was written by a newer orchard "
                                             r"\(schema 5, this one knows 4\); upgrade orchard$"):
            open_schema(db)
        assert _tables(db) == []


class TestUpgrade:
    def test_a_version_2_store_gets_owner_and_priority_with_their_defaults(self, tmp_path):
        db = _db(tmp_path)
        db.execute(V2_JOBS)
        db.execute("INSERT INTO jobs VALUES ('job-1', 'acme', 'queued', 3, 'm', 5, 0, 1, 0)")
        db.execute("PRAGMA user_version = 2")
        open_schema(db)
        assert db.execute("SELECT job_id, owner, priority FROM jobs").fetchall() == [
            ("job-1", "", "batch")]
        assert db.execute("PRAGMA user_version").fetchone()[0] == 4
        assert "frontends" in _tables(db)

    def test_a_version_1_store_gets_its_counts_from_its_results(self, tmp_path):
        db = _db(tmp_path)
        db.execute(V2_JOBS.replace(",\n    completed INTEGER NOT NULL DEFAULT 0, failed INTEGER "
                                   "NOT NULL DEFAULT 0", ""))
        db.execute("CREATE TABLE results (job_id TEXT, seq INTEGER, idx INTEGER, ok INTEGER, "
                   "body TEXT)")
        db.execute("INSERT INTO jobs VALUES ('job-1', 'acme', 'running', 4, 'm', 5, 0)")
        db.executemany("INSERT INTO results VALUES ('job-1', ?, ?, ?, '{}')",
                       [(0, 0, 1), (1, 1, 0), (2, 2, 1)])
        open_schema(db)
        assert db.execute("SELECT completed, failed, owner FROM jobs").fetchall() == [(2, 1, "")]

    def test_a_failed_upgrade_leaves_the_store_as_it_was(self, tmp_path):
        db = _db(tmp_path)
        db.execute(V2_JOBS)
        db.execute("CREATE TABLE results (job_id TEXT, seq INTEGER, idx INTEGER, ok INTEGER, "
                   "body TEXT)")
        db.execute("CREATE TABLE requests (job_id TEXT, idx INTEGER, custom_id TEXT, "
                   "prompt TEXT, sampling TEXT)")
        db.execute("INSERT INTO requests VALUES ('job-1', 0, 'a', '[1]', 'not json')")
        with pytest.raises(ValueError):
            open_schema(db)
        assert _tables(db) == ["jobs", "requests", "results"]
        assert db.execute("PRAGMA user_version").fetchone()[0] == 0
        assert not db.in_transaction
