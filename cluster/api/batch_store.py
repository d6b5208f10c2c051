"""The Batch API's own records: uploaded files and the batches made of them, in the run dir.

A batch is an orchard job (the job store owns its requests, results and state); this store
keeps only what OpenAI's Batch API adds around it::

    RUN/files/<file_id>          the file's bytes (mode 0600, folder 0700, as the run
                                 directory's other secrets: prompts are tenants' data)
    RUN/batches.sqlite3 files    file_id ─ tenant, filename, purpose, bytes, created_s
                        batches  batch_id ─ tenant, job_id, endpoint, input_file_id,
                                 completion_window, metadata, created_s,
                                 output_file_id, error_file_id (set once written)

Every read is scoped to a tenant: another tenant's id is simply not found. The clock is
injected (seconds since the epoch).
"""
from __future__ import annotations

import json
import os
import secrets
import sqlite3
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

from cluster.jobs.store import JobNotFound

_SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    file_id TEXT PRIMARY KEY, tenant TEXT NOT NULL, filename TEXT NOT NULL,
    purpose TEXT NOT NULL, bytes INTEGER NOT NULL, created_s INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS batches (
    batch_id TEXT PRIMARY KEY, tenant TEXT NOT NULL, job_id TEXT NOT NULL,
    endpoint TEXT NOT NULL, input_file_id TEXT NOT NULL, completion_window TEXT NOT NULL,
    metadata TEXT NOT NULL, created_s INTEGER NOT NULL,
    output_file_id TEXT NOT NULL DEFAULT '', error_file_id TEXT NOT NULL DEFAULT '');
CREATE INDEX IF NOT EXISTS batches_by_tenant ON batches (tenant, created_s);
"""


class FileNotFound(JobNotFound):
    """No file with that id for this tenant (NOT_FOUND at the edge)."""


@dataclass(frozen=True, slots=True)
class StagedFile:
    """A file written to the store's folder, not yet recorded (nobody can read it yet)."""

    file_id: str
    bytes: int


@dataclass(frozen=True, slots=True)
class FileRecord:
    file_id: str
    tenant: str
    filename: str
    purpose: str
    bytes: int
    created_s: int


@dataclass(frozen=True, slots=True)
class BatchRecord:
    batch_id: str
    tenant: str
    job_id: str
    endpoint: str
    input_file_id: str
    completion_window: str
    metadata: dict
    created_s: int
    output_file_id: str = ""
    error_file_id: str = ""


class BatchStore:
    def __init__(self, run_dir: Path, clock_s: Callable[[], int]):
        self._files = Path(run_dir) / "files"
        self._files.mkdir(mode=0o700, exist_ok=True)
        self._clock_s = clock_s
        path = Path(run_dir) / "batches.sqlite3"
        self._db = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False)
        os.chmod(path, 0o600)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.executescript(_SCHEMA)

    def close(self) -> None:
        self._db.close()

    # ---------------------------------------------------------------- files

    def add_file(self, tenant: str, filename: str, purpose: str,
                 pieces: Iterable[bytes]) -> FileRecord:
        """Write the file and record it (``write`` then ``record``)."""
        return self.record(self.write(pieces), tenant, filename, purpose)

    def write(self, pieces: Iterable[bytes]) -> StagedFile:
        """Write a new file's ``pieces`` as they come (fsynced, 0600), not yet recorded; may
        run in a worker thread (it touches no database). If the pieces raise (an upload over
        its cap), the part written is removed."""
        file_id = f"file-{secrets.token_hex(12)}"
        path = self._files / file_id
        size = 0
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            with os.fdopen(fd, "wb") as f:
                for piece in pieces:
                    f.write(piece)
                    size += len(piece)
                f.flush()
                os.fsync(f.fileno())
        except BaseException:
            path.unlink()
            raise
        return StagedFile(file_id, size)

    def record(self, staged: StagedFile, tenant: str, filename: str, purpose: str
               ) -> FileRecord:
        record = FileRecord(staged.file_id, tenant, filename, purpose, staged.bytes,
                            self._clock_s())
        self._db.execute("INSERT INTO files VALUES (?, ?, ?, ?, ?, ?)",
                         (record.file_id, tenant, filename, purpose, record.bytes,
                          record.created_s))
        return record

    def file(self, file_id: str, tenant: str) -> FileRecord:
        row = self._db.execute("SELECT * FROM files WHERE file_id = ? AND tenant = ?",
                               (file_id, tenant)).fetchone()
        if row is None:
            raise FileNotFound(f"file_id: no file {file_id!r}")
        return FileRecord(*row)

    def content(self, file_id: str, tenant: str) -> bytes:
        self.file(file_id, tenant)
        return (self._files / file_id).read_bytes()

    # -------------------------------------------------------------- batches

    def add_batch(self, tenant: str, job_id: str, endpoint: str, input_file_id: str,
                  completion_window: str, metadata: dict) -> BatchRecord:
        record = BatchRecord(f"batch_{secrets.token_hex(12)}", tenant, job_id, endpoint,
                             input_file_id, completion_window, metadata, self._clock_s())
        self._db.execute("INSERT INTO batches VALUES (?, ?, ?, ?, ?, ?, ?, ?, '', '')",
                         (record.batch_id, tenant, job_id, endpoint, input_file_id,
                          completion_window, json.dumps(metadata), record.created_s))
        return record

    def batch(self, batch_id: str, tenant: str) -> BatchRecord:
        row = self._db.execute("SELECT * FROM batches WHERE batch_id = ? AND tenant = ?",
                               (batch_id, tenant)).fetchone()
        if row is None:
            raise JobNotFound(f"batch_id: no batch {batch_id!r}")
        return _batch(row)

    def batches(self, tenant: str, limit: int, after: str = "") -> list[BatchRecord]:
        """``tenant``'s batches, newest first, from the one after ``after`` on."""
        if after:
            self.batch(after, tenant)  # NOT_FOUND for a stale cursor
            rows = self._db.execute(
                "SELECT * FROM batches WHERE tenant = ? AND rowid < (SELECT rowid FROM batches "
                "WHERE batch_id = ?) ORDER BY rowid DESC LIMIT ?",
                (tenant, after, limit)).fetchall()
        else:
            rows = self._db.execute("SELECT * FROM batches WHERE tenant = ? "
                                    "ORDER BY rowid DESC LIMIT ?", (tenant, limit)).fetchall()
        return [_batch(row) for row in rows]

    def set_outputs(self, batch: BatchRecord, output: bytes, errors: bytes) -> BatchRecord:
        """Write a finished batch's output and error files (once) and record their ids."""
        if batch.output_file_id or batch.error_file_id:
            return batch
        out = self.add_file(batch.tenant, f"{batch.batch_id}_output.jsonl", "batch_output",
                            [output]) if output else None
        err = self.add_file(batch.tenant, f"{batch.batch_id}_error.jsonl", "batch_output",
                            [errors]) if errors else None
        self._db.execute("UPDATE batches SET output_file_id = ?, error_file_id = ? "
                         "WHERE batch_id = ?",
                         (out.file_id if out else "", err.file_id if err else "",
                          batch.batch_id))
        return self.batch(batch.batch_id, batch.tenant)


def _batch(row: tuple) -> BatchRecord:
    values = list(row)
    values[6] = json.loads(values[6])
    return BatchRecord(*values)
