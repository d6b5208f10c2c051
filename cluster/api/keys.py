"""API keys an operator manages: ``orchard keys create / list / revoke``, stored hashed.

The file ``RUN/keys.json`` (mode 0600) holds one record per key: its id, tenant, name,
creation, expiry and revocation times, and the SHA-256 of the key, never the key itself. A
key is 32 random bytes (``secrets.token_urlsafe``), so a plain SHA-256 is enough: nobody can
guess a preimage of a 256-bit random string, and a slow password hash would only slow every
call down. The key is printed once, by ``create``.

The commands write the file (under ``keys.lock``, replaced atomically); the running frontend
reads it again whenever its modification time or size changes (one ``stat`` per lookup), so a
new, revoked or expired key takes effect on the next call without a restart. A key that is
unknown, revoked or expired looks the same to the caller: ``Unauthenticated``, no hint of
which. Keys in ``orchard.toml`` keep working beside these.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import secrets
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable, Iterator

KEYS_NAME = "keys.json"
DAY_MS = 86_400_000


@dataclass(frozen=True, slots=True)
class KeyRecord:
    key_id: str
    tenant: str
    name: str
    digest: str          # sha256 hex of the key
    created_ms: int
    expires_ms: int = 0  # 0: never
    revoked_ms: int = 0  # 0: not revoked

    def state(self, now_ms: int) -> str:
        if self.revoked_ms:
            return "revoked"
        if self.expires_ms and now_ms >= self.expires_ms:
            return "expired"
        return "active"


def digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


class KeyStore:
    def __init__(self, run_dir: Path, clock_ms: Callable[[], int]):
        self._path = Path(run_dir) / KEYS_NAME
        self._lock_path = Path(run_dir) / "keys.lock"
        self._clock_ms = clock_ms
        self._seen: tuple[int, int] | None = None  # (mtime_ns, size) of what _by_digest holds
        self._by_digest: dict[str, KeyRecord] = {}

    # ---------------------------------------------------------------- the frontend

    def tenant_of(self, key: str) -> str | None:
        """The tenant of an active key; None for an unknown, revoked or expired one."""
        self._refresh()
        record = self._by_digest.get(digest(key))
        if record is None or record.state(self._clock_ms()) != "active":
            return None
        return record.tenant

    def _refresh(self) -> None:
        try:
            st = self._path.stat()
        except FileNotFoundError:
            self._seen, self._by_digest = None, {}
            return
        if self._seen == (st.st_mtime_ns, st.st_size):
            return
        records = self._read()
        self._by_digest = {r.digest: r for r in records}
        self._seen = (st.st_mtime_ns, st.st_size)

    # ---------------------------------------------------------------- the commands

    def create(self, tenant: str, name: str = "", expires_days: float | None = None
               ) -> tuple[KeyRecord, str]:
        """A new key for ``tenant``: its record and the key itself (shown once)."""
        if not tenant:
            raise ValueError("--tenant: required")
        if expires_days is not None and expires_days <= 0:
            raise ValueError(f"--expires: must be > 0 days, got {expires_days:g}")
        key = f"sk-{tenant}-{secrets.token_urlsafe(32)}"
        now = self._clock_ms()
        record = KeyRecord(key_id=f"key_{secrets.token_hex(6)}", tenant=tenant, name=name,
                           digest=digest(key), created_ms=now,
                           expires_ms=0 if expires_days is None else now + int(expires_days * DAY_MS))
        with self._locked():
            self._write([*self._read(), record])
        return record, key

    def list(self) -> list[KeyRecord]:
        return self._read()

    def revoke(self, key_id: str) -> KeyRecord:
        with self._locked():
            records = self._read()
            for i, record in enumerate(records):
                if record.key_id == key_id:
                    if not record.revoked_ms:
                        records[i] = replace(record, revoked_ms=self._clock_ms())
                        self._write(records)
                    return records[i]
        known = ", ".join(r.key_id for r in records) or "none"
        raise ValueError(f"no key {key_id!r} in {self._path}; known ids: {known}")

    # ---------------------------------------------------------------- the file

    def _read(self) -> list[KeyRecord]:
        try:
            data = json.loads(self._path.read_text())
            return [KeyRecord(**item) for item in data["keys"]]
        except FileNotFoundError:
            return []
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{self._path} is not an orchard key file ({exc}); restore it "
                             "from a backup or remove it (its keys stop working)") from None

    def _write(self, records: list[KeyRecord]) -> None:
        tmp = self._path.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({"keys": [asdict(r) for r in records]}, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self._path)

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        self._path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self._lock_path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)
