"""KV-cache groups: each kind of cached state that needs a block table of its own.

A request's cached state is grouped by how its blocks follow the tokens, as
vLLM groups layers by their KVCacheSpec. Each group has its own block table,
and all of them draw blocks from the pool's one free list:

- the *token group*, group 0, which every model has: one block per
  ``block_size`` tokens. It holds whatever a layer keeps per token: keys and
  values, MLA's latent, DSA's index keys, DeepSeek-V4's raw rows and compressor
  states. They share one table because they follow the tokens alike. Under a
  sliding window (EngineConfig.kv_window) the blocks behind it are given back
  as the request runs (BlockManager.free_outside_window);
- *span groups*, one block per ``span`` tokens, kept for the request's life:
  DeepSeek-V4's compressed rows with their indexer keys (kv/compressed_cache.py).
  A span block is written until its span's last token has run, so the prefix
  cache hits whole spans only (KVCacheCoordinator.match_prefix).

A Sequence holds a table per group (Sequence.block_tables), a step's request
carries them all (ScheduledRequest.block_tables), and attention reads them by
group index (AttentionMetadata.group_tables). No seam names a model's kind of
state: the checkpoint declares the groups (EngineConfig.kv_cache_groups), and
the block manager (kv/coordinator.py) and the model's layers read them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class SpanGroup:
    """Blocks of ``span`` tokens' state each, kept for the request's life."""

    span: int  # a multiple of the block size, so a span ends where a token block ends


@dataclass(frozen=True)
class KVCacheGroups:
    """A model's groups: the token group (its block size, and the last ``window``
    tokens a request reads raw, 0 for all of them) and its span groups."""

    block_size: int
    window: int = 0
    spans: tuple[SpanGroup, ...] = ()

    def __post_init__(self) -> None:
        for group in self.spans:
            if group.span <= 0 or group.span % self.block_size:
                raise ValueError(
                    f"a span group of {group.span} tokens does not end where a token "
                    f"block of {self.block_size} ends"
                )

    @property
    def num_groups(self) -> int:
        return 1 + len(self.spans)

    def hit_unit(self) -> int:
        """Tokens a prefix hit is a whole multiple of: every span group's span, or
        one block with none."""
        return math.lcm(self.block_size, *(group.span for group in self.spans))

    def describe(self) -> str:
        """The groups, as the prefix cache's hash chains name the model's layout
        (EngineConfig.model_identity): empty for a token group alone."""
        return "".join(f":row-spans-of-{group.span}" for group in self.spans)
