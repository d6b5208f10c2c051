"""TLS for the frontend: a private CA and certificates, server and client credentials, and
the rule for which addresses may serve without it.

``orchard tls init`` (``init_tls``) writes, under ``RUN/tls/`` (keys mode 0600)::

    ca.pem  ca.key           the private CA (keep ca.key on the head machine)
    server.pem server.key    the frontend's certificate: every --hosts name and address,
                             plus localhost, 127.0.0.1 and ::1
    client.pem client.key    a client certificate for mutual TLS (copy with ca.pem)

Keys are ECDSA P-256, signatures SHA-256, made by the ``cryptography`` package. The config
names the server files (``[frontend] tls_cert``, ``tls_key``, optional ``client_ca``: then
clients must present a certificate it signed). gRPC and the HTTP API use the same files.

Binding: loopback serves with or without TLS; any other address needs TLS, unless the
config sets ``allow_plaintext_lan = true``, which is warned about at every start.
"""
from __future__ import annotations

import datetime
import ipaddress
import json
import os
from dataclasses import dataclass
from pathlib import Path

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

TLS_DIR = "tls"
LOOPBACK = ("127.0.0.1", "localhost", "::1")
VALID_DAYS = 825  # the longest lifetime common clients accept for a server certificate


@dataclass(frozen=True, slots=True)
class TlsFiles:
    """The server side: certificate, key, and the CA clients must be signed by (mTLS)."""
    cert: Path
    key: Path
    client_ca: Path | None = None


@dataclass(frozen=True, slots=True)
class ClientTls:
    """The client side: the CA to trust, and a certificate and key for mutual TLS."""
    ca: Path
    cert: Path | None = None
    key: Path | None = None

    def channel_credentials(self) -> grpc.ChannelCredentials:
        chain = Path(self.cert).read_bytes() if self.cert else None
        key = Path(self.key).read_bytes() if self.key else None
        return grpc.ssl_channel_credentials(Path(self.ca).read_bytes(), key, chain)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_binding(host: str, tls: TlsFiles | None, allow_plaintext_lan: bool) -> str | None:
    """``ValueError`` if ``host`` may not serve this way; a warning to log, or None."""
    if tls is not None or is_loopback(host):
        return None
    if not allow_plaintext_lan:
        raise ValueError(f"[frontend] host = {host!r} is not loopback: serving it needs TLS "
                         "(run `orchard tls init --hosts NAME,IP` and set tls_cert and "
                         "tls_key), or set allow_plaintext_lan = true to send keys and "
                         "prompts in the clear")
    return (f"serving {host} WITHOUT TLS (allow_plaintext_lan = true): API keys and prompts "
            "cross the network in the clear")


def server_credentials(tls: TlsFiles) -> grpc.ServerCredentials:
    pair = (tls.key.read_bytes(), tls.cert.read_bytes())
    if tls.client_ca is None:
        return grpc.ssl_server_credentials([pair])
    return grpc.ssl_server_credentials([pair], root_certificates=tls.client_ca.read_bytes(),
                                       require_client_auth=True)


def client_tls(run_dir: Path, ca: Path | None = None, cert: Path | None = None,
               key: Path | None = None) -> ClientTls | None:
    """What a client uses: the files given, else the run directory's ``tls/`` files.

    On the head machine ``frontend.json`` says whether the frontend serves TLS; elsewhere
    (no such file) a ``tls/ca.pem`` in the run directory means TLS.
    """
    if (cert is None) != (key is None):
        raise ValueError("--cert and --key go together (mutual TLS needs both)")
    if ca is not None:
        return ClientTls(_existing(ca, "--ca"), cert and _existing(cert, "--cert"),
                         key and _existing(key, "--key"))
    folder = run_dir / TLS_DIR
    if not (folder / "ca.pem").exists() or not _frontend_uses_tls(run_dir):
        if cert is not None:
            raise ValueError("--cert/--key need --ca (or a tls/ca.pem in the run directory)")
        return None
    if cert is None and (folder / "client.pem").exists() and (folder / "client.key").exists():
        cert, key = folder / "client.pem", folder / "client.key"
    return ClientTls(folder / "ca.pem", cert, key)


def _frontend_uses_tls(run_dir: Path) -> bool:
    try:
        return bool(json.loads((run_dir / "frontend.json").read_text()).get("tls", True))
    except (OSError, ValueError):
        return True


def _existing(path: Path, flag: str) -> Path:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{flag} {path}: no such file")
    return path


# ------------------------------------------------------------------ making certificates

def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "orchard"),
                      x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _builder(subject: str, issuer: x509.Name, public_key, now: datetime.datetime, days: int):
    return (x509.CertificateBuilder().subject_name(_name(subject)).issuer_name(issuer)
            .public_key(public_key).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=days)))


def san_entries(hosts: list[str]) -> list[x509.GeneralName]:
    entries: list[x509.GeneralName] = []
    for host in dict.fromkeys([*hosts, *LOOPBACK]):
        try:
            entries.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            entries.append(x509.DNSName(host))
    return entries


def _leaf(name: str, ca_key, ca_cert: x509.Certificate, now, days: int, usage,
          sans: list[x509.GeneralName] | None):
    key = _key()
    builder = (_builder(name, ca_cert.subject, key.public_key(), now, days)
               .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
               .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
               .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(
                   ca_key.public_key()), critical=False))
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    return key, builder.sign(ca_key, hashes.SHA256())


def init_tls(run_dir: Path, hosts: list[str], days: int = VALID_DAYS,
             force: bool = False) -> Path:
    """Write a CA, a server certificate for ``hosts`` and a client certificate; the folder."""
    folder = Path(run_dir) / TLS_DIR
    if (folder / "ca.pem").exists() and not force:
        raise ValueError(f"{folder} already holds a CA; pass --force to replace it (every "
                         "client then needs the new ca.pem)")
    for host in hosts:
        if not host or any(c.isspace() for c in host):
            raise ValueError(f"--hosts: {host!r} is not a host name or address")
    # a new run directory is private from the start (cluster.rundir): the frontend refuses
    # to serve from one that others can read
    Path(run_dir).mkdir(mode=0o700, parents=True, exist_ok=True)
    folder.mkdir(mode=0o700, exist_ok=True)
    os.chmod(folder, 0o700)
    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = _key()
    ca_cert = (_builder("orchard CA", _name("orchard CA"), ca_key.public_key(), now, days)
               .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
               .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True,
                                            crl_sign=True, content_commitment=False,
                                            key_encipherment=False, data_encipherment=False,
                                            key_agreement=False, encipher_only=False,
                                            decipher_only=False), critical=True)
               .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()),
                              critical=False)
               .sign(ca_key, hashes.SHA256()))
    server = _leaf("orchard frontend", ca_key, ca_cert, now, days,
                   ExtendedKeyUsageOID.SERVER_AUTH, san_entries(hosts))
    client = _leaf("orchard client", ca_key, ca_cert, now, days,
                   ExtendedKeyUsageOID.CLIENT_AUTH, None)
    _write(folder, "ca", ca_key, ca_cert)
    _write(folder, "server", *server)
    _write(folder, "client", *client)
    return folder


def _write(folder: Path, stem: str, key, cert: x509.Certificate) -> None:
    key_bytes = key.private_bytes(serialization.Encoding.PEM,
                                  serialization.PrivateFormat.PKCS8,
                                  serialization.NoEncryption())
    fd = os.open(folder / f"{stem}.key", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(key_bytes)
    (folder / f"{stem}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
