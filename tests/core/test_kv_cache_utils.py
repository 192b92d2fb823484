"""Block hash chain: deterministic, and sensitive to everything that changes KV."""

from __future__ import annotations

import pytest

from omnistage.core.kv_cache_utils import block_extra_keys, hash_block_tokens, update_block_hashes
from omnistage.core.request import Request
from omnistage.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from omnistage.sampling_params import SamplingParams

BS = 4


def _req(tokens: list[int], features=(), salt: str | None = None, rid: str = "r") -> Request:
    return Request(rid, list(tokens), SamplingParams(), mm_features=list(features), cache_salt=salt)


def _img(identifier: str, offset: int, length: int) -> MultiModalFeatureSpec:
    return MultiModalFeatureSpec(None, "image", identifier, PlaceholderRange(offset, length))


def _hashes(req: Request) -> list[bytes]:
    update_block_hashes(req, BS)
    return req.block_hashes


def test_known_answer_is_stable_across_processes():
    # Pinned digests: SHA-256 over an explicit encoding, so they never depend on
    # PYTHONHASHSEED, the process or the machine. A change here breaks sharing
    # of cached blocks between instances; change it only on purpose.
    h0 = hash_block_tokens(None, [1, 2, 3, 4])
    assert h0.hex() == "6edd91c99f62fb4927448bddda6bd301a31dcae66335269821c20141b5c77958"
    h1 = hash_block_tokens(h0, [5, 6, 7, 8], ("mm:img", "salt:x"))
    assert h1.hex() == "eed3feecf8ddb3ce3a8e1c2357dffc7da4672b6fcfa62b9bf2a03fdd04f1424a"
    assert isinstance(h0, bytes) and len(h0) == 32


def test_deterministic():
    assert hash_block_tokens(None, [1, 2, 3]) == hash_block_tokens(None, (1, 2, 3))
    assert hash_block_tokens(b"p" * 32, [7], ("a", b"b", 3)) == hash_block_tokens(b"p" * 32, [7], ("a", b"b", 3))
    assert hash_block_tokens(None, [1], None) == hash_block_tokens(None, [1], ())


@pytest.mark.parametrize(
    "a, b",
    [
        ((None, [1, 2, 3, 4], ()), (None, [1, 2, 3, 5], ())),  # one token
        ((None, [1, 2, 3, 4], ()), (None, [4, 3, 2, 1], ())),  # order
        ((None, [1, 2, 3, 4], ()), (None, [1, 2, 3], ())),  # length
        ((None, [1, 2], ()), (b"\0" * 32, [1, 2], ())),  # parent
        ((b"a" * 32, [1, 2], ()), (b"b" * 32, [1, 2], ())),  # parent
        ((None, [1, 2], ("mm:x",)), (None, [1, 2], ("mm:y",))),  # mm identifier
        ((None, [1, 2], ()), (None, [1, 2], ("mm:x",))),  # extra key vs none
        ((None, [1, 2], ("ab",)), (None, [1, 2], ("a", "b"))),  # key boundaries
        ((None, [1, 2], ("1",)), (None, [1, 2], (1,))),  # str vs int
        ((None, [1, 2], ("x",)), (None, [1, 2], (b"x",))),  # str vs bytes
        ((None, [1, 2], ("a", "b")), (None, [1, 2], ("b", "a"))),  # key order
        ((None, [1, 2**40], ()), (None, [1, 2**40 + 1], ())),  # large ids are not truncated
    ],
)
def test_sensitive(a, b):
    assert hash_block_tokens(*a) != hash_block_tokens(*b)


def test_bool_extra_key_refused():
    with pytest.raises(TypeError):
        hash_block_tokens(None, [1], (True,))


def test_chain_depends_on_every_earlier_block():
    a = _hashes(_req([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]))
    b = _hashes(_req([0, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]))
    assert len(a) == 3
    assert all(x != y for x, y in zip(a, b))  # block 0 differs -> every later one does


def test_only_full_blocks_hashed_and_incremental_matches_batch():
    req = _req(list(range(10)))
    assert len(_hashes(req)) == 2  # 10 tokens, 2 full blocks
    for t in range(20, 27):
        req.append_output_token(t)
        update_block_hashes(req, BS)
        assert len(req.block_hashes) == req.num_tokens // BS
    batch = _hashes(_req(req.all_token_ids))
    assert req.block_hashes == batch


def test_salt_changes_first_block_and_thus_all():
    plain = _hashes(_req(list(range(8))))
    salted = _hashes(_req(list(range(8)), salt="tenant-a"))
    other = _hashes(_req(list(range(8)), salt="tenant-b"))
    assert block_extra_keys(_req(list(range(8)), salt="s"), 4, 8) == ()  # first block only
    assert len({plain[0], salted[0], other[0]}) == 3
    assert len({plain[1], salted[1], other[1]}) == 3  # carried by the chain


def test_mm_identifier_keys_exactly_the_overlapping_blocks():
    tokens = [5] * 16  # identical placeholder tokens for both images
    feat_a, feat_b = _img("hash-a", 5, 4), _img("hash-b", 5, 4)  # spans [5, 9): blocks 1 and 2
    req = _req(tokens, [feat_a])
    assert block_extra_keys(req, 0, 4) == ()
    assert block_extra_keys(req, 4, 8) == ("mm:hash-a",)
    assert block_extra_keys(req, 8, 12) == ("mm:hash-a",)
    assert block_extra_keys(req, 12, 16) == ()
    a, b = _hashes(_req(tokens, [feat_a])), _hashes(_req(tokens, [feat_b]))
    assert a[0] == b[0]  # before the image: shared
    assert a[1] != b[1] and a[2] != b[2] and a[3] != b[3]  # the image and everything after
    assert a == _hashes(_req(tokens, [_img("hash-a", 5, 4)]))  # same content hash -> same keys


def test_several_items_in_one_block_keep_their_order():
    req = _req([5] * 8, [_img("x", 0, 1), _img("y", 2, 1), _img("z", 5, 2)])
    assert block_extra_keys(req, 0, 4) == ("mm:x", "mm:y")
    assert block_extra_keys(req, 4, 8) == ("mm:z",)
    swapped = _req([5] * 8, [_img("y", 0, 1), _img("x", 2, 1), _img("z", 5, 2)])
    assert _hashes(req)[0] != _hashes(swapped)[0]
