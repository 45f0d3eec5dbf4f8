"""The KV block hash chain, shared by the engine, the router and the index.

h_i = H(h_{i-1}, tokens of block i, extra) over full blocks only, where H is
xxh3-128 over a canonical byte encoding and h_{-1} is derived from the model id,
dtype and block size, so hashes from differently shaped caches never collide.
Deliberately free of torch so the router can import it cheaply.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import xxhash

BlockHash = bytes  # 16 bytes


def root_hash(model_id: str, dtype: str, block_size: int) -> BlockHash:
    return xxhash.xxh3_128_digest(f"tandem-kv-v1|{model_id}|{dtype}|{block_size}".encode())


def hash_block(parent: BlockHash, token_ids: Sequence[int], extra: str | None = None) -> BlockHash:
    h = xxhash.xxh3_128()
    h.update(parent)
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    # Length-prefixed so (tokens, extra) pairs cannot alias one another.
    salt = b"" if extra is None else extra.encode()
    h.update(struct.pack("<q", -1 if extra is None else len(salt)))
    h.update(salt)
    return h.digest()


def extend_hashes(
    hashes: list[BlockHash],
    token_ids: Sequence[int],
    block_size: int,
    root: BlockHash,
    extra: str | None = None,
) -> list[BlockHash]:
    """Append to `hashes` the hashes of the full blocks of `token_ids` not yet hashed."""
    for i in range(len(hashes), len(token_ids) // block_size):
        parent = hashes[i - 1] if i else root
        hashes.append(hash_block(parent, token_ids[i * block_size : (i + 1) * block_size], extra))
    return hashes


def hash_prompt(
    token_ids: Sequence[int], block_size: int, root: BlockHash, extra: str | None = None
) -> list[BlockHash]:
    return extend_hashes([], token_ids, block_size, root, extra)
