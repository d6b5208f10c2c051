"""Why a client could not reach the frontend over (or without) TLS, in words that say which
side refused and what to pass instead.

gRPC reports most TLS mismatches as ``UNAVAILABLE ... Socket closed``: the server hung up
during the handshake and the client never learns why. So when a call fails with
``UNAVAILABLE``, the client (``cluster.api.client``) asks ``explain``, which connects once
more with Python's ``ssl`` module, as the channel would have, and reads the answer:

    probe                                        means                         says
    TCP connect refused                          nothing listens there         is it up?
    handshake, no verification: a non-TLS reply  the server is plaintext      drop --ca
    ... completes, and the client used no TLS    the server speaks TLS        pass --ca
    verifying against the client's CA fails      this client refuses it       which CA / name
    handshake done, then the server hangs up     the server refuses the       pass --cert/--key,
      instead of answering the HTTP/2 preface      client (no/foreign cert)     or the right ones
    the server answers the preface               TLS is not the problem       None

``None`` leaves gRPC's own message standing (an UNAVAILABLE the server sent, a timeout, an
unreachable host). Each probe is bounded by ``PROBE_TIMEOUT_S`` per socket operation.
"""
from __future__ import annotations

import socket
import ssl
from dataclasses import dataclass

from cryptography import x509

from cluster.tls import ClientTls

PROBE_TIMEOUT_S = 5.0
# The HTTP/2 client preface and an empty SETTINGS frame: a gRPC server that accepted the
# client answers with its own SETTINGS frame; one that refused the client hangs up.
HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"
NAME_MISMATCH = (62, 64)  # X509_V_ERR_HOSTNAME_MISMATCH, X509_V_ERR_IP_ADDRESS_MISMATCH
CERT_HAS_EXPIRED = 10   # X509_V_ERR_CERT_HAS_EXPIRED


@dataclass(frozen=True, slots=True)
class Hello:
    """What the server answered a TLS handshake that verifies nothing."""
    tls: bool                      # it speaks TLS
    names: tuple[str, ...] = ()    # the names and addresses its certificate is valid for


def explain(address: str, tls: ClientTls | None,
            timeout_s: float = PROBE_TIMEOUT_S) -> str | None:
    """What went wrong between this client and ``address`` at the TLS layer, or None."""
    target = split_address(address)
    if target is None:
        return None
    try:
        hello = _hello(target, timeout_s)
    except ConnectionRefusedError:
        return (f"nothing listens at {address} (connection refused): is the cluster up "
                "(`orchard up`), and is --address its gRPC address (`orchard up` prints it)?")
    except OSError:
        return None  # unreachable or silent: gRPC's own message says so
    if tls is None:
        if not hello.tls:
            return None
        return (f"the server at {address} speaks TLS and this client connected without it: "
                "pass --ca FILE, the CA that signed its certificate (RUN/tls/ca.pem on the "
                "head; with --cert/--key too if it requires client certificates)")
    if not hello.tls:
        return (f"the server at {address} does not speak TLS (it serves plaintext) and this "
                f"client connected with it (CA {tls.ca}): leave out --ca/--cert/--key, or "
                "turn TLS on at the server (`orchard tls init --write`)")
    return _verified(address, target, tls, hello, timeout_s)


def split_address(address: str) -> tuple[str, int] | None:
    """``("host", port)`` from ``host:port`` or ``[v6]:port``; None for other targets."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or "/" in host:
        return None
    return host.strip("[]"), int(port)


def _hello(target: tuple[str, int], timeout_s: float) -> Hello:
    """Handshake without verifying anything; ``OSError`` when nothing could be asked."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    context.set_alpn_protocols(["h2"])
    with socket.create_connection(target, timeout=timeout_s) as raw:
        try:
            with context.wrap_socket(raw) as conn:
                der = conn.getpeercert(binary_form=True)
        except ssl.SSLError as exc:  # an alert is TLS refusing; anything else is not TLS
            return Hello(tls="ALERT" in (exc.reason or ""))
        except ConnectionError:
            return Hello(tls=False)
    return Hello(True, certificate_names(x509.load_der_x509_certificate(der)) if der else ())


def _verified(address: str, target: tuple[str, int], tls: ClientTls, hello: Hello,
              timeout_s: float) -> str | None:
    context = ssl.create_default_context(cafile=str(tls.ca))
    if tls.cert is not None:
        context.load_cert_chain(str(tls.cert), str(tls.key))
    context.set_alpn_protocols(["h2"])
    try:
        with socket.create_connection(target, timeout=timeout_s) as raw, \
                context.wrap_socket(raw, server_hostname=target[0]) as conn:
            conn.sendall(HTTP2_PREFACE)
            answer = conn.recv(9)
    except ssl.SSLCertVerificationError as exc:
        return _untrusted(address, target[0], tls, hello, exc)
    except (ssl.SSLError, ConnectionError):  # an alert, or a reset: the server hung up
        answer = b""
    except OSError:
        return None
    return None if answer else _refused(address, tls)


def _untrusted(address: str, host: str, tls: ClientTls, hello: Hello,
               exc: ssl.SSLCertVerificationError) -> str:
    side = f"this client refused the certificate of the server at {address}"
    if exc.verify_code in NAME_MISMATCH:
        names = ", ".join(hello.names) or "no host"
        return (f"{side}: it names {names}, not {host}; connect by one of those names, or "
                f"issue one that names {host} (`orchard tls init --force --hosts {host},...` "
                "on the head)")
    if exc.verify_code == CERT_HAS_EXPIRED:
        return (f"{side}: it has expired; issue new certificates on the head "
                "(`orchard tls init --force --write`) and copy the new ca.pem to clients")
    return (f"{side}: it is not signed by the CA in --ca ({tls.ca}; {exc.verify_message}); "
            f"pass the ca.pem of the cluster at {address} (RUN/tls/ca.pem on its head)")


def _refused(address: str, tls: ClientTls) -> str:
    if tls.cert is None:
        return (f"the server at {address} requires a client certificate (mutual TLS, its "
                "[frontend] client_ca) and refused this client, which showed none: pass "
                "--cert client.pem --key client.key (from RUN/tls/ on the head)")
    return (f"the server at {address} refused the client certificate {tls.cert}: it is not "
            "signed by the CA the server trusts ([frontend] client_ca); pass the client.pem "
            "and client.key made with that CA (RUN/tls/ on the head)")


def certificate_names(cert: x509.Certificate) -> tuple[str, ...]:
    """The DNS names and addresses a certificate is valid for."""
    try:
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return ()
    return (*sans.get_values_for_type(x509.DNSName),
            *(str(ip) for ip in sans.get_values_for_type(x509.IPAddress)))
