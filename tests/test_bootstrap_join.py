"""``orchard up --address`` to a head that does not answer fails fast, naming the address."""
import concurrent.futures
import socket
import time

import pytest

pytest.importorskip("ray")

from cluster.backend.bootstrap import join  # noqa: E402


def _join_within(address: str, timeout_s: float, limit_s: float) -> tuple[str, float]:
    pool = concurrent.futures.ThreadPoolExecutor(1)
    started = time.monotonic()
    future = pool.submit(join, address, timeout_s)
    try:
        future.result(timeout=limit_s)
    except ValueError as exc:
        return str(exc), time.monotonic() - started
    finally:
        pool.shutdown(wait=False)
    raise AssertionError("join returned: it should have failed")


def test_a_closed_port_fails_at_once_naming_the_address():
    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    message, took_s = _join_within(f"127.0.0.1:{port}", 30.0, limit_s=10)
    assert message.startswith(f"cannot reach the Ray head at 127.0.0.1:{port}: ")
    assert "Connection refused" in message and took_s < 5


def test_a_silent_listener_fails_within_the_timeout():
    with socket.socket() as silent:  # accepts connections, never says a word
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        port = silent.getsockname()[1]
        message, took_s = _join_within(f"127.0.0.1:{port}", 2.0, limit_s=15)
    assert message == (f"cannot reach the Ray head at 127.0.0.1:{port}: a connection opens but "
                       "no gRPC server answered within 2 s; is that the Ray head's GCS port "
                       "(6379 by default)?")
    assert took_s < 5
