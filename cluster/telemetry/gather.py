"""Bring every node's trace and metric files into one directory, through Ray.

With ``exporter = "file"`` each process writes ``RUN_DIR/traces/<service>-<host>-<pid>.jsonl``
on its own machine's disk, so the worker spans of a multi-Mac cluster are spread over the
Macs. ``gather`` runs one small Ray task pinned to each alive node; the task reads that
node's ``RUN_DIR/traces`` and ``RUN_DIR/metrics`` files and returns them, and the caller
writes them under ``OUT/traces`` and ``OUT/metrics``, which ``orchard report --traces
OUT/traces`` then reads as one run::

    node A (head)  RUN/traces/orchard-frontend-a-11.jsonl, orchard-worker-a-12.jsonl ─┐
    node B         RUN/traces/orchard-worker-b-31.jsonl                            ─┼─► OUT/traces/
    node C         RUN/traces/orchard-worker-c-17.jsonl                            ─┘

File names already carry host and pid, so they do not collide; nodes that share a disk
(the single-machine cluster) send the same files, and each is written once. A file that
two nodes hold with different contents keeps both, the second prefixed by its node.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import ray

KINDS = ("traces", "metrics")


@dataclass(frozen=True, slots=True)
class NodeFiles:
    node_id: str
    address: str
    files: tuple[tuple[str, str, bytes], ...]   # (kind, file name, contents)


@ray.remote(num_cpus=0)
def _read_node(run_dir: str) -> tuple[tuple[str, str, bytes], ...]:
    out = []
    for kind in KINDS:
        folder = Path(run_dir) / kind
        if folder.is_dir():
            out.extend((kind, p.name, p.read_bytes()) for p in sorted(folder.glob("*.jsonl")))
    return tuple(out)


def node_files(run_dir: Path, node_id: str, address: str) -> NodeFiles:
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    pinned = _read_node.options(
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False))
    return NodeFiles(node_id, address, ray.get(pinned.remote(str(run_dir.resolve()))))


def write_gathered(gathered: NodeFiles, out: Path) -> int:
    """Write one node's files under ``out``; returns how many were new."""
    written = 0
    for kind, name, data in gathered.files:
        folder = out / kind
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / name
        if path.exists() and path.read_bytes() == data:
            continue
        if path.exists():
            path = folder / f"{gathered.node_id[:12]}-{name}"
        path.write_bytes(data)
        written += 1
    return written


def gather(run_dir: Path, out: Path, nodes: list[tuple[str, str]],
           progress: Callable[[NodeFiles, int], None] = lambda node, n: None) -> int:
    """Copy every node's trace and metric files to ``out``; ``nodes`` are (node id,
    address) of the alive nodes. Returns the number of files written."""
    if out.resolve() == run_dir.resolve():
        raise ValueError(f"--out must differ from the run directory {run_dir}: gathering into "
                         f"it would mix the copies with the files being written")
    total = 0
    for node_id, address in nodes:
        gathered = node_files(run_dir, node_id, address)
        written = write_gathered(gathered, out)
        progress(gathered, written)
        total += written
    return total
