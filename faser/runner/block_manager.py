"""Paged KV blocks: allocate, grow, roll back, free, and share cached prefixes.

The target and the draft share one block table per request (two caches with the same number of
blocks), so a slot means the same position in both. Rolling back rejected draft positions is
shrinking a request's length and returning the blocks it no longer covers.

Prefix caching: a full block whose positions the target has computed for committed tokens is
registered under a digest of every token up to its end (a chain: the previous block's digest and
its own tokens), so that a later request whose tokens begin the same way reads it instead of
computing it again. Where the step's kernels are row-invariant, a position gets the same bits
however its prompt was chunked, so a shared block holds exactly what the request would have
computed (elsewhere it differs as a chunked prefill does). A registered block is shared
by reference count; once nobody holds it, it stays cached, and free blocks are handed out before
the least recently released cached ones are evicted. The draft's half of a shared block is
trusted only once the request that registered it had fed the draft up to the block's end. A feature
draft's inputs, the target's features, live in the blocks' slots of the feature cache, so they are
shared with the KV where the registering request's forwards computed them: a request that drafts
from them shares only such blocks, and a block it computes replaces a registered one without
them."""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from collections.abc import Sequence
from typing import NamedTuple

ROOT_DIGEST = b""


def block_digest(parent: bytes, token_ids: Sequence[int]) -> bytes:
    """A block's key: its tokens and, through `parent`, every token before them. A cryptographic
    hash, since two prefixes that collided would share KV that one of them never computed."""
    return hashlib.sha256(parent + array("q", token_ids).tobytes()).digest()


class SharedPrefix(NamedTuple):
    blocks: list[int]  # the registered blocks the request now holds too
    num_draft_ready: int  # how many of them lead with their draft half filled
    num_featured: int  # how many of them lead with the target's features in their slots


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = False) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.prefix_caching = prefix_caching
        self._free: deque[int] = deque(range(num_blocks))
        self._refs: dict[int, int] = {}  # block -> the tables that hold it
        self._cached: OrderedDict[int, None] = OrderedDict()  # registered, held by nobody: LRU
        self._by_digest: dict[bytes, int] = {}
        self._digest_of: dict[int, bytes] = {}
        self._draft_ready: set[int] = set()  # registered blocks whose draft half is filled
        self._featured: set[int] = set()  # registered blocks whose slots hold the features

    @property
    def num_free_blocks(self) -> int:
        return len(self._free) + len(self._cached)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Registered blocks, held or not."""
        return len(self._by_digest)

    def blocks_needed(self, block_table: list[int], num_slots: int) -> int:
        """Blocks to add so that the table covers `num_slots` slots."""
        return max(0, -(-num_slots // self.block_size) - len(block_table))

    def can_allocate(self, block_table: list[int], num_slots: int) -> bool:
        return self.blocks_needed(block_table, num_slots) <= self.num_free_blocks

    def allocate(self, request_id: str, block_table: list[int], num_slots: int) -> bool:
        """Grows the table to cover `num_slots` slots; all or nothing."""
        needed = self.blocks_needed(block_table, num_slots)
        if needed > self.num_free_blocks:
            return False
        for _ in range(needed):
            block = self._free.popleft() if self._free else self._evict()
            assert block not in self._refs, f"block {block} handed out twice"
            self._refs[block] = 1
            block_table.append(block)
        return True

    def truncate(self, block_table: list[int], num_slots: int) -> None:
        """Frees the blocks past the first `num_slots` slots (rollback)."""
        keep = -(-num_slots // self.block_size)
        while len(block_table) > keep:
            self._release(block_table.pop())

    def free(self, block_table: list[int]) -> None:
        while block_table:
            self._release(block_table.pop())

    # -- prefix caching ------------------------------------------------------------------------

    def share(self, token_ids: Sequence[int], digests: list[bytes],
              featured: bool = False) -> SharedPrefix:
        """The registered blocks that hold the longest run of full blocks `token_ids` begins with
        (with `featured`, only blocks whose slots hold the target's features), each now held once
        more; `digests` (empty) receives their keys."""
        blocks: list[int] = []
        parent = ROOT_DIGEST
        for end in range(self.block_size, len(token_ids) + 1, self.block_size):
            digest = block_digest(parent, token_ids[end - self.block_size : end])
            block = self._by_digest.get(digest)
            if block is None or (featured and block not in self._featured):
                break
            self._hold(block)
            blocks.append(block)
            digests.append(digest)
            parent = digest
        return SharedPrefix(blocks, _leading(blocks, self._draft_ready),
                            _leading(blocks, self._featured))

    def register(
        self, block_table: list[int], token_ids: Sequence[int], digests: list[bytes],
        num_positions: int, num_draft_positions: int, num_draft_marked: int,
        num_featured: int = 0,
    ) -> int:
        """Registers the table's full blocks within the first `num_positions` positions (those the
        target holds for `token_ids`) past the `len(digests)` already keyed, appending their
        keys, those within the first `num_featured` as holding the target's features; marks
        those past the first `num_draft_marked` and within `num_draft_positions` as holding the
        draft's half too, and returns how many are marked. A block whose key another block
        already holds stays the table's own, unless it has the features the other lacks."""
        size = self.block_size
        for n in range(len(digests), min(num_positions, len(token_ids)) // size):
            parent = digests[-1] if digests else ROOT_DIGEST
            digest = block_digest(parent, token_ids[n * size : (n + 1) * size])
            digests.append(digest)
            block, held = block_table[n], self._by_digest.get(digest)
            featured = (n + 1) * size <= num_featured
            if block in self._digest_of:
                continue
            if held is not None and (held in self._featured or not featured):
                continue
            if held is not None:
                self._unregister(held)
            self._by_digest[digest] = block
            self._digest_of[block] = digest
            if featured:
                self._featured.add(block)
        marked = max(num_draft_marked, min(len(digests), num_draft_positions // size))
        for n in range(num_draft_marked, marked):
            block = block_table[n]
            if self._digest_of.get(block) == digests[n]:
                self._draft_ready.add(block)
        return marked

    def _hold(self, block: int) -> None:
        if block in self._cached:
            del self._cached[block]
            self._refs[block] = 1
        else:
            self._refs[block] += 1

    def _evict(self) -> int:
        block, _ = self._cached.popitem(last=False)
        del self._by_digest[self._digest_of.pop(block)]
        self._draft_ready.discard(block)
        self._featured.discard(block)
        return block

    def _unregister(self, block: int) -> None:
        """Its key goes to another block: its holders keep it as their own, and once none
        does, it is free."""
        del self._by_digest[self._digest_of.pop(block)]
        self._draft_ready.discard(block)
        self._featured.discard(block)
        if block in self._cached:
            del self._cached[block]
            self._free.append(block)

    def _release(self, block: int) -> None:
        assert block in self._refs, f"block {block} freed twice"
        self._refs[block] -= 1
        if self._refs[block]:
            return
        del self._refs[block]
        if block in self._digest_of:
            self._cached[block] = None
        else:
            self._free.append(block)


def _leading(blocks: list[int], marked: set[int]) -> int:
    """How many of `blocks` lead in `marked`."""
    return next((n for n, b in enumerate(blocks) if b not in marked), len(blocks))
