"""PlaceholderRange, MultiModalFeatureSpec and get_mm_features_in_window."""

import dataclasses
import random

import numpy as np
import pytest
import torch

from omnistage.multimodal.inputs import (
    MultiModalFeatureSpec,
    PlaceholderRange,
    get_mm_features_in_window,
)

F, T = False, True


def _mask(*bits: bool) -> torch.Tensor:
    return torch.tensor(bits, dtype=torch.bool)


def _feature(identifier: str, offset: int, length: int, is_embed=None) -> MultiModalFeatureSpec:
    return MultiModalFeatureSpec(
        data=None,
        modality="image",
        identifier=identifier,
        mm_position=PlaceholderRange(offset, length, is_embed),
    )


# ---------------------------------------------------------------- PlaceholderRange


def test_unmasked_range_maps_windows_to_themselves():
    r = PlaceholderRange(offset=10, length=6)
    assert r.embeds_cumsum is None
    assert r.get_num_embeds() == 6
    assert r.get_embeds_indices_in_range(0, 6) == (0, 6)
    assert r.get_embeds_indices_in_range(2, 4) == (2, 4)
    assert r.extract_embeds_range() == [(10, 15)]


def test_docstring_example_with_is_embed_mask():
    r = PlaceholderRange(offset=2, length=5, is_embed=_mask(F, T, F, T, T))
    assert r.get_num_embeds() == 3
    assert r.embeds_cumsum == [0, 1, 1, 2, 3]
    assert r.get_embeds_indices_in_range(3, 5) == (1, 3)
    assert r.get_embeds_indices_in_range(0, 5) == (0, 3)
    assert r.get_embeds_indices_in_range(0, 1) == (0, 0)  # only a non-embed position
    assert r.get_embeds_indices_in_range(2, 3) == (1, 1)
    assert r.extract_embeds_range() == [(3, 3), (5, 6)]


def test_empty_window_guard_e_equals_zero():
    r = PlaceholderRange(offset=0, length=3, is_embed=_mask(T, T, T))
    # e == 0 must not wrap around to cumsum[-1].
    assert r.get_embeds_indices_in_range(0, 0) == (0, 0)


def test_embeds_cumsum_is_a_cached_python_list():
    r = PlaceholderRange(offset=0, length=4, is_embed=_mask(T, F, T, T))
    first = r.embeds_cumsum
    assert isinstance(first, list) and all(type(x) is int for x in first)
    assert r.embeds_cumsum is first


def test_all_false_and_zero_length_masks():
    r = PlaceholderRange(offset=5, length=3, is_embed=_mask(F, F, F))
    assert r.get_num_embeds() == 0
    assert r.extract_embeds_range() == []
    empty = PlaceholderRange(offset=5, length=0, is_embed=torch.zeros(0, dtype=torch.bool))
    assert empty.get_num_embeds() == 0
    assert PlaceholderRange(offset=5, length=0).extract_embeds_range() == []


def test_get_embeds_indices_in_range_rejects_bad_windows():
    r = PlaceholderRange(offset=0, length=4)
    for start, end in [(-1, 2), (3, 2), (0, 5)]:
        with pytest.raises(ValueError, match=r"0 <= start_idx <= end_idx <= length=4"):
            r.get_embeds_indices_in_range(start, end)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(offset=-1, length=3), r"offset: expected a non-negative int, got -1"),
        (dict(offset=0, length=-2), r"length: expected a non-negative int, got -2"),
        (dict(offset=1.5, length=2), r"offset: expected a non-negative int, got float"),
        (dict(offset=True, length=2), r"offset: expected a non-negative int, got bool"),
        (
            dict(offset=0, length=5, is_embed=_mask(T, T, T, T)),
            r"is_embed: expected shape \(5,\) to match length=5, got \(4,\)",
        ),
        (
            dict(offset=0, length=2, is_embed=torch.ones(2, dtype=torch.int64)),
            r"is_embed: expected dtype torch.bool, got torch.int64",
        ),
        (
            dict(offset=0, length=2, is_embed=[True, False]),
            r"is_embed: expected a torch.bool tensor of shape \(2,\) or None, got list",
        ),
        (
            dict(offset=0, length=4, is_embed=torch.ones(2, 2, dtype=torch.bool)),
            r"is_embed: expected shape \(4,\) to match length=4, got \(2, 2\)",
        ),
    ],
)
def test_placeholder_range_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PlaceholderRange(**kwargs)


def test_numpy_ints_are_normalised():
    r = PlaceholderRange(offset=np.int64(3), length=np.int32(2))
    assert type(r.offset) is int and type(r.length) is int
    assert r == PlaceholderRange(3, 2)


def test_equality_includes_masks_and_hash_is_consistent():
    a = PlaceholderRange(1, 3, _mask(T, F, T))
    b = PlaceholderRange(1, 3, _mask(T, F, T))
    c = PlaceholderRange(1, 3, _mask(T, T, T))
    plain = PlaceholderRange(1, 3)
    assert a == b and hash(a) == hash(b)
    assert a != c
    assert a != plain and plain != a
    assert plain == PlaceholderRange(1, 3)
    assert PlaceholderRange(1, 3) != PlaceholderRange(2, 3)
    assert PlaceholderRange(1, 3) != PlaceholderRange(1, 4)
    assert plain != (1, 3)
    assert len({a, b, plain}) == 2


def test_placeholder_range_is_frozen():
    r = PlaceholderRange(0, 1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.offset = 3


@pytest.mark.parametrize("seed", range(5))
def test_indices_in_range_match_a_positional_reference(seed):
    rng = random.Random(seed)
    length = rng.randint(1, 40)
    bits = [rng.random() < 0.7 for _ in range(length)]
    r = PlaceholderRange(offset=rng.randint(0, 100), length=length, is_embed=_mask(*bits))
    for start in range(length + 1):
        for end in range(start, length + 1):
            rows_before = sum(bits[:start])
            assert r.get_embeds_indices_in_range(start, end) == (rows_before, rows_before + sum(bits[start:end]))
    runs = r.extract_embeds_range()
    covered = [p for s, e in runs for p in range(s, e + 1)]
    assert covered == [r.offset + k for k, bit in enumerate(bits) if bit]


# ---------------------------------------------------------------- MultiModalFeatureSpec


def test_feature_spec_fields():
    pos = PlaceholderRange(4, 2)
    f = MultiModalFeatureSpec(data={"x": 1}, modality="audio", identifier="h1", mm_position=pos)
    assert (f.data, f.modality, f.identifier, f.mm_position, f.mm_hash) == ({"x": 1}, "audio", "h1", pos, None)
    g = MultiModalFeatureSpec(None, "image", "lora1:h2", pos, mm_hash="h2")
    assert g.mm_hash == "h2"


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(modality="", identifier="h", mm_position=PlaceholderRange(0, 1)), r"modality: expected a non-empty str"),
        (dict(modality="image", identifier=None, mm_position=PlaceholderRange(0, 1)), r"identifier: expected a non-empty str, got NoneType"),
        (dict(modality="image", identifier="h", mm_position=(0, 1)), r"mm_position: expected a PlaceholderRange, got tuple"),
        (dict(modality="image", identifier="h", mm_position=PlaceholderRange(0, 1), mm_hash=3), r"mm_hash: expected a str or None, got int"),
    ],
)
def test_feature_spec_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MultiModalFeatureSpec(data=None, **kwargs)


# ---------------------------------------------------------------- window search


def _brute_force(features, start, end):
    hits = [
        k
        for k, f in enumerate(features)
        if f.mm_position.offset < end and f.mm_position.offset + f.mm_position.length > start
    ]
    return hits


@pytest.mark.parametrize("seed", range(10))
def test_window_search_matches_a_scan(seed):
    rng = random.Random(seed)
    features, pos = [], 0
    for k in range(rng.randint(0, 12)):
        pos += rng.randint(0, 5)
        length = rng.randint(1, 6)
        features.append(_feature(f"h{k}", pos, length))
        pos += length
    for _ in range(200):
        start = rng.randint(0, pos + 3)
        end = start + rng.randint(0, 10)
        lo, hi = get_mm_features_in_window(features, start, end)
        assert list(range(lo, hi)) == _brute_force(features, start, end)


def test_window_search_degenerate_windows():
    features = [_feature("a", 0, 4), _feature("b", 4, 4)]
    # An empty window inside an item selects it; the gather then finds s == e.
    assert get_mm_features_in_window(features, 2, 2) == (0, 1)
    lo, hi = get_mm_features_in_window(features, 8, 8)
    assert lo >= hi
    assert get_mm_features_in_window([], 0, 10) == (0, 0)
    assert get_mm_features_in_window(features, 4, 5) == (1, 2)  # boundary at exactly an end


class _CountingSequence:
    """A read-only sequence that counts element reads."""

    def __init__(self, items):
        self.items = items
        self.reads = 0

    def __len__(self):
        return len(self.items)

    def __getitem__(self, k):
        self.reads += 1
        return self.items[k]


def test_window_search_is_a_binary_search_not_a_scan():
    features = _CountingSequence([_feature(f"h{k}", 3 * k, 2) for k in range(4096)])
    lo, hi = get_mm_features_in_window(features, 3000, 3010)
    assert list(range(lo, hi)) == _brute_force(features.items, 3000, 3010)
    # Two bisections over 4096 items: at most ~2 * 13 reads, far from 4096.
    assert features.reads <= 2 * 13
