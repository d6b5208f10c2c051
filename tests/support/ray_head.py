"""A Ray cluster of the test's own, outside every orchard process: ``ray start --head`` on
loopback, as an operator runs one for ``orchard up --address``.

``ray_head()`` yields its address and stops it after: every process of its session carries the
session's temporary directory (made by the test, ``--temp-dir``) in its command line, so the
test stops exactly the processes it started, never another Ray on the machine. The head runs
without Ray's token auth (``RAY_AUTH_MODE=disabled``, which the caller sets for its processes
too) and with one ``orchard_node`` slot per worker it may place.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator

from cluster.backend.bootstrap import NODE_RESOURCE, check_reachable

HEAD_ENV = {"RAY_AUTH_MODE": "disabled", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _session_pids(temp_dir: str) -> list[int]:
    listed = subprocess.run(["ps", "-eo", "pid=,args="], capture_output=True, text=True).stdout
    return [int(line.split(None, 1)[0]) for line in listed.splitlines()
            if temp_dir in line and int(line.split(None, 1)[0]) != os.getpid()]


@contextlib.contextmanager
def ray_head(slots: int = 4, cpus: int = 4) -> Iterator[str]:
    temp_dir = tempfile.mkdtemp(prefix="orch-ray-", dir="/tmp")   # short: Ray's socket paths
    port = _free_port()
    ray = str(Path(sys.executable).with_name("ray"))
    head = subprocess.Popen(
        [ray, "start", "--head", "--block", f"--temp-dir={temp_dir}", f"--port={port}",
         "--node-ip-address=127.0.0.1", f"--num-cpus={cpus}",
         f'--resources={{"{NODE_RESOURCE}": {slots}}}', "--include-dashboard=false",
         "--disable-usage-stats"],
        env={**os.environ, **HEAD_ENV}, stdout=subprocess.DEVNULL,
        stderr=open(Path(temp_dir) / "head.log", "ab"), start_new_session=True)
    address = f"127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:   # the head takes seconds to start; until then its port refuses
            try:
                check_reachable(address, timeout_s=5)
                break
            except ValueError:
                if head.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("the Ray head did not start: " + (
                        Path(temp_dir) / "head.log").read_text()[-2000:]) from None
                time.sleep(0.5)
        yield address
    finally:
        head.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            head.wait(30)
        deadline = time.monotonic() + 30
        while (pids := _session_pids(temp_dir)) and time.monotonic() < deadline:
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.2)
        if head.poll() is None:
            head.kill()
        shutil.rmtree(temp_dir, ignore_errors=True)
