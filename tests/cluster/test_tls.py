"""TLS: ``orchard tls init``'s files (what the command writes into orchard.toml is in
``tests/cluster/commands/test_tls.py``), the rule for which addresses may serve plaintext, and a
frontend on loopback over TLS reached by gRPC and by the openai SDK.

Clients on another machine: the frontend serves the head's LAN address over mutual TLS in
one network namespace (``infra/netns.py``), clients run in another.

A client with the CA and a client certificate gets answers over gRPC and over the HTTP API
(the ``openai`` SDK); plaintext, a wrong CA and a missing client certificate are refused.
Needs root and ``ip netns``; skipped with the reason where namespaces are impossible.
"""
from __future__ import annotations

import ipaddress
import json
import ssl
import openai
import pytest
from cryptography import x509
from cluster.api.client import Client, token_request
from cluster.tls import check_binding, client_tls, init_tls
from cluster.cli import main as orchard
from cluster.config import load_config, update_config
from tests.support.forged_models import tiny_model
from tests.support.frontend_harness import ACME_CONFIG, running_frontend
import subprocess
import sys
import time
from cluster.tls import init_tls
from tests.support.netns_hosts import netns_cluster


TLS_CONFIG = ACME_CONFIG + '[frontend]\ntls_cert = "tls/server.pem"\ntls_key = "tls/server.key"\n'


class TestBehaviour:
    def test_init_writes_a_ca_that_signs_a_server_certificate_for_the_hosts(self, tmp_path, capsys):
        assert orchard(["tls", "init", "--run-dir", str(tmp_path), "--hosts",
                        "head.local,10.0.0.5"]) == 0
        assert 'tls_cert = "tls/server.pem"' in capsys.readouterr().out
        folder = tmp_path / "tls"
        ca = x509.load_pem_x509_certificate((folder / "ca.pem").read_bytes())
        server = x509.load_pem_x509_certificate((folder / "server.pem").read_bytes())
        client = x509.load_pem_x509_certificate((folder / "client.pem").read_bytes())
        server.verify_directly_issued_by(ca)
        client.verify_directly_issued_by(ca)
        sans = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert sans.get_values_for_type(x509.DNSName) == ["head.local", "localhost"]
        assert sans.get_values_for_type(x509.IPAddress) == [
            ipaddress.ip_address("10.0.0.5"), ipaddress.ip_address("127.0.0.1"),
            ipaddress.ip_address("::1")]
        for key in ("ca.key", "server.key", "client.key"):
            assert (folder / key).stat().st_mode & 0o777 == 0o600
        assert orchard(["tls", "init", "--run-dir", str(tmp_path)]) == 2  # no silent replacement
        assert "pass --force" in capsys.readouterr().err

    def test_a_lan_address_needs_tls_or_an_explicit_plaintext_setting(self, tmp_path):
        (tmp_path / "orchard.toml").write_text(ACME_CONFIG + '[frontend]\nhost = "10.0.0.5"\n')
        with pytest.raises(ValueError, match="is not loopback: serving it needs TLS"):
            load_config(tmp_path)
        (tmp_path / "orchard.toml").write_text(
            ACME_CONFIG + '[frontend]\nhost = "10.0.0.5"\nallow_plaintext_lan = true\n')
        config = load_config(tmp_path)
        assert "WITHOUT TLS" in check_binding(config.host, None, True)
        init_tls(tmp_path, ["10.0.0.5"])
        (tmp_path / "orchard.toml").write_text(TLS_CONFIG + 'host = "10.0.0.5"\n')
        assert load_config(tmp_path).tls_files().cert == tmp_path / "tls" / "server.pem"
        assert check_binding("127.0.0.1", None, False) is None  # loopback stays as it was

    def test_tls_config_errors_name_the_key(self, tmp_path):
        (tmp_path / "orchard.toml").write_text(TLS_CONFIG)
        with pytest.raises(ValueError, match=r"tls_cert: .*server.pem does not exist"):
            load_config(tmp_path)
        (tmp_path / "orchard.toml").write_text(ACME_CONFIG + '[frontend]\ntls_cert = "x.pem"\n')
        with pytest.raises(ValueError, match="tls_cert and tls_key go together"):
            load_config(tmp_path)

    def test_loopback_over_tls_for_grpc_and_the_openai_sdk(self, tmp_path):
        run_dir = tmp_path / "run"
        init_tls(run_dir, [])
        (run_dir / "orchard.toml").write_text(TLS_CONFIG)
        with running_frontend(run_dir, tiny_model(), workers=1):
            info = json.loads((run_dir / "frontend.json").read_text())
            assert info["tls"] and info["http_address"].startswith("https://127.0.0.1:")
            assert client_tls(run_dir).ca == run_dir / "tls" / "ca.pem"  # found in the run dir
            with Client.from_run_dir(run_dir) as client:
                events = list(client.generate(token_request("", [5, 6, 7], 2), timeout_s=30))
                assert events[-1].result.usage.completion_tokens == 2
            with Client(info["address"], "key-acme", timeout_s=5) as plaintext:
                with pytest.raises(Exception, match="UNAVAILABLE"):
                    plaintext.health()
            context = ssl.create_default_context(cafile=str(run_dir / "tls" / "ca.pem"))
            sdk = openai.OpenAI(base_url=info["http_address"] + "/v1", api_key="key-acme",
                                max_retries=0, http_client=openai.DefaultHttpxClient(verify=context))
            assert [m.id for m in sdk.models.list().data] == ["llama"]
            untrusted = openai.OpenAI(base_url=info["http_address"] + "/v1", api_key="key-acme",
                                      max_retries=0)
            with pytest.raises(openai.APIConnectionError):
                untrusted.models.list()

    def test_update_config_adds_a_missing_section_and_refuses_what_would_not_load(self, tmp_path):
        path = tmp_path / "orchard.toml"
        path.write_text(ACME_CONFIG)
        init_tls(tmp_path, [])
        update_config(tmp_path, "frontend", {"tls_cert": "tls/server.pem",
                                             "tls_key": "tls/server.key"})
        written = ACME_CONFIG + '\n[frontend]\ntls_cert = "tls/server.pem"\ntls_key = "tls/server.key"\n'
        assert path.read_text() == written
        with pytest.raises(ValueError, match=r"client_ca: .*nope.pem does not exist .*unchanged"):
            update_config(tmp_path, "frontend", {"client_ca": "nope.pem"})
        assert path.read_text() == written
        path.write_text("frontend = {host = '127.0.0.1'}\n" + ACME_CONFIG)
        with pytest.raises(ValueError, match=r"\[frontend\] must be a table of its own"):
            update_config(tmp_path, "frontend", {"port": 1})


pytestmark = pytest.mark.slow

CLIENT = r"""
import json, ssl, sys
import grpc, openai
from cluster.api.client import Client, OrchardError, chat_request
from cluster.tls import ClientTls
address, http, tls, other = sys.argv[1:5]
out = {}

def ask(name, client_tls):
    try:
        with Client(address, "key-acme", timeout_s=10, tls=client_tls) as client:
            events = list(client.generate(chat_request("", [{"role": "user", "content": "hi"}], 3), timeout_s=20))
            out[name] = events[-1].result.usage.completion_tokens
    except OrchardError as exc:
        out[name] = exc.code

ask("mtls", ClientTls(f"{tls}/ca.pem", f"{tls}/client.pem", f"{tls}/client.key"))
ask("no_client_cert", ClientTls(f"{tls}/ca.pem"))
ask("wrong_ca", ClientTls(f"{other}/ca.pem", f"{tls}/client.pem", f"{tls}/client.key"))
ask("plaintext", None)
context = ssl.create_default_context(cafile=f"{tls}/ca.pem")
context.load_cert_chain(f"{tls}/client.pem", f"{tls}/client.key")
sdk = openai.OpenAI(base_url=http + "/v1", api_key="key-acme", max_retries=0,
                    http_client=openai.DefaultHttpxClient(verify=context))
reply = sdk.chat.completions.create(model=sdk.models.list().data[0].id, max_tokens=2,
                                    messages=[{"role": "user", "content": "hi"}])
out["http_mtls"] = reply.usage.completion_tokens
bare = openai.OpenAI(base_url=http + "/v1", api_key="key-acme", max_retries=0,
                     http_client=openai.DefaultHttpxClient(verify=ssl.create_default_context(cafile=f"{tls}/ca.pem")))
try:
    bare.models.list()
    out["http_no_client_cert"] = "served"
except openai.APIConnectionError:
    out["http_no_client_cert"] = "refused"
print(json.dumps(out))
"""

@pytest.fixture(scope="module")
def lan():
    with netns_cluster(workers=1) as cluster:
        yield cluster


class TestLan:
    def test_a_client_in_another_namespace_reaches_the_head_over_mutual_tls(self, lan, tmp_path):
        head, client = lan.nodes
        run = tmp_path / "run"
        init_tls(run, [head.address])
        init_tls(tmp_path / "other", [head.address])  # a CA the server does not know
        (run / "orchard.toml").write_text(f"""
    [[tenants]]
    name = "acme"
    api_keys = ["key-acme"]

    [model]
    dir = "{tiny_model()}"

    [frontend]
    host = "{head.address}"
    tls_cert = "tls/server.pem"
    tls_key = "tls/server.key"
    client_ca = "tls/ca.pem"
    """)
        log = (tmp_path / "frontend.log").open("wb")
        server = lan.popen_in(head, [sys.executable, "-m", "cluster.api.frontend", "--run-dir",
                                     str(run), "--workers", "1"], stdout=log,
                              stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 120
            while not (run / "frontend.json").exists():
                assert server.poll() is None, (tmp_path / "frontend.log").read_text()[-3000:]
                assert time.monotonic() < deadline, "the frontend did not start"
                time.sleep(0.2)
            info = json.loads((run / "frontend.json").read_text())
            assert info["tls"] and info["address"].startswith(f"{head.address}:")
            assert info["http_address"].startswith(f"https://{head.address}:")
            done = lan.run_in(client, [sys.executable, "-c", CLIENT, info["address"],
                                       info["http_address"], str(run / "tls"),
                                       str(tmp_path / "other" / "tls")],
                              capture_output=True, text=True, timeout=180)
            assert done.returncode == 0, done.stderr[-4000:]
            out = json.loads(done.stdout.strip().splitlines()[-1])
        finally:
            server.terminate()
            server.wait(30)
        assert out == {"mtls": 3, "no_client_cert": "UNAVAILABLE", "wrong_ca": "UNAVAILABLE",
                       "plaintext": "UNAVAILABLE", "http_mtls": 2,
                       "http_no_client_cert": "refused"}
