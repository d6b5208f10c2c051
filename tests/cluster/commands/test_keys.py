"""``orchard keys create/list/revoke`` (``cluster.commands.keys``) on a run directory's key
file, no frontend running: what each prints and refuses. That a running frontend applies them
at once is tested in ``tests/cluster/api/test_http_app.py``; the key file in
``tests/cluster/api/test_keys.py``."""
from __future__ import annotations

import json
import time

import pytest

from cluster.api.keys import KeyStore
from cluster.cli import main
from tests.support.frontend_harness import ACME_CONFIG


@pytest.fixture
def run_dir(tmp_path):
    (tmp_path / "orchard.toml").write_text(ACME_CONFIG)
    return tmp_path


def keys(run_dir, *args: str) -> int:
    return main(["keys", *args, "--run-dir", str(run_dir)])


def _utc(ms: int) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.gmtime(ms / 1000))


class TestCreate:
    def test_the_key_alone_goes_to_stdout_and_only_its_hash_is_kept(self, run_dir, capsys):
        assert keys(run_dir, "create", "--tenant", "acme") == 0
        captured = capsys.readouterr()
        key = captured.out.strip()
        assert captured.out == key + "\n" and key.startswith("sk-acme-")
        created, shown_once = captured.err.splitlines()
        assert created.startswith("created key_") and created.endswith(" for tenant acme")
        assert shown_once == "the key (shown once; orchard keeps only its hash):"
        assert key not in (run_dir / "keys.json").read_text()

    def test_json_has_the_record_and_the_key_and_an_expiry_in_days(self, run_dir, capsys):
        assert keys(run_dir, "create", "--tenant", "acme", "--name", "ci", "--expires", "2",
                    "--json") == 0
        made = json.loads(capsys.readouterr().out)
        assert set(made) == {"id", "tenant", "name", "state", "created_unix_ms",
                             "expires_unix_ms", "revoked_unix_ms", "key"}
        assert (made["tenant"], made["name"], made["state"], made["revoked_unix_ms"]) == (
            "acme", "ci", "active", 0)
        assert made["expires_unix_ms"] - made["created_unix_ms"] == 2 * 86_400_000
        assert [r.key_id for r in KeyStore(run_dir, lambda: 0).list()] == [made["id"]]

    def test_an_unknown_tenant_names_the_known_ones(self, run_dir, capsys):
        assert keys(run_dir, "create", "--tenant", "nobody") == 2
        assert capsys.readouterr().err == (
            f"orchard: error: --tenant: no tenant 'nobody' in {run_dir}/orchard.toml; known "
            "tenants: acme\n")
        assert KeyStore(run_dir, lambda: 0).list() == []


class TestListAndRevoke:
    def test_the_table_and_the_json_show_one_line_per_key(self, run_dir, capsys):
        assert keys(run_dir, "create", "--tenant", "acme", "--name", "ci", "--json") == 0
        made = json.loads(capsys.readouterr().out)
        assert keys(run_dir, "list") == 0
        header, line = capsys.readouterr().out.splitlines()
        assert header.split() == ["ID", "TENANT", "NAME", "STATE", "CREATED", "(UTC)", "EXPIRES"]
        assert line.split() == [made["id"], "acme", "ci", "active",
                                *_utc(made["created_unix_ms"]).split(), "-"]
        assert keys(run_dir, "list", "--json") == 0
        assert json.loads(capsys.readouterr().out) == [
            {k: v for k, v in made.items() if k != "key"}]

    def test_revoke_prints_the_revoked_record(self, run_dir, capsys):
        assert keys(run_dir, "create", "--tenant", "acme", "--json") == 0
        made = json.loads(capsys.readouterr().out)
        assert keys(run_dir, "revoke", made["id"]) == 0
        revoked = json.loads(capsys.readouterr().out)
        assert (revoked["id"], revoked["state"]) == (made["id"], "revoked")
        assert revoked["revoked_unix_ms"] >= made["created_unix_ms"]
        assert keys(run_dir, "list") == 0
        assert capsys.readouterr().out.splitlines()[1].split()[3] == "revoked"

    def test_revoking_an_unknown_id_lists_the_known_ones(self, run_dir, capsys):
        assert keys(run_dir, "create", "--tenant", "acme", "--json") == 0
        made = json.loads(capsys.readouterr().out)
        assert keys(run_dir, "revoke", "key_nope") == 2
        assert capsys.readouterr().err == (
            f"orchard: error: no key 'key_nope' in {run_dir}/keys.json; known ids: "
            f"{made['id']}\n")
