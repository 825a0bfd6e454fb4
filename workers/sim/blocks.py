"""Paged KV-cache blocks with prefix caching: vLLM v1's block pool (ref counts, an LRU free list, hashes of full
blocks), as nano-vllm's `block_manager.py` writes it small."""

from __future__ import annotations

from collections import OrderedDict


class BlockPool:
    """`num_blocks` blocks of `block_size` tokens each.

    A block in use has a reference count > 0. A free block may still hold the KV of a full block of some prompt
    (its hash is kept): a later sequence with the same prefix takes it back instead of recomputing it, until it
    is allocated to something else. Free blocks are reused least recently freed first, as vLLM's free block queue.
    Hashes chain: block i's hash covers every token of blocks 0..i (`chain_hash`).
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"a KV cache of {num_blocks} blocks holds nothing: give the engine more KV memory")
        self.num_blocks, self.block_size = num_blocks, block_size
        self._ref = [0] * num_blocks
        self._hash: list[int | None] = [None] * num_blocks
        self._by_hash: dict[int, int] = {}
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    def cached_prefix(self, hashes: list[int]) -> list[int]:
        """The blocks holding the longest cached prefix of a sequence whose full blocks hash to `hashes`."""
        blocks = []
        for block_hash in hashes:
            block = self._by_hash.get(block_hash)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def share(self, blocks: list[int]) -> None:
        """Take a reference to cached `blocks` (from `cached_prefix`), out of the free list where they were free."""
        for block in blocks:
            if self._ref[block] == 0:
                del self._free[block]
            self._ref[block] += 1

    def allocate(self, count: int) -> list[int]:
        """`count` fresh blocks (raises ValueError if fewer are free: check `free_blocks` first); a reused block
        forgets the prefix it cached."""
        if count > len(self._free):
            raise ValueError(f"{count} blocks asked for, {len(self._free)} free")
        blocks = []
        for _ in range(count):
            block, _ = self._free.popitem(last=False)
            old = self._hash[block]
            if old is not None:
                del self._by_hash[old]
                self._hash[block] = None
            self._ref[block] = 1
            blocks.append(block)
        return blocks

    def release(self, blocks: list[int]) -> None:
        """Drop a sequence's references; its last blocks are freed first, so they are evicted first."""
        for block in reversed(blocks):
            self._ref[block] -= 1
            if self._ref[block] == 0:
                self._free[block] = None

    def cache(self, block: int, block_hash: int) -> None:
        """`block` is full and holds the prefix `block_hash` stands for (kept unless another block already does)."""
        if self._hash[block] is None and block_hash not in self._by_hash:
            self._hash[block] = block_hash
            self._by_hash[block_hash] = block

    def reset(self) -> bool:
        """Forget every cached prefix (vLLM's `reset_prefix_cache`); False, as vLLM's, while blocks are in use."""
        if len(self._free) < self.num_blocks:
            return False
        self._by_hash.clear()
        self._hash = [None] * self.num_blocks
        return True


def chain_hash(previous: int | None, tokens: list[int]) -> int:
    """The hash of a full block of `tokens` after the blocks `previous` stands for (None: the first block)."""
    return hash((previous, tuple(tokens)))
