"""A real frontend over a LocalBackend, served from a background thread, for the API tests.

``running_frontend(run_dir, model_dir, workers)`` yields a ``Harness`` with the config, the
address and clients per tenant/admin; the server, the router and the engines are the real ones.
``frontend_process(run_dir, args, log_name)`` starts ``python -m cluster.api.frontend`` as a
process of its own on free ports and returns it with its address record once it serves.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from cluster.api.client import Client
from cluster.config import Config, load_config
from cluster.api.frontend import Frontend, serve
from cluster.backend.local import LocalBackend
from tests.support.paths import REPO
from workers.engine.engine import EngineConfig


# One tenant (acme) and an admin key: the config most API tests run under.
ACME_CONFIG = """
[[tenants]]
name = "acme"
api_keys = ["key-acme"]

[admin]
api_keys = ["key-admin"]
"""

# Two tenants (acme and beta) and an admin key: for isolation between tenants.
TWO_TENANTS_CONFIG = """
[[tenants]]
name = "acme"
api_keys = ["key-acme"]

[[tenants]]
name = "beta"
api_keys = ["key-beta"]

[admin]
api_keys = ["key-admin"]
"""


@dataclass
class Harness:
    config: Config
    frontend: Frontend
    backend: LocalBackend
    loop: asyncio.AbstractEventLoop

    @property
    def address(self) -> str:
        return self.frontend.address

    def client(self, tenant: str | None = None, admin: bool = False,
               api_key: str | None = None) -> Client:
        if api_key is None:
            api_key = sorted(self.config.admin_keys)[0] if admin else self.config.key_for(tenant)
        return Client(self.address, api_key)

    def run(self, coro, timeout_s: float = 60.0):
        """Run a coroutine on the server's loop (e.g. to inspect the backend)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)


@contextlib.contextmanager
def running_frontend(run_dir: Path, model_dir: Path, workers: int = 2, block_size: int = 16,
                     engine: EngineConfig | None = None, tokenizer=None):
    config = load_config(run_dir)
    ready = threading.Event()
    box: dict = {}

    async def main() -> None:
        backend = LocalBackend(model_dir, workers=workers,
                               engine=engine or EngineConfig(block_size=block_size, max_batch=4))
        try:
            await backend.start()
            frontend = await serve(config, backend, tokenizer)
        except Exception as exc:  # handed to the test, which expects it or fails on it
            await backend.close()
            box["error"] = exc
            ready.set()
            return
        stop = asyncio.Event()
        box.update(harness=Harness(config, frontend, backend, asyncio.get_running_loop()),
                   stop=stop)
        ready.set()
        await stop.wait()
        await frontend.stop(grace_s=0.2)
        await backend.close()

    thread = threading.Thread(target=asyncio.run, args=(main(),), name="frontend", daemon=True)
    thread.start()
    ready.wait(120)
    if "error" in box:
        raise box["error"]
    harness: Harness = box["harness"]
    try:
        yield harness
    finally:
        harness.loop.call_soon_threadsafe(box["stop"].set)
        thread.join(30)


def write_process_config(run_dir: Path, extra: str = "") -> None:
    """``orchard.toml`` for a frontend process on the tiny model: tenant acme (key-acme), an
    admin key, two slots; ``extra`` appended (more sections)."""
    from tests.support.forged_models import tiny_model

    (run_dir / "orchard.toml").write_text(f"""
[[tenants]]
name = "acme"
api_keys = ["key-acme"]

[admin]
api_keys = ["key-admin"]

[limits]
max_concurrent = 2

[model]
dir = "{tiny_model()}"
""" + extra)


def frontend_process(run_dir: Path, args: list[str], log_name: str,
                     within_s: float = 120.0) -> tuple[subprocess.Popen, dict]:
    """``python -m cluster.api.frontend --run-dir RUN ARGS`` on free ports (stderr to
    ``RUN/log_name``); the process and its own address record once it serves."""
    proc = subprocess.Popen([sys.executable, "-m", "cluster.api.frontend", "--run-dir",
                             str(run_dir), *args, "--port", "0", "--http-port", "0"],
                            cwd=REPO, stdout=subprocess.DEVNULL,
                            stderr=open(run_dir / log_name, "ab"))
    deadline = time.monotonic() + within_s
    while True:
        for path in (run_dir / "frontends").glob("*.json"):
            record = json.loads(path.read_text())
            if record["pid"] == proc.pid:
                return proc, record
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError((run_dir / log_name).read_text()[-3000:])
        time.sleep(0.05)
