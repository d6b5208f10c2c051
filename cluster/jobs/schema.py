"""The job store's SQLite schema, and the upgrade of a store written by an older orchard.

    jobs          job_id ─┬─ tenant, state, total, completed, failed, model, created/finished,
                          └─ owner, priority ("batch" or "interactive": its requests' lane)
    job_requests  (job_id, prefix, idx) ─ custom_id, body: each request stored once, as sent
    results       (job_id, seq) ─ idx (unique per job), the result as JSON: appended
    job_keys      (tenant, idempotency_key) ─ job_id: a retried submission finds its first job
    intakes       job_id ─ a job whose requests are being stored; it has no ``jobs`` row yet
    frontends     frontend_id ─ expires_ms, address: each serving frontend's lease
                  (``cluster.jobs.lease``); ``jobs.owner`` names the frontend running a job

A request's ``body`` is opaque here (a serialized ``orchard.v1.Request``: the prompt is
templated and tokenized when the request is dispatched, not when it is stored). ``prefix`` is
the dispatch order: requests that share leading messages sort together (see
``cluster.api.intake.prefix_key``), and ``idx`` is the request's place in the file.

Version 2 had one frontend per store; version 3 adds ``jobs.owner`` (``''``: nobody's, taken
by the first frontend that looks) and the ``frontends`` table; version 4 adds
``jobs.priority`` (every job before it is ``'batch'``: jobs had no priority).

Version 1 stored tokenized prompts in ``requests`` and counted results on every read; opening
such a store moves its requests into ``job_requests`` (as token prompts) and its counts onto
``jobs``, once, in one transaction.
"""
from __future__ import annotations

import json
import sqlite3

VERSION = 4

SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    job_id TEXT PRIMARY KEY, tenant TEXT NOT NULL, state TEXT NOT NULL, total INTEGER NOT NULL,
    model TEXT NOT NULL, created_ms INTEGER NOT NULL, finished_ms INTEGER NOT NULL DEFAULT 0,
    completed INTEGER NOT NULL DEFAULT 0, failed INTEGER NOT NULL DEFAULT 0,
    owner TEXT NOT NULL DEFAULT '', priority TEXT NOT NULL DEFAULT 'batch');
CREATE INDEX IF NOT EXISTS jobs_by_tenant ON jobs (tenant, created_ms);
CREATE INDEX IF NOT EXISTS jobs_by_finish ON jobs (finished_ms);
CREATE TABLE IF NOT EXISTS job_requests (
    job_id TEXT NOT NULL, idx INTEGER NOT NULL, prefix BLOB NOT NULL, custom_id TEXT NOT NULL,
    body BLOB NOT NULL);
CREATE INDEX IF NOT EXISTS job_requests_order ON job_requests (job_id, prefix, idx);
CREATE TABLE IF NOT EXISTS job_keys (
    tenant TEXT NOT NULL, idempotency_key TEXT NOT NULL, job_id TEXT NOT NULL,
    PRIMARY KEY (tenant, idempotency_key));
CREATE TABLE IF NOT EXISTS results (
    job_id TEXT NOT NULL, seq INTEGER NOT NULL, idx INTEGER NOT NULL, ok INTEGER NOT NULL,
    body TEXT NOT NULL, PRIMARY KEY (job_id, seq), UNIQUE (job_id, idx));
CREATE TABLE IF NOT EXISTS intakes (job_id TEXT PRIMARY KEY, started_ms INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS frontends (
    frontend_id TEXT PRIMARY KEY, expires_ms INTEGER NOT NULL, address TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS jobs_by_owner ON jobs (owner, state);
"""


def open_schema(db: sqlite3.Connection) -> None:
    """Create the tables of a new store, or bring an older store up to ``VERSION``."""
    version = db.execute("PRAGMA user_version").fetchone()[0]
    if version > VERSION:
        raise ValueError(f"the job store was written by a newer orchard (schema {version}, this "
                         f"one knows {VERSION}); upgrade orchard")
    if version == VERSION:
        return
    fresh = db.execute("SELECT COUNT(*) FROM sqlite_master").fetchone()[0] == 0
    if fresh:  # freed pages go back to the file system after `orchard jobs prune`
        db.execute("PRAGMA auto_vacuum = INCREMENTAL")
    db.execute("BEGIN IMMEDIATE")
    try:
        if not fresh and _has_table(db, "jobs"):
            if version < 2:
                _upgrade_from_1(db)
            _upgrade_from_2(db)
            _upgrade_from_3(db)
        for statement in SCHEMA.split(";"):  # not executescript: it would commit
            if statement.strip():
                db.execute(statement)
        db.execute(f"PRAGMA user_version = {VERSION}")
        db.execute("COMMIT")
    except BaseException:
        db.execute("ROLLBACK")
        raise


def _has_table(db: sqlite3.Connection, name: str) -> bool:
    return db.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?",
                      (name,)).fetchone() is not None


def _upgrade_from_2(db: sqlite3.Connection) -> None:
    columns = {row[1] for row in db.execute("PRAGMA table_info(jobs)")}
    if "owner" not in columns:  # every job nobody's: the first frontend to look takes it
        db.execute("ALTER TABLE jobs ADD COLUMN owner TEXT NOT NULL DEFAULT ''")


def _upgrade_from_3(db: sqlite3.Connection) -> None:
    columns = {row[1] for row in db.execute("PRAGMA table_info(jobs)")}
    if "priority" not in columns:  # jobs were batch work before they had a priority
        db.execute("ALTER TABLE jobs ADD COLUMN priority TEXT NOT NULL DEFAULT 'batch'")


def _upgrade_from_1(db: sqlite3.Connection) -> None:
    from proto.orchard.v1 import orchard_pb2 as pb  # the body format, needed for this only

    columns = {row[1] for row in db.execute("PRAGMA table_info(jobs)")}
    for name in ("completed", "failed"):
        if name not in columns:
            db.execute(f"ALTER TABLE jobs ADD COLUMN {name} INTEGER NOT NULL DEFAULT 0")
    db.execute("UPDATE jobs SET completed = (SELECT COUNT(*) FROM results s WHERE "
               "s.job_id = jobs.job_id AND s.ok = 1), failed = (SELECT COUNT(*) FROM results s "
               "WHERE s.job_id = jobs.job_id AND s.ok = 0)")
    if not _has_table(db, "requests"):
        return
    for statement in SCHEMA.split(";"):
        if "job_requests" in statement:
            db.execute(statement)
    insert = "INSERT INTO job_requests VALUES (?, ?, ?, ?, ?)"
    for job_id, idx, custom_id, prompt, sampling in db.execute(
            "SELECT job_id, idx, custom_id, prompt, sampling FROM requests"):
        params = json.loads(sampling)
        body = pb.Request(custom_id=custom_id, tokens=pb.TokenIds(ids=json.loads(prompt)),
                          sampling=pb.SamplingParams(
                              max_tokens=params["max_tokens"],
                              temperature=params.get("temperature", 0.0),
                              top_p=params.get("top_p", 1.0), seed=params.get("seed", 0),
                              stop=params.get("stop", ())))
        # b"P": a serialized request (cluster.api.intake.PROTO_BODY); file order, no prefix key
        db.execute(insert, (job_id, idx, b"", custom_id, b"P" + body.SerializeToString()))
    db.execute("DROP TABLE requests")
