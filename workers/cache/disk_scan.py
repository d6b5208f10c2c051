"""What a disk tier finds in its directory at start: the blocks it may restore, and what it
deleted (``workers.cache.disk_tier``'s restart rules, applied to the files).

Leftover ``.tmp`` files, files whose size disagrees with their header and blocks whose parent
chain loops are torn; files of an older format are outdated; another model's or revision's
blocks are foreign; blocks unused for ``ttl_s`` (file mtime) are expired: each is deleted
and counted. Of the rest, the newest that fit the budget are restored, a parent counted at
least as recent as any of its descendants (the ledger's rule).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from router.kv.key import BlockHash
from workers.cache.disk_files import (SUFFIX, TMP_SUFFIX, BlockRecord, CorruptBlock,
                                      OutdatedBlock, block_path, read_header)


@dataclass(slots=True)
class ScanCounts:
    torn: int = 0
    foreign: int = 0
    expired: int = 0
    outdated: int = 0
    over_budget: int = 0


@dataclass(slots=True)
class Scan:
    """The servable blocks found (each with its file's mtime) and what was deleted."""

    directory: Path
    now: float
    found: dict[BlockHash, tuple[BlockRecord, float]] = field(default_factory=dict)
    counts: ScanCounts = field(default_factory=ScanCounts)

    def newest_within(self, budget: int, bytes_per_token: int) -> list[tuple[BlockRecord, float]]:
        """The newest blocks that fit ``budget``, newest first, each with its age in seconds
        (a parent as recent as its newest descendant); the others' files are deleted."""
        found = self.found
        used = {h: t for h, (_, t) in found.items()}
        for h, (record, t) in found.items():
            p = record.parent
            while p in used and used[p] < t:
                used[p] = t
                p = found[p][0].parent
        depth = {h: len(_ancestors(h, found)) for h in found}
        keep = []
        for h in sorted(found, key=lambda h: (-used[h], depth[h])):
            cost = len(found[h][0].tokens) * bytes_per_token
            if cost <= budget:
                budget -= cost
                keep.append((found[h][0], self.now - used[h]))
            else:
                delete(block_path(self.directory, h))
                self.counts.over_budget += 1
        return keep


def scan(directory: Path, model: str, revision: str, ttl_s: float, now: float) -> Scan:
    """Index ``directory``'s block files by their headers (``now``: the wall clock)."""
    out = Scan(directory, now)
    c = out.counts
    for path in sorted(directory.glob("*/*")):
        if path.name.endswith(TMP_SUFFIX):
            c.torn += delete(path)
            continue
        if not path.name.endswith(SUFFIX):
            continue
        try:
            record = read_header(path)
            if path != block_path(directory, record.block):
                raise CorruptBlock(f"{path}: holds block {record.block:032x}")
        except OutdatedBlock:
            c.outdated += delete(path)
            continue
        except CorruptBlock:
            c.torn += delete(path)
            continue
        if (record.model, record.revision) != (model, revision):
            c.foreign += delete(path)
        elif now - path.stat().st_mtime >= ttl_s:
            c.expired += delete(path)
        else:
            out.found[record.block] = (record, path.stat().st_mtime)
    for h in [h for h in out.found if _ancestors(h, out.found) is None]:
        c.torn += delete(block_path(directory, h))
        del out.found[h]
    return out


def _ancestors(h: BlockHash, found: dict) -> list[BlockHash] | None:
    """``h``'s ancestors held here, nearest first; None if its chain loops (corrupt files)."""
    out, p = [], found[h][0].parent
    while p in found:
        if len(out) == len(found):  # as many ancestors as blocks: the chain came round
            return None
        out.append(p)
        p = found[p][0].parent
    return out


def delete(path: Path) -> int:
    path.unlink(missing_ok=True)
    return 1
