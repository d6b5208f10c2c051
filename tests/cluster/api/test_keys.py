"""Managed API keys (``cluster.api.keys.KeyStore``): stored hashed in a private file, a key's
tenant until it is revoked or expires (to the millisecond), a change seen without a restart;
then keys made with ``orchard keys`` used, revoked and expired against a real frontend, over HTTP
and gRPC."""
from __future__ import annotations

import json
import time

import openai
import pytest

from cluster.api.client import OrchardError
from cluster.api.keys import DAY_MS, KEYS_NAME, KeyRecord, KeyStore, digest
from cluster.cli import main as orchard
from tests.support.http_api import CONFIG, http_frontend, messages, sdk


class Clock:
    def __init__(self, ms: int) -> None:
        self.ms = ms

    def __call__(self) -> int:
        return self.ms


class TestKeys:
    def test_a_created_key_is_stored_hashed_in_a_private_file(self, tmp_path):
        store = KeyStore(tmp_path, Clock(1_000))
        record, key = store.create("acme", name="ci")
        assert key.startswith("sk-acme-") and len(key) == len("sk-acme-") + 43
        assert (record.tenant, record.name, record.created_ms, record.expires_ms,
                record.revoked_ms) == ("acme", "ci", 1_000, 0, 0)
        path = tmp_path / KEYS_NAME
        assert path.stat().st_mode & 0o777 == 0o600
        text = path.read_text()
        assert key not in text and digest(key) in text
        assert json.loads(text)["keys"][0]["key_id"] == record.key_id
        assert store.tenant_of(key) == "acme"
        assert store.tenant_of(key + "x") is None

    def test_a_key_expires_at_exactly_its_expiry(self, tmp_path):
        clock = Clock(5_000)
        store = KeyStore(tmp_path, clock)
        record, key = store.create("acme", expires_days=1.5)
        assert record.expires_ms == 5_000 + int(1.5 * DAY_MS)
        clock.ms = record.expires_ms - 1
        assert store.tenant_of(key) == "acme"
        clock.ms = record.expires_ms
        assert store.tenant_of(key) is None
        assert store.list()[0].state(clock.ms) == "expired"

    def test_a_revoked_key_stops_at_once_in_another_store_on_the_file(self, tmp_path):
        clock = Clock(10)
        frontend, command = KeyStore(tmp_path, clock), KeyStore(tmp_path, clock)
        record, key = command.create("acme")
        assert frontend.tenant_of(key) == "acme"
        clock.ms = 20
        revoked = command.revoke(record.key_id)
        assert revoked.revoked_ms == 20 and revoked.state(20) == "revoked"
        assert frontend.tenant_of(key) is None       # re-read: the file changed
        assert command.revoke(record.key_id).revoked_ms == 20   # again: unchanged

    def test_bad_input_and_an_unknown_id_say_what_to_do(self, tmp_path):
        store = KeyStore(tmp_path, Clock(0))
        with pytest.raises(ValueError, match="^--tenant: required$"):
            store.create("")
        with pytest.raises(ValueError) as expires:
            store.create("acme", expires_days=0)
        assert str(expires.value) == "--expires: must be > 0 days, got 0"
        record, _ = store.create("acme")
        with pytest.raises(ValueError) as unknown:
            store.revoke("key_nope")
        assert str(unknown.value) == (f"no key 'key_nope' in {tmp_path / KEYS_NAME}; known "
                                      f"ids: {record.key_id}")

    def test_a_damaged_file_is_named_with_the_fix(self, tmp_path):
        (tmp_path / KEYS_NAME).write_text('{"keys": [{"key_id": 1}]}')
        with pytest.raises(ValueError, match="is not an orchard key file .*restore it from a "
                                             "backup or remove it"):
            KeyStore(tmp_path, Clock(0)).list()

    def test_no_file_no_keys(self, tmp_path):
        store = KeyStore(tmp_path, Clock(0))
        assert store.list() == [] and store.tenant_of("sk-any") is None

    def test_the_state_of_a_record(self):
        record = KeyRecord("k", "t", "", "d", created_ms=0, expires_ms=100)
        assert [record.state(99), record.state(100)] == ["active", "expired"]
        assert KeyRecord("k", "t", "", "d", 0, 100, revoked_ms=50).state(10) == "revoked"


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    with http_frontend(tmp_path_factory, CONFIG) as harness:
        yield harness


@pytest.fixture(scope="module")
def model(api):
    return sdk(api).models.list().data[0].id


class TestManagedKeysOverTheApi:
    def test_managed_keys_apply_without_restart_and_revoked_or_expired_are_refused(self, 
            api, model, capsys):
        run_dir = str(api.config.run_dir)
        assert orchard(["keys", "create", "--tenant", "beta", "--name", "ci", "--run-dir",
                        run_dir]) == 0
        key = capsys.readouterr().out.strip()
        assert key.startswith("sk-beta-")
        assert key not in (api.config.run_dir / "keys.json").read_text()  # stored hashed
        client = sdk(api, key)
        reply = client.chat.completions.create(model=model, messages=messages("hi"), max_tokens=1)
        assert reply.usage.completion_tokens == 1
        with api.client(api_key=key) as grpc_client:  # gRPC accepts it too
            assert grpc_client.jobs() is not None
        assert orchard(["keys", "list", "--json", "--run-dir", run_dir]) == 0
        listed = json.loads(capsys.readouterr().out)
        key_id = listed[0]["id"]
        assert listed[0]["tenant"] == "beta" and listed[0]["state"] == "active"
        assert orchard(["keys", "revoke", key_id, "--run-dir", run_dir]) == 0
        with pytest.raises(openai.AuthenticationError) as revoked:
            client.models.list()
        with api.client(api_key=key) as grpc_client:
            with pytest.raises(OrchardError, match="UNAUTHENTICATED: authorization: unknown API key"):
                grpc_client.jobs()
        # an expired key: created already past its expiry by giving the store a later clock
        past = KeyStore(api.config.run_dir, lambda: time.time_ns() // 1_000_000 - 2 * 86_400_000)
        _, expired_key = past.create("beta", "old", expires_days=1)
        with pytest.raises(openai.AuthenticationError) as expired:
            sdk(api, expired_key).models.list()
        with pytest.raises(openai.AuthenticationError) as unknown:
            sdk(api, "sk-beta-never-issued").models.list()
        assert revoked.value.body == expired.value.body == unknown.value.body  # no hint of which
        assert sdk(api, "key-beta").models.list().data  # the orchard.toml key still works
