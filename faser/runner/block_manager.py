"""Paged KV blocks: allocate, grow, roll back, free.

The target and the draft share one block table per request (two caches with the same number of
blocks), so a slot means the same position in both. Rolling back rejected draft positions is
shrinking a request's length and returning the blocks it no longer covers."""

from __future__ import annotations

from collections import deque


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._owner: dict[int, str] = {}  # block -> request id, to catch double use

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self._free) / self.num_blocks

    def blocks_needed(self, block_table: list[int], num_slots: int) -> int:
        """Blocks to add so that the table covers `num_slots` slots."""
        return max(0, -(-num_slots // self.block_size) - len(block_table))

    def can_allocate(self, block_table: list[int], num_slots: int) -> bool:
        return self.blocks_needed(block_table, num_slots) <= len(self._free)

    def allocate(self, request_id: str, block_table: list[int], num_slots: int) -> bool:
        """Grows the table to cover `num_slots` slots; all or nothing."""
        needed = self.blocks_needed(block_table, num_slots)
        if needed > len(self._free):
            return False
        for _ in range(needed):
            block = self._free.popleft()
            assert block not in self._owner, f"block {block} handed out twice"
            self._owner[block] = request_id
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

    def _release(self, block: int) -> None:
        assert block in self._owner, f"block {block} freed twice"
        del self._owner[block]
        self._free.append(block)
