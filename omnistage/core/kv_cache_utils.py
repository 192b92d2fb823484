"""Block hashing for the KV prefix cache.

A full block of ``block_size`` tokens is keyed by a SHA-256 chain:

    hash_i = sha256(hash_{i-1} | token ids of block i | extra keys of block i)

with a fixed root in place of ``hash_{-1}``. The chain makes a block's key
depend on everything before it, so equal keys mean equal prefixes. Extra keys
hold what the token ids alone do not say:

- the ``identifier`` (content hash) of every multimodal item whose placeholder
  span overlaps the block: two images behind identical placeholder tokens must
  never share KV;
- the request's ``cache_salt``, in the first block only (the chain carries it
  into every later block), so that tenants who do not share a salt never share
  a block.

SHA-256 rather than Python's ``hash()``: the keys must be equal across
processes (an encoder-only instance, a restarted server) and must not be
collidable on purpose by a user who picks token ids (CVE-2025-25183).
Encoding is explicit and length-prefixed so that no two different inputs
serialize to the same bytes.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Union

from omnistage.multimodal.inputs import MultiModalFeatureSpec, get_mm_features_in_window

if TYPE_CHECKING:
    from omnistage.core.request import Request

BlockHash = bytes
ExtraKey = Union[str, bytes, int]

# Stands in for the parent of a request's first block. Fixed, not random, so
# hashes are reproducible across processes and machines.
ROOT_HASH: BlockHash = hashlib.sha256(b"omnistage-kv-root-v1").digest()


def _encode_key(key: ExtraKey) -> bytes:
    if isinstance(key, bool):  # bool is an int subclass; refuse the ambiguity
        raise TypeError(f"extra key must be str, bytes or int, got bool {key!r}")
    if isinstance(key, str):
        data, tag = key.encode("utf-8"), b"s"
    elif isinstance(key, bytes):
        data, tag = key, b"b"
    elif isinstance(key, int):
        data, tag = key.to_bytes(16, "little", signed=True), b"i"
    else:
        raise TypeError(f"extra key must be str, bytes or int, got {type(key).__name__} {key!r}")
    return tag + struct.pack("<Q", len(data)) + data


def hash_block_tokens(
    parent_hash: BlockHash | None,
    token_ids: Sequence[int],
    extra_keys: Sequence[ExtraKey] | None = None,
) -> BlockHash:
    """SHA-256 of one block given its parent's hash (None: first block)."""
    h = hashlib.sha256(ROOT_HASH if parent_hash is None else parent_hash)
    n = len(token_ids)
    h.update(struct.pack(f"<Q{n}q", n, *token_ids))  # fixed width and byte order
    keys = extra_keys or ()
    h.update(struct.pack("<Q", len(keys)))
    for key in keys:
        h.update(_encode_key(key))
    return h.digest()


def block_extra_keys(request: Request, start: int, end: int) -> tuple[ExtraKey, ...]:
    """Extra keys of the block covering token positions ``[start, end)``.

    ``request.mm_features`` must be sorted by offset with non-overlapping
    spans (the scheduler checks this on ``add_request``).
    """
    keys: list[ExtraKey] = []
    if start == 0 and request.cache_salt is not None:
        keys.append("salt:" + request.cache_salt)
    if request.mm_features:
        lo, hi = get_mm_features_in_window(request.mm_features, start, end)
        keys.extend("mm:" + f.identifier for f in request.mm_features[lo:hi] if f.mm_position.length > 0)
    return tuple(keys)


def update_block_hashes(request: Request, block_size: int) -> None:
    """Append the hashes of ``request``'s blocks that became full since the
    last call. Incremental: each block is hashed once, when its last token
    (prompt or generated) is known."""
    hashes = request.block_hashes
    tokens = request.all_token_ids
    num_full = len(tokens) // block_size
    while len(hashes) < num_full:
        start = len(hashes) * block_size
        end = start + block_size
        parent = hashes[-1] if hashes else None
        hashes.append(hash_block_tokens(parent, tokens[start:end], block_extra_keys(request, start, end)))


@dataclass(frozen=True)
class _PromptKeys:
    """What ``block_extra_keys`` reads of a request, for a prompt not yet a ``Request``."""

    mm_features: Sequence[MultiModalFeatureSpec]
    cache_salt: str | None


def hash_prompt_blocks(
    token_ids: Sequence[int],
    block_size: int,
    mm_features: Sequence[MultiModalFeatureSpec] = (),
    cache_salt: str | None = None,
) -> list[BlockHash]:
    """The hashes of a prompt's full blocks, equal to those the scheduler gives
    the request (a router outside the engine matches them against a replica's)."""
    keys = _PromptKeys(mm_features, cache_salt)
    hashes: list[BlockHash] = []
    for start in range(0, len(token_ids) // block_size * block_size, block_size):
        end = start + block_size
        extra = block_extra_keys(keys, start, end)  # type: ignore[arg-type]
        hashes.append(hash_block_tokens(hashes[-1] if hashes else None, token_ids[start:end], extra))
    return hashes


def cdiv(a: int, b: int) -> int:
    return -(-a // b)
