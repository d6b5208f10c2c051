"""A client's TLS mistakes against real frontends on loopback say which side refused and why,
instead of gRPC's ``UNAVAILABLE ... Socket closed`` (``cluster.api.tls_probe``)."""
from __future__ import annotations

import datetime
import socket

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from cluster.api.client import Client, OrchardError
from cluster.tls import ClientTls, init_tls
from cluster.api.tls_probe import explain
from cluster.cli import main as orchard
from tests.support.forged_models import tiny_model
from tests.support.frontend_harness import ACME_CONFIG, running_frontend

TLS_CONFIG = ACME_CONFIG + '[frontend]\ntls_cert = "tls/server.pem"\ntls_key = "tls/server.key"\n'
MUTUAL_CONFIG = TLS_CONFIG + 'client_ca = "tls/ca.pem"\n'


def _private_dir(path):
    path.mkdir(mode=0o700, parents=True)
    return path


@pytest.fixture(scope="module")
def mutual(tmp_path_factory):
    """A frontend that requires client certificates, and a rogue CA with its own client."""
    run_dir = _private_dir(tmp_path_factory.mktemp("mutual") / "run")
    init_tls(run_dir, [])
    (run_dir / "orchard.toml").write_text(MUTUAL_CONFIG)
    rogue = init_tls(_private_dir(tmp_path_factory.mktemp("rogue") / "run"), [])
    with running_frontend(run_dir, tiny_model(), workers=1) as harness:
        yield harness, run_dir / "tls", rogue


def _health_error(address: str, tls: ClientTls | None) -> OrchardError:
    with Client(address, "key-acme", timeout_s=10, tls=tls) as client:
        with pytest.raises(OrchardError) as caught:
            client.health()
    assert caught.value.code == "UNAVAILABLE"
    return caught.value


def test_a_plaintext_client_is_told_to_pass_the_ca(mutual):
    harness, _, _ = mutual
    assert _health_error(harness.address, None).message == (
        f"the server at {harness.address} speaks TLS and this client connected without it: "
        "pass --ca FILE, the CA that signed its certificate (RUN/tls/ca.pem on the head; with "
        "--cert/--key too if it requires client certificates)")


def test_no_client_certificate_for_mutual_tls_says_pass_cert_and_key(mutual):
    harness, tls, _ = mutual
    assert _health_error(harness.address, ClientTls(tls / "ca.pem")).message == (
        f"the server at {harness.address} requires a client certificate (mutual TLS, its "
        "[frontend] client_ca) and refused this client, which showed none: pass --cert "
        "client.pem --key client.key (from RUN/tls/ on the head)")


def test_a_rogue_ca_is_named_as_the_clients_refusal(mutual):
    harness, tls, rogue = mutual
    error = _health_error(harness.address,
                          ClientTls(rogue / "ca.pem", tls / "client.pem", tls / "client.key"))
    assert error.message == (
        f"this client refused the certificate of the server at {harness.address}: it is not "
        f"signed by the CA in --ca ({rogue / 'ca.pem'}; unable to get local issuer "
        f"certificate); pass the ca.pem of the cluster at {harness.address} (RUN/tls/ca.pem on "
        "its head)")


def test_a_client_certificate_of_another_ca_is_named_as_the_servers_refusal(mutual):
    harness, tls, rogue = mutual
    error = _health_error(harness.address,
                          ClientTls(tls / "ca.pem", rogue / "client.pem", rogue / "client.key"))
    assert error.message == (
        f"the server at {harness.address} refused the client certificate "
        f"{rogue / 'client.pem'}: it is not signed by the CA the server trusts ([frontend] "
        "client_ca); pass the client.pem and client.key made with that CA (RUN/tls/ on the "
        "head)")


def test_the_right_files_pass_and_the_probe_finds_nothing_wrong(mutual):
    harness, tls, _ = mutual
    right = ClientTls(tls / "ca.pem", tls / "client.pem", tls / "client.key")
    with Client(harness.address, "key-acme", timeout_s=10, tls=right) as client:
        assert client.health() == "SERVING"
    assert explain(harness.address, right) is None


def test_the_command_line_prints_the_reason(mutual, capsys):
    harness, tls, rogue = mutual
    run_dir = tls.parent
    assert orchard(["workers", "--run-dir", str(run_dir), "--ca", str(rogue / "ca.pem")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"orchard: error: UNAVAILABLE: this client refused the certificate "
                          f"of the server at {harness.address}: it is not signed by the CA in "
                          f"--ca ({rogue / 'ca.pem'}; ")
    assert "Socket closed" not in err
    assert orchard(["workers", "--run-dir", str(run_dir), "--ca", str(tls / "ca.pem")]) == 2
    assert "requires a client certificate" in capsys.readouterr().err


def test_a_tls_client_of_a_plaintext_server_is_told_to_drop_the_tls_flags(tmp_path):
    run_dir = _private_dir(tmp_path / "run")
    (run_dir / "orchard.toml").write_text(ACME_CONFIG)
    ca = init_tls(_private_dir(tmp_path / "other"), []) / "ca.pem"
    with running_frontend(run_dir, tiny_model(), workers=1) as harness:
        assert _health_error(harness.address, ClientTls(ca)).message == (
            f"the server at {harness.address} does not speak TLS (it serves plaintext) and "
            f"this client connected with it (CA {ca}): leave out --ca/--cert/--key, or turn "
            "TLS on at the server (`orchard tls init --write`)")


def _reissue_server_certificate(folder, name: str) -> None:
    """Replace ``folder``'s server certificate with one, signed by its CA, naming ``name`` only."""
    ca_key = serialization.load_pem_private_key((folder / "ca.key").read_bytes(), None)
    ca = x509.load_pem_x509_certificate((folder / "ca.pem").read_bytes())
    key = serialization.load_pem_private_key((folder / "server.key").read_bytes(), None)
    assert isinstance(key, ec.EllipticCurvePrivateKey)
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
            .issuer_name(ca.subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(name)]), critical=False)
            .sign(ca_key, hashes.SHA256()))
    (folder / "server.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))


def test_a_certificate_that_does_not_name_the_address_says_what_it_names(tmp_path):
    run_dir = _private_dir(tmp_path / "run")
    folder = init_tls(run_dir, [])
    _reissue_server_certificate(folder, "elsewhere.test")
    (run_dir / "orchard.toml").write_text(TLS_CONFIG)
    with running_frontend(run_dir, tiny_model(), workers=1) as harness:
        assert _health_error(harness.address, ClientTls(folder / "ca.pem")).message == (
            f"this client refused the certificate of the server at {harness.address}: it "
            "names elsewhere.test, not 127.0.0.1; connect by one of those names, or issue one "
            "that names 127.0.0.1 (`orchard tls init --force --hosts 127.0.0.1,...` on the "
            "head)")


def test_nothing_listening_says_so():
    with socket.socket() as bound:  # bound, never listening: connecting is refused
        bound.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{bound.getsockname()[1]}"
        assert _health_error(address, None).message == (
            f"nothing listens at {address} (connection refused): is the cluster up (`orchard "
            "up`), and is --address its gRPC address (`orchard up` prints it)?")
