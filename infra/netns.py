"""Several Ray nodes on one Linux box: one network namespace per node, joined by a bridge.

    ┌ orch<tag>hub ─────────── bridge ob<tag> ───────────────┐
    │        │                     │                     │    │
    └─ veth ─┼──────────── veth ───┼──────────── veth ───┼────┘
       ┌─────┴──────┐        ┌─────┴──────┐        ┌─────┴──────┐
       │ orch<tag>h │        │ orch<tag>1 │        │ orch<tag>2 │
       │ 10.213.T.1 │        │ 10.213.T.2 │        │ 10.213.T.3 │
       │ Ray head   │        │ Ray worker │        │ Ray worker │
       │ (no slot)  │        │ orchard_   │        │ orchard_   │
       │            │        │  node: 1   │        │  node: 1   │
       └────────────┘        └────────────┘        └────────────┘

Addresses are orchard's own (10.213.T.0/24 on a bridge that lives in its own namespace): no
traffic leaves the namespaces. Each node runs ``ray start --block`` in its namespace; killing a
node means SIGKILL to every process in its namespace (``ip netns pids``), never ``ray stop``,
which would stop every Ray process on the machine. Needs root (CAP_NET_ADMIN).

    python infra/netns.py probe      # can this machine do it? (exit 0 if yes)

The multi-node test (``tests/cluster/backend/test_bootstrap.py``) drives ``NetnsCluster`` from Python.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

RAY_PORT = 6379
# Ray's failure detection, shortened so a killed node is noticed in seconds, not a minute.
FAST_FAILURE_ENV = {"RAY_health_check_period_ms": "1000",
                    "RAY_health_check_timeout_ms": "1000",
                    "RAY_health_check_failure_threshold": "3"}


def _ip(*args: str, ns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    cmd = ["ip", *(["netns", "exec", ns, "ip"] if ns else []), *args]
    return subprocess.run(cmd, check=check, capture_output=True, text=True)


def probe() -> str | None:
    """None when network namespaces work here; otherwise why not."""
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is missing"
    if os.geteuid() != 0:
        return "network namespaces need root"
    name = f"orchprobe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return None


@dataclass
class Node:
    name: str          # short: "h", "1", "2"
    netns: str
    address: str
    slots: int
    process: subprocess.Popen | None = None


@dataclass
class NetnsCluster:
    """A head and ``workers`` worker nodes, each in its own namespace."""

    workers: int = 2
    python: str = sys.executable
    tag: str = field(default_factory=lambda: f"{os.getpid() % 100000}")
    nodes: list[Node] = field(default_factory=list)
    root: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="orch-netns-")))

    @property
    def subnet(self) -> str:
        return f"10.213.{int(self.tag) % 250 + 1}"

    @property
    def hub(self) -> str:
        return f"orch{self.tag}hub"

    @property
    def head(self) -> Node:
        return self.nodes[0]

    @property
    def ray_address(self) -> str:
        return f"{self.head.address}:{RAY_PORT}"

    def env(self) -> dict[str, str]:
        """The environment of every process in the cluster (Ray's and orchard's)."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
        env.update(FAST_FAILURE_ENV, RAY_AUTH_MODE="disabled",
                   RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="1", RAY_USAGE_STATS_ENABLED="0",
                   RAY_worker_niceness="0")
        return env

    # ------------------------------------------------------------- network

    def create(self) -> None:
        """The namespaces, the bridge and one veth pair per node."""
        subprocess.run(["ip", "netns", "add", self.hub], check=True, capture_output=True)
        _ip("link", "add", f"ob{self.tag}", "type", "bridge", ns=self.hub)
        _ip("link", "set", f"ob{self.tag}", "up", ns=self.hub)
        _ip("link", "set", "lo", "up", ns=self.hub)
        names = ["h", *(str(i + 1) for i in range(self.workers))]
        for i, name in enumerate(names):
            netns = f"orch{self.tag}{name}"
            node = Node(name, netns, f"{self.subnet}.{i + 1}", 0 if name == "h" else 1)
            subprocess.run(["ip", "netns", "add", netns], check=True, capture_output=True)
            self.nodes.append(node)
            outer, inner = f"o{self.tag}{name}", f"i{self.tag}{name}"
            _ip("link", "add", outer, "type", "veth", "peer", "name", inner, ns=self.hub)
            _ip("link", "set", inner, "netns", netns, ns=self.hub)
            _ip("link", "set", outer, "master", f"ob{self.tag}", ns=self.hub)
            _ip("link", "set", outer, "up", ns=self.hub)
            _ip("addr", "add", f"{node.address}/24", "dev", inner, ns=netns)
            _ip("link", "set", inner, "up", ns=netns)
            _ip("link", "set", "lo", "up", ns=netns)

    # ----------------------------------------------------------------- Ray

    def start_ray(self, timeout_s: float = 180.0) -> None:
        """``ray start --block`` on every node; returns once all have joined the head."""
        ray = str(Path(self.python).with_name("ray"))
        for node in self.nodes:
            argv = ["ip", "netns", "exec", node.netns, ray, "start", "--block",
                    f"--node-ip-address={node.address}", "--num-cpus=1",
                    f"--resources={json.dumps({'orchard_node': node.slots})}",
                    "--object-store-memory=80000000", "--disable-usage-stats",
                    f"--temp-dir={self.root / node.name}"]
            argv += ["--head", f"--port={RAY_PORT}", "--include-dashboard=false"] \
                if node is self.head else [f"--address={self.ray_address}"]
            log = (self.root / f"ray-{node.name}.log").open("wb")
            node.process = subprocess.Popen(argv, env=self.env(), stdout=log,
                                            stderr=subprocess.STDOUT, start_new_session=True)
            if node is self.head:
                self._wait_for(lambda: self._port_open(self.head), timeout_s, "the Ray head")
        self._wait_for(lambda: self.alive_nodes() == len(self.nodes), timeout_s,
                       f"{len(self.nodes)} Ray nodes")

    def run_in(self, node: Node, argv: list[str], **kwargs) -> subprocess.CompletedProcess:
        return subprocess.run(["ip", "netns", "exec", node.netns, *argv], env=self.env(),
                              **kwargs)

    def popen_in(self, node: Node, argv: list[str], **kwargs) -> subprocess.Popen:
        return subprocess.Popen(["ip", "netns", "exec", node.netns, *argv], env=self.env(),
                                **kwargs)

    def alive_nodes(self) -> int:
        code = ("import ray,json; ray.init(address='%s', logging_level='ERROR'); "
                "print(json.dumps(sum(1 for n in ray.nodes() if n['Alive'])))" % self.ray_address)
        done = self.run_in(self.head, [self.python, "-c", code], capture_output=True,
                           text=True, timeout=120)
        try:
            return int(done.stdout.strip().splitlines()[-1])
        except (ValueError, IndexError):
            return 0

    def kill_node(self, node: Node) -> int:
        """SIGKILL every process in ``node``'s namespace (its raylet, workers, actors)."""
        return _kill_netns(node.netns)

    # ------------------------------------------------------------ teardown

    def destroy(self) -> None:
        """Kill every process of every node, then remove the namespaces; idempotent."""
        for node in reversed(self.nodes):
            deadline = time.monotonic() + 15
            while _kill_netns(node.netns) and time.monotonic() < deadline:
                time.sleep(0.2)  # a dying raylet may still be forking workers: again
            if node.process is not None and node.process.poll() is None:
                node.process.kill()
            subprocess.run(["ip", "netns", "del", node.netns], capture_output=True)
        subprocess.run(["ip", "netns", "del", self.hub], capture_output=True)
        shutil.rmtree(self.root, ignore_errors=True)

    # ------------------------------------------------------------ internals

    def _port_open(self, node: Node) -> bool:
        code = ("import socket; s=socket.socket(); s.settimeout(1); "
                f"s.connect(('{node.address}', {RAY_PORT}))")
        return self.run_in(node, [self.python, "-c", code], capture_output=True).returncode == 0

    @staticmethod
    def _wait_for(ok, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if ok():
                return
            time.sleep(0.5)
        raise TimeoutError(f"{what} not up after {timeout_s:.0f} s")


def _kill_netns(netns: str) -> int:
    pids = subprocess.run(["ip", "netns", "pids", netns], capture_output=True, text=True)
    killed = 0
    for pid in (int(p) for p in pids.stdout.split()):
        if _zombie(pid):
            continue
        try:
            os.kill(pid, signal.SIGKILL)
            killed += 1
        except ProcessLookupError:
            pass
    return killed


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True


if __name__ == "__main__":
    if sys.argv[1:] == ["probe"]:
        reason = probe()
        print(reason or "network namespaces work here")
        sys.exit(1 if reason else 0)
    print(__doc__)
    sys.exit(2)
