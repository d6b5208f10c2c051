"""Clients on another machine: the frontend serves the head's LAN address over mutual TLS in
one network namespace (``infra/netns.py``), clients run in another.

A client with the CA and a client certificate gets answers over gRPC and over the HTTP API
(the ``openai`` SDK); plaintext, a wrong CA and a missing client certificate are refused.
Needs root and ``ip netns``; skipped with the reason where namespaces are impossible.
"""
from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from cluster.tls import init_tls
from test_multinode import netns
from forged_models import tiny_model

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
    reason = netns.probe()
    if reason:
        pytest.skip(f"no network namespaces here: {reason}")
    cluster = netns.NetnsCluster(workers=1, python=sys.executable)
    try:
        cluster.create()
        yield cluster
    finally:
        cluster.destroy()


def test_a_client_in_another_namespace_reaches_the_head_over_mutual_tls(lan, tmp_path):
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
