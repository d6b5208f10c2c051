"""The shape of a ``router.kv.ledger.BlockLedger``'s holdings: each held block, its children.

Blocks form a tree keyed by the chained ``BlockHash`` (see ``router.kv.key``)::

    ns root ─► h0 ─► h1 ─► h2        a block's parent is the block before it, or the
                    └──► h1' ─► h2'  namespace root for a prompt's first block

``BlockTree`` owns that shape: the entry of every held block, each parent's stored children,
how many blocks each namespace holds and how many tokens all of them hold. The ledger owns
the rest (the LRU and expiry orders, the events, the counts) and changes the tree only
through ``add`` and ``pop``; the fields of an entry that say when it was used (``last_used``,
``ttl_s``, ``hits``, ``priority``) are the ledger's to change.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

from router.kv.key import BlockHash


@dataclass(slots=True)
class Entry:
    parent: BlockHash
    tokens: int
    namespace: str
    created: float
    last_used: float
    ttl_s: float
    hits: int = 0
    priority: float = 0.0


class BlockTree:
    """Held blocks by hash, each with its parent, its children and its namespace."""

    def __init__(self) -> None:
        self._entries: dict[BlockHash, Entry] = {}
        self._children: dict[BlockHash, set[BlockHash]] = {}  # parent -> stored children
        self._namespaces: dict[str, int] = {}  # label -> stored blocks
        self.tokens = 0

    def __contains__(self, block: BlockHash) -> bool:
        return block in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def __getitem__(self, block: BlockHash) -> Entry:
        return self._entries[block]

    def get(self, block: BlockHash) -> Entry | None:
        return self._entries.get(block)

    @property
    def entries(self) -> Mapping[BlockHash, Entry]:
        return self._entries

    def children(self, parent: BlockHash) -> list[BlockHash]:
        """Stored blocks whose parent is ``parent`` (a block or a namespace root)."""
        return list(self._children.get(parent, ()))

    def has_children(self, block: BlockHash) -> bool:
        return bool(self._children.get(block))

    def namespaces(self) -> list[str]:
        return sorted(self._namespaces)

    def holds_namespace(self, label: str) -> bool:
        return label in self._namespaces

    def in_namespace(self, label: str) -> list[BlockHash]:
        """Every held block of namespace ``label``."""
        return [h for h, e in self._entries.items() if e.namespace == label]

    def chain_to(self, block: BlockHash) -> list[BlockHash]:
        """The held chain ending at ``block`` (root side first); empty when it is not held."""
        chain = []
        while block in self._entries:
            chain.append(block)
            block = self._entries[block].parent
        return chain[::-1]

    def held_run(self, hashes: Sequence[BlockHash]) -> int:
        """How many leading ``hashes`` are held (by hash: the store verifies what they hold)."""
        n = 0
        for h in hashes:
            if h not in self._entries:
                break
            n += 1
        return n

    def held_prefix(self, hashes: Sequence[BlockHash], root: BlockHash, namespace: str) -> int:
        """How many of ``hashes`` are held as this chain's blocks: same namespace, and each
        one's parent the block before it (the first's, ``root``)."""
        # A for loop, not a while on an index: no slip in the count can make it spin forever.
        n, parent = 0, root
        for h in hashes:
            entry = self._entries.get(h)
            if entry is None or entry.parent != parent or entry.namespace != namespace:
                break
            n, parent = n + 1, h
        return n

    def subtree(self, top: BlockHash) -> list[BlockHash]:
        """``top`` and every block below it, breadth first (reversed: children first)."""
        order = [top]
        for h in order:  # breadth first: the list grows under the loop, each block once
            order.extend(self._children.get(h, ()))
        return order

    def add(self, h: BlockHash, entry: Entry) -> None:
        self._entries[h] = entry
        self._children.setdefault(entry.parent, set()).add(h)
        self._namespaces[entry.namespace] = self._namespaces.get(entry.namespace, 0) + 1
        self.tokens += entry.tokens

    def pop(self, h: BlockHash) -> Entry:
        """Remove the leaf ``h``; a block with children is a ``RuntimeError``."""
        entry = self._entries.pop(h)
        if self._children.get(h):
            raise RuntimeError(f"block {h:032x} removed before its children")
        siblings = self._children.get(entry.parent)
        if siblings is not None:
            siblings.discard(h)
            if not siblings:
                del self._children[entry.parent]
        self.tokens -= entry.tokens
        left = self._namespaces[entry.namespace] - 1
        if left:
            self._namespaces[entry.namespace] = left
        else:
            del self._namespaces[entry.namespace]
        return entry


def token_counts_for(hashes: Sequence[BlockHash], token_counts: Sequence[int] | int) -> list[int]:
    """One token count per block of ``hashes``, from a list of them or a single block size."""
    counts = [token_counts] * len(hashes) if isinstance(token_counts, int) else list(
        token_counts)
    if len(counts) != len(hashes) or any(c <= 0 for c in counts):
        raise ValueError("token_counts must be one positive count per block (or one block "
                         f"size); got {len(counts)} counts for {len(hashes)} blocks")
    return counts
