"""Block bookkeeping for a cache laid out in groups of blocks (DeepSeek-V4).

DeepSeek-V4's cache (engine/kv/compressed_cache.py) keeps the compressed rows of
a whole group of ``row_group`` blocks in the group's first block, the head. So a
head is written while any block of its group is computed, and what it holds
depends on every token of the group. Three things change from BlockManager:

- a window never gives a head back (kept_in_window), since the rows are read
  for the request's whole life;
- the prefix cache publishes a group only once all of it is computed, and names
  every block of the group by the group's tokens, not its own alone
  (block_hash): a head with one group's rows can never be found behind another
  group's tokens, even when the two share their first blocks;
- so it hits whole groups only (match_prefix).

And since V4 computes every token the same whatever its window gave back, groups
computed after the first give-back are published too (cache_full_blocks).
"""

from __future__ import annotations

from engine.kv.block_manager import BlockManager
from engine.kv.hashing import chain_hash
from engine.sched.scheduler_output import HOLE
from engine.sequence import Sequence


class GroupedBlockManager(BlockManager):
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool,
        root: bytes,
        row_group: int,
    ) -> None:
        super().__init__(num_blocks, block_size, enable_prefix_caching, root)
        self.row_group = row_group

    def block_hash(self, parent: bytes, token_ids: list[int], i: int) -> bytes:
        """Block i's name, from block i-1's (``parent``): a head's covers its whole
        group's tokens; each other block's follows from the block before it in the
        group, marked with its place (a negative number, never a token id)."""
        group_tokens = self.block_size * self.row_group
        if i % self.row_group:
            return chain_hash(parent, (-1 - i % self.row_group,))
        start = i * self.block_size
        return chain_hash(chain_hash(parent, token_ids[start : start + group_tokens]), (-1,))

    def match_prefix(self, token_ids: list[int]) -> list[int]:
        """The cached blocks of the longest prefix of whole groups (never the last
        token: the model must run on at least one)."""
        if not self.enable_prefix_caching:
            return []
        hits: list[int] = []
        parent, bs = self.root, self.block_size
        groups = (len(token_ids) - 1) // (bs * self.row_group)
        for i in range(groups * self.row_group):
            parent = self.block_hash(parent, token_ids, i)
            block_id = self.cached_blocks.get(parent)
            chunk = tuple(token_ids[i * bs : (i + 1) * bs])
            if block_id is None or self.blocks[block_id].token_ids != chunk:
                break  # a miss, or a hash collision caught by comparing tokens
            hits.append(block_id)
        return hits[: len(hits) - len(hits) % self.row_group]

    def cache_full_blocks(self, seq: Sequence, num_computed: int | None = None) -> None:
        """Publish every whole group now computed and still held. Unlike a generic
        window's, V4's computes each token the same whatever was given back (its
        attention never reads past its own window), so groups computed after the
        first give-back are published too; a group with a hole never is."""
        if not self.enable_prefix_caching:
            return
        if num_computed is None:
            num_computed = seq.num_computed_tokens
        full = num_computed // (self.block_size * self.row_group) * self.row_group
        for i in range(len(seq.block_hashes), full):
            if seq.block_table[i] == HOLE:
                break  # given back before it was published: it never will be
            parent = seq.block_hashes[-1] if seq.block_hashes else self.root
            h = self.block_hash(parent, seq.token_ids, i)
            seq.block_hashes.append(h)
            block = self.blocks[seq.block_table[i]]
            if h not in self.cached_blocks:  # first writer wins; twins stay private
                self.cached_blocks[h] = block.block_id
                chunk = tuple(seq.token_ids[i * self.block_size : (i + 1) * self.block_size])
                block.hash, block.token_ids = h, chunk

    def kept_in_window(self, i: int) -> bool:
        """A group's head stays: it holds the group's compressed rows. The blocks
        the window gives back then form one run but for the heads, which only grows."""
        return i % self.row_group == 0
