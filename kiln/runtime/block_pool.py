"""BlockPool: fixed KV-cache blocks with reference counts and a prefix cache (pure Python).

A block is free when its reference count is zero. ``fork`` shares blocks between
sequences (beam search) by raising their counts. A sequence's block table may hold
``RELEASED`` where a block it no longer reads (out of a sliding window) went back to the
pool; ``fork`` and ``free`` pass over those entries.

Prefix caching (``enable_caching``): a full block is registered under a chained hash of its
content (the previous block's hash and its own tokens), so a later sequence starting with
the same tokens takes the block instead of recomputing it. Freed blocks keep their content
and stay findable until they are reused for something else, least recently freed first::

    prompt A: [t0..t3][t4..t7][t8 t9]        blocks 5, 9, 2   (5 and 9 registered)
    prompt B: [t0..t3][t4..t7][u8 ...]       takes 5 and 9, computes from t8 on
"""
from __future__ import annotations

from collections import OrderedDict

from kiln.errors import CapacityError
from kiln.step.metadata import RELEASED




def chain_hash(previous: int | None, tokens: tuple[int, ...]) -> int:
    """The hash of a full block given the hash of the block before it."""
    return hash((previous, tokens))


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = False):
        if num_blocks <= 0:
            raise CapacityError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self._ref_counts = [0] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # oldest freed first
        self._block_of_hash: dict[int, int] = {}
        self._hash_of_block: dict[int, int] = {}
        self._tokens_of_block: dict[int, tuple[int, ...]] = {}
        self.num_queried_blocks = 0  # prefix-cache statistics
        self.num_hit_blocks = 0

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_cached(self) -> int:
        """Blocks whose content is registered (in use or free but still findable)."""
        return len(self._hash_of_block)

    @property
    def hit_rate(self) -> float:
        return self.num_hit_blocks / self.num_queried_blocks if self.num_queried_blocks else 0.0

    def allocate(self, n: int) -> list[int]:
        """``n`` fresh blocks, or :class:`CapacityError` (and nothing taken) if there are fewer free.

        Taking a free block that still holds cached content forgets that content.
        """
        if n > len(self._free):
            raise CapacityError(f"KV cache full: {n} blocks needed, {len(self._free)} of {self.num_blocks} free")
        blocks = []
        for _ in range(n):
            block, _ = self._free.popitem(last=False)
            self._forget(block)
            self._ref_counts[block] = 1
            blocks.append(block)
        return blocks

    def fork(self, blocks: list[int]) -> list[int]:
        """Share ``blocks`` with another owner."""
        for b in blocks:
            if b == RELEASED:
                continue
            if self._ref_counts[b] == 0:
                raise ValueError(f"block {b} is not allocated")
            self._ref_counts[b] += 1
        return list(blocks)

    def free(self, blocks: list[int]) -> None:
        """Drop one reference to each block; a block with none left becomes free."""
        for b in blocks:
            if b == RELEASED:
                continue
            if self._ref_counts[b] == 0:
                raise ValueError(f"block {b} freed twice")
            self._ref_counts[b] -= 1
            if self._ref_counts[b] == 0:
                self._free[b] = None

    def ref_count(self, block: int) -> int:
        return self._ref_counts[block]

    # -- prefix cache -------------------------------------------------------------------------

    def register(self, block: int, block_hash: int, tokens: tuple[int, ...]) -> None:
        """Record that full ``block`` holds ``tokens`` (after the prefix ``block_hash`` chains)."""
        if self.enable_caching and block_hash not in self._block_of_hash and block not in self._hash_of_block:
            self._block_of_hash[block_hash] = block
            self._hash_of_block[block] = block_hash
            self._tokens_of_block[block] = tokens

    def register_full_blocks(self, seq, block_size: int) -> None:
        """Make the blocks of ``seq`` (a ``Sequence``) its last step filled findable by later
        sequences with the same prefix (their hashes appended to ``seq.block_hashes``)."""
        full = min(seq.num_computed_tokens // block_size, len(seq.block_ids))
        for j in range(len(seq.block_hashes), full):
            tokens = tuple(seq.token_ids[j * block_size:(j + 1) * block_size])
            block_hash = chain_hash(seq.block_hashes[-1] if seq.block_hashes else seq.cache_salt, tokens)
            seq.block_hashes.append(block_hash)
            self.register(seq.block_ids[j], block_hash, tokens)

    def take_cached_prefix(self, token_ids: list[int], block_size: int, max_blocks: int, salt: object = None
                           ) -> tuple[list[int], list[int]]:
        """Blocks (and their hashes) holding the longest cached prefix of ``token_ids``, each
        taken with one reference; at most ``max_blocks``. ``salt`` starts the hash chain (a
        LoRA adapter's key: its K/V differ from the base model's)."""
        blocks, hashes, previous = [], [], salt
        if not self.enable_caching:
            return blocks, hashes
        for j in range(max_blocks):
            tokens = tuple(token_ids[j * block_size:(j + 1) * block_size])
            block_hash = chain_hash(previous, tokens)
            self.num_queried_blocks += 1
            block = self._block_of_hash.get(block_hash)
            if block is None or self._tokens_of_block[block] != tokens:  # a miss (or a hash collision)
                break
            self.num_hit_blocks += 1
            if self._ref_counts[block] == 0:
                del self._free[block]
            self._ref_counts[block] += 1
            blocks.append(block)
            hashes.append(block_hash)
            previous = block_hash
        return blocks, hashes

    def give_back_prefix(self, blocks: list[int]) -> None:
        """Return blocks ``take_cached_prefix`` found but the caller cannot use (a hybrid model's,
        past its last kept state): freed, and not counted as hits."""
        self.free(blocks)
        self.num_hit_blocks -= len(blocks)

    def _forget(self, block: int) -> None:
        block_hash = self._hash_of_block.pop(block, None)
        if block_hash is not None:
            del self._block_of_hash[block_hash]
            del self._tokens_of_block[block]
