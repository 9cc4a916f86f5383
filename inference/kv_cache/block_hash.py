"""Content hashes of full KV blocks, chained from the first block, for automatic prefix caching.

A block's hash covers its parent block's hash, its ``block_size`` token ids and extra keys
(the request's cache salt, its LoRA adapter's key), so two blocks have the same hash only
when the whole prefix up to and including them is the same (vLLM's automatic prefix caching,
after SGLang's RadixAttention: Zheng et al., "SGLang", 2024). SHA-256 keeps collisions out of
reach: a collision would serve one prompt's keys and values to another.
"""
from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

BlockHash = bytes  # 32-byte SHA-256 digest

_ROOT = bytes(32)  # the parent of a request's first block


def hash_block_tokens(parent: BlockHash | None, token_ids: Sequence[int], cache_salt: str | None = None,
                      lora_key: str | None = None) -> BlockHash:
    """The hash of one full block.

    Args:
        parent: hash of the previous block of the same sequence, None for the first block.
        token_ids: the block's ``block_size`` token ids.
        cache_salt: extra key that separates caches (per tenant); only the first block carries
            it, the chain carries it on to the rest.
        lora_key: the key of the request's LoRA adapter (its weights' digest), carried like the salt: the
            same tokens under another adapter have other keys and values.
    Returns:
        32 bytes.
    """
    digest = hashlib.sha256(parent if parent is not None else _ROOT)
    digest.update(array("q", token_ids).tobytes())
    if cache_salt is not None:
        salt = cache_salt.encode("utf-8")
        digest.update(b"\x01" + len(salt).to_bytes(8, "little") + salt)
    if lora_key is not None:
        key = lora_key.encode("utf-8")
        digest.update(b"\x02" + len(key).to_bytes(8, "little") + key)
    return digest.digest()


def extend_block_hashes(block_hashes: list[BlockHash], token_ids: Sequence[int], block_size: int,
                        num_blocks: int, cache_salt: str | None = None, lora_key: str | None = None) -> None:
    """Append to ``block_hashes`` the hashes of blocks ``len(block_hashes) .. num_blocks - 1`` of
    ``token_ids`` (each block must be full: ``num_blocks * block_size <= len(token_ids)``); the same digests
    as :func:`hash_block_tokens` block by block, with the token ids converted to bytes once."""
    start = len(block_hashes)
    if num_blocks <= start:
        return
    if start == 0:
        block_hashes.append(hash_block_tokens(None, token_ids[:block_size], cache_salt, lora_key))
        start = 1
    data = memoryview(array("q", token_ids[start * block_size:num_blocks * block_size]).tobytes())
    width, parent, sha256 = block_size * 8, block_hashes[-1], hashlib.sha256  # 8 bytes a token id
    for offset in range(0, len(data), width):
        digest = sha256(parent)
        digest.update(data[offset:offset + width])
        parent = digest.digest()
        block_hashes.append(parent)
