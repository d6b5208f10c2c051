"""Ray bootstrap and placement: start the embedded local cluster or join an existing one, and
place worker actors one per node.

    orchard up                     ─► start_local():  a Ray head inside this process, loopback
                                       only, whose one node advertises LOCAL_SLOTS worker slots
    orchard up --address HOST:PORT ─► join(address):  an existing cluster (real Macs), each
                                       node started with ``--resources '{"orchard_node": 1}'``

Placement rests on one custom resource, ``orchard_node``. A node offers as many units as
worker slots (1 on a Mac started from ``infra/``), and each worker actor takes
``1 / workers_per_node`` of a unit, so by default one MLX worker lands on each node and
``workers_per_node = 2`` puts two on each. Every worker actor also reserves ``num_cpus``: Ray
sets ``OMP_NUM_THREADS`` from it, and an actor with no CPUs reserved gets one BLAS thread.

The embedded cluster binds loopback only: Ray would otherwise advertise the machine's external
address. Ray reads ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER`` once, at import, to decide this (off
means "single machine, use 127.0.0.1"); ``start_local`` sets it for the child processes and for
this process. Joining leaves it alone (macOS nodes of a real cluster need it set to 1).
"""
from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass

import ray

NODE_RESOURCE = "orchard_node"
RAY_NAMESPACE = "orchard"
LOCAL_SLOTS = 8                 # workers the embedded single-node cluster can host
LOCAL_OBJECT_STORE_BYTES = 128 << 20
JOIN_TIMEOUT_S = 30.0           # `orchard up --address` gives up on a silent head after this


@dataclass(frozen=True, slots=True)
class Placement:
    """Where and how big each worker actor is."""

    cpus_per_worker: float = 1.0
    workers_per_node: int = 1

    def __post_init__(self) -> None:
        if self.cpus_per_worker <= 0:
            raise ValueError(f"cpus per worker must be > 0, got {self.cpus_per_worker}: MLX "
                             "actors need CPUs reserved (else Ray gives them one BLAS thread)")
        if self.workers_per_node < 1:
            raise ValueError(f"workers per node must be >= 1, got {self.workers_per_node}")

    def actor_options(self) -> dict:
        """``.options(...)`` for a worker actor: its CPUs and its share of a node slot."""
        return {"num_cpus": self.cpus_per_worker,
                "resources": {NODE_RESOURCE: 1.0 / self.workers_per_node}}


@dataclass(frozen=True, slots=True)
class NodeInfo:
    node_id: str
    address: str
    slots: float          # ``orchard_node`` units the node offers
    cpus: float
    alive: bool


def local_cpus(workers: int, placement: Placement) -> int:
    """Logical CPUs for the embedded node: room for ``workers`` and as many again to scale.

    Ray prestarts one Python process per logical CPU, so this stays small on small machines.
    """
    want = 2 * workers * placement.cpus_per_worker
    return int(max(os.cpu_count() or 1, min(want, LOCAL_SLOTS * placement.cpus_per_worker)))


# Ray starts its worker processes at niceness 15 (below its own daemons), so a serving worker
# would lose the CPU to anything else on the Mac, an mlx_lm.server beside it included. The
# engine is what the Mac is for: its worker runs at the normal priority. ``ray start`` nodes
# get the same from RAY_worker_niceness=0 (infra/env.sh).
WORKER_NICENESS = 0


def start_local(num_cpus: int | None = None, slots: int = LOCAL_SLOTS,
                object_store_bytes: int = LOCAL_OBJECT_STORE_BYTES) -> str:
    """Start an embedded Ray cluster in this process (loopback only); returns its address.

    Idempotent within a process: when Ray is already initialised, that cluster is used.
    """
    if ray.is_initialized():
        return _gcs_address()
    loopback_only()
    cpus = num_cpus if num_cpus is not None else max(os.cpu_count() or 1, slots)
    ray.init(address="local", num_cpus=cpus, resources={NODE_RESOURCE: float(slots)},
             object_store_memory=object_store_bytes, include_dashboard=False,
             namespace=RAY_NAMESPACE, logging_level=logging.WARNING,
             configure_logging=True, log_to_driver=True,
             _system_config={"worker_niceness": WORKER_NICENESS})
    return _gcs_address()


def join(address: str, timeout_s: float = JOIN_TIMEOUT_S) -> str:
    """Connect this process to a running Ray cluster at ``address`` (``HOST:PORT``, or
    ``auto``: the one ``ray start`` began on this machine); ``ValueError`` naming the address
    when nothing there answers within ``timeout_s``."""
    if not address or (":" not in address and address != "auto"):
        raise ValueError(f"--address must be HOST:PORT of a Ray head (e.g. 10.0.0.1:6379), "
                         f"or 'auto' for the Ray started on this machine; got {address!r}")
    if ray.is_initialized():
        return _gcs_address()
    if address != "auto":
        check_reachable(address, timeout_s)
    try:
        ray.init(address=address, namespace=RAY_NAMESPACE, logging_level=logging.WARNING)
    except ConnectionError as exc:
        raise ValueError(f"cannot join the Ray cluster at {address}: {exc}; is `ray start "
                         "--head` running there (see infra/README.md)?") from None
    if not any(n.slots > 0 for n in nodes()):
        logging.getLogger(__name__).warning(
            "no node of %s offers the %r resource: start nodes with --resources "
            "'{\"%s\": 1}' (infra/start-worker.sh) or no worker can be placed",
            address, NODE_RESOURCE, NODE_RESOURCE)
    return _gcs_address()


def check_reachable(address: str, timeout_s: float = JOIN_TIMEOUT_S) -> None:
    """Fail fast unless a gRPC server (Ray's GCS) answers at ``address`` within ``timeout_s``.

    ``ray.init`` retries an unreachable head for minutes, silently, and ignores Ctrl-C
    meanwhile; this check is what turns a wrong address or a stopped head into an error.
    """
    import grpc

    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot reach the Ray head at {address}: {exc}; is `ray start "
                         "--head` running there (see infra/README.md)?") from None
    channel = grpc.insecure_channel(address)
    try:
        grpc.channel_ready_future(channel).result(timeout=timeout_s)
    except grpc.FutureTimeoutError:
        raise ValueError(f"cannot reach the Ray head at {address}: a connection opens but no "
                         f"gRPC server answered within {timeout_s:g} s; is that the Ray head's "
                         "GCS port (6379 by default)?") from None
    finally:
        channel.close()


AUTH_MODE = "RAY_AUTH_MODE"


def auth_mode() -> str:
    """This process's Ray authentication mode (``token`` once an embedded cluster turned
    Ray's token auth on; Ray keeps the token in the user's ``~/.ray``); "" when unset."""
    return os.environ.get(AUTH_MODE, "")


def use_auth_mode(mode: str) -> None:
    """Join with ``mode`` (the cluster's own, ``auth_mode`` there) unless this process has one
    set already. Ray reads the mode into its config at import: it is read again here, as Ray's
    own ``ray.init`` does when it turns token auth on."""
    if not mode or AUTH_MODE in os.environ:
        return
    from ray._raylet import Config

    os.environ[AUTH_MODE] = mode
    Config.initialize("")


def shutdown() -> None:
    """Disconnect; an embedded cluster started by this process stops with it."""
    if ray.is_initialized():
        ray.shutdown()


def node_id() -> str:
    """This process's Ray node id, the one every worker, span and placement names; ``"local"``
    outside Ray (the in-process backend)."""
    return ray.get_runtime_context().get_node_id() if ray.is_initialized() else "local"


def node_address() -> str:
    """This process's node IP address as Ray reports it; ``"local"`` outside Ray."""
    return ray.util.get_node_ip_address() if ray.is_initialized() else "local"


def nodes() -> list[NodeInfo]:
    """Every node Ray knows, with the worker slots it offers."""
    return [NodeInfo(node_id=n["NodeID"], address=n.get("NodeManagerAddress", ""),
                     slots=float(n.get("Resources", {}).get(NODE_RESOURCE, 0.0)),
                     cpus=float(n.get("Resources", {}).get("CPU", 0.0)), alive=bool(n["Alive"]))
            for n in ray.nodes()]


def _gcs_address() -> str:
    return ray.get_runtime_context().gcs_address


def loopback_only() -> None:
    """Make Ray use 127.0.0.1 for every process of the embedded cluster (see module doc)."""
    from ray._private import ray_constants

    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False
