"""EncoderCache and EncoderRunner beyond the seed: masks, chunked windows,
batching by modality, integrity checks, scatter, bisection."""

import random

import numpy as np
import pytest
import torch

from omnistage.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from omnistage.worker.mm.encoder_cache import EncoderCache
from omnistage.worker.mm.encoder_runner import EncoderRunner, MultiModalEmbedder

HIDDEN = 4


class FakeModel:
    """Encoder: item data is a tensor [num_embeds, HIDDEN]; output = 2 * data + 1.
    Token embedding: a fixed random table."""

    def __init__(self, vocab: int = 50):
        self.table = torch.randn(vocab, HIDDEN, generator=torch.Generator().manual_seed(0))
        self.calls: list[tuple[str, int]] = []

    def embed_multimodal(self, modality, items):
        self.calls.append((modality, len(items)))
        return [2 * x + 1 for x in items]

    def embed_input_ids(self, input_ids):
        return self.table[input_ids]


def _feature(identifier, offset, length, is_embed=None, modality="image", data=None):
    return MultiModalFeatureSpec(
        data=data,
        modality=modality,
        identifier=identifier,
        mm_position=PlaceholderRange(offset, length, is_embed),
    )


def _rows(feature: MultiModalFeatureSpec, salt: float = 0.0) -> torch.Tensor:
    n = feature.mm_position.get_num_embeds()
    base = float(sum(map(ord, feature.identifier)) * 1000) + salt
    return base + torch.arange(n * HIDDEN, dtype=torch.float32).reshape(n, HIDDEN)


def _runner(cache: EncoderCache, model=None, max_num_tokens: int = 256) -> EncoderRunner:
    return EncoderRunner(model, max_num_tokens, HIDDEN, cache, torch.float32, torch.device("cpu"))


def _gather(runner, req_ids, num_computed, num_scheduled, prefill_lens, draft_lookahead=0):
    ns = np.array(num_scheduled)
    qsl = np.concatenate(([0], np.cumsum(ns)))
    return runner.gather_mm_embeddings(
        req_ids=req_ids,
        total_num_scheduled_tokens=int(qsl[-1]),
        num_scheduled_tokens=ns,
        query_start_loc=qsl,
        prefill_lens=np.array(prefill_lens),
        num_computed_tokens=np.array(num_computed),
        draft_lookahead=draft_lookahead,
    )


# ---------------------------------------------------------------- EncoderCache


def test_encoder_cache_policy_and_lifetime():
    assert "content hash" in EncoderCache.__doc__ and "EncoderCacheManager" in EncoderCache.__doc__
    cache = EncoderCache()
    shared = _feature("img", 0, 2)
    cache.add_request("a", [shared])
    cache.add_request("b", [shared])
    cache.encoder_outputs["img"] = _rows(shared)
    assert len(cache) == 1
    cache.remove_request("a")
    cache.remove_request("a")  # unknown id: no error
    assert "a" not in cache.mm_features and "img" in cache.encoder_outputs  # never frees shared outputs
    cache.free_encoder_cache("img")
    cache.free_encoder_cache("img")  # idempotent
    assert len(cache) == 0
    cache.encoder_outputs["x"] = torch.zeros(1, HIDDEN)
    cache.reset_encoder_cache()
    assert len(cache) == 0 and "b" in cache.mm_features


def test_add_request_rejects_unsorted_features():
    cache = EncoderCache()
    with pytest.raises(ValueError, match=r"request r: .*item 1 \(h1\) starts at 3, expected >= 10"):
        cache.add_request("r", [_feature("h0", 10, 2), _feature("h1", 3, 2)])
    assert "r" not in cache.mm_features


def test_replacing_a_feature_list_rebuilds_the_index():
    cache = EncoderCache()
    first = _feature("h0", 0, 4)
    cache.add_request("r", [first])
    cache.encoder_outputs["h0"] = _rows(first)
    runner = _runner(cache)
    embeds, _ = _gather(runner, ["r"], [0], [8], [100])
    assert len(embeds) == 1
    second = _feature("h1", 4, 4)
    cache.encoder_outputs["h1"] = _rows(second)
    cache.mm_features["r"] = [first, second]  # direct assignment, as the seed does
    embeds, mask = _gather(runner, ["r"], [0], [8], [100])
    assert len(embeds) == 2 and int(mask.sum()) == 8


# ---------------------------------------------------------------- encode


def test_prepare_mm_inputs_orders_and_skips_items_without_data():
    cache = EncoderCache()
    d = [torch.full((2, HIDDEN), float(k)) for k in range(3)]
    cache.add_request("a", [_feature("a0", 0, 2, data=d[0]), _feature("a1", 4, 2, data=None)])
    cache.add_request("b", [_feature("b0", 0, 2, data=d[1], modality="audio"), _feature("b1", 3, 2, data=d[2])])
    runner = _runner(cache, FakeModel())
    hashes, kwargs = runner.prepare_mm_inputs({"b": [1, 0], "a": [0, 1]})
    assert hashes == ["b1", "b0", "a0"]
    assert [m for m, _ in kwargs] == ["image", "audio", "image"]
    assert kwargs[0][1] is d[2] and kwargs[2][1] is d[0]


def test_prepare_mm_inputs_errors():
    cache = EncoderCache()
    cache.add_request("a", [_feature("a0", 0, 2)])
    runner = _runner(cache, FakeModel())
    with pytest.raises(ValueError, match=r"request a: encoder input index 3 out of range, expected 0 <= index < 1"):
        runner.prepare_mm_inputs({"a": [3]})
    with pytest.raises(RuntimeError, match=r"request zz has encoder inputs scheduled"):
        runner.prepare_mm_inputs({"zz": [0]})


def test_execute_mm_encoder_batches_consecutive_same_modality_items():
    model = FakeModel()
    runner = _runner(EncoderCache(), model)
    items = [("image", torch.full((1, HIDDEN), 1.0)), ("image", torch.full((2, HIDDEN), 2.0)),
             ("audio", torch.full((3, HIDDEN), 3.0)), ("image", torch.full((1, HIDDEN), 4.0))]
    outputs = runner.execute_mm_encoder(items)
    assert model.calls == [("image", 2), ("audio", 1), ("image", 1)]
    assert [tuple(o.shape) for o in outputs] == [(1, HIDDEN), (2, HIDDEN), (3, HIDDEN), (1, HIDDEN)]
    for (_, data), out in zip(items, outputs):
        torch.testing.assert_close(out, 2 * data + 1)
    assert runner.execute_mm_encoder([]) == []
    assert isinstance(model, MultiModalEmbedder)


def test_execute_mm_encoder_accepts_a_stacked_tensor():
    class Stacked(FakeModel):
        def embed_multimodal(self, modality, items):
            return torch.stack([2 * x + 1 for x in items])

    outputs = _runner(EncoderCache(), Stacked()).execute_mm_encoder(
        [("image", torch.zeros(2, HIDDEN)), ("image", torch.ones(2, HIDDEN))]
    )
    assert len(outputs) == 2 and torch.equal(outputs[1], torch.full((2, HIDDEN), 3.0))


@pytest.mark.parametrize(
    "result, match",
    [
        (lambda items: [torch.zeros(1, HIDDEN)], r"returned 1 outputs for 2 items; expected one tensor per item"),
        (lambda items: "nope", r"must return a list of tensors \(one per item\), got str"),
        (lambda items: [torch.zeros(1, HIDDEN), torch.zeros(1, HIDDEN + 1)], r"output 1: expected a tensor \[num_embeds, 4\], got \(1, 5\)"),
        (lambda items: [torch.zeros(1, HIDDEN), None], r"output 1: expected a tensor \[num_embeds, 4\], got NoneType"),
    ],
)
def test_execute_mm_encoder_checks_outputs(result, match):
    class Bad(FakeModel):
        def embed_multimodal(self, modality, items):
            return result(items)

    with pytest.raises(RuntimeError, match=match):
        _runner(EncoderCache(), Bad()).execute_mm_encoder([("image", 0), ("image", 1)])


# ---------------------------------------------------------------- gather: checks


def test_gather_rejects_cached_output_with_wrong_row_count():
    cache = EncoderCache()
    f = _feature("h0", 2, 5, is_embed=torch.tensor([False, True, False, True, True]))
    cache.add_request("req7", [f])
    cache.encoder_outputs["h0"] = torch.zeros(5, HIDDEN)  # 5 rows; the item has 3 embeds
    with pytest.raises(RuntimeError, match=r"Encoder output for h0 has 5 rows, expected 3 .*request req7"):
        _gather(_runner(cache), ["req7"], [0], [8], [100])


def test_gather_miss_error_names_request_and_item():
    cache = EncoderCache()
    cache.add_request("req3", [_feature("h9", 1, 4)])
    with pytest.raises(RuntimeError, match=r"Encoder cache miss for h9: request req3 needs rows \[0, 4\)"):
        _gather(_runner(cache), ["req3"], [0], [8], [100])


def test_gather_of_an_unregistered_prefilling_request_raises():
    with pytest.raises(RuntimeError, match=r"request ghost has no registered multimodal items"):
        _gather(_runner(EncoderCache()), ["ghost"], [0], [4], [10])


def test_all_decode_short_circuit_touches_nothing():
    # Unregistered requests would raise if looked up.
    embeds, mask = _gather(_runner(EncoderCache()), ["x", "y"], [10, 7], [1, 1], [10, 7])
    assert embeds == [] and mask.dtype == torch.bool and mask.shape == (2,) and not mask.any()
    embeds, mask = _gather(_runner(EncoderCache()), [], [], [], [])
    assert embeds == [] and mask.shape == (0,)


def test_gather_validates_batch_arrays():
    cache = EncoderCache()
    cache.add_request("a", [])
    runner = _runner(cache)
    with pytest.raises(ValueError, match=r"num_scheduled_tokens must be a 1-D array with at least 1 entries"):
        runner.gather_mm_embeddings(["a"], 4, np.array([]), np.array([0]), np.array([10]), np.array([0]))
    with pytest.raises(ValueError, match=r"request a has batch slots \[0, 8\), expected within \[0, 4\)"):
        runner.gather_mm_embeddings(["a"], 4, np.array([8]), np.array([0]), np.array([10]), np.array([0]))
    with pytest.raises(ValueError, match=r"expected draft_lookahead >= 0, got -1"):
        runner.gather_mm_embeddings(["a"], 4, np.array([4]), np.array([0]), np.array([10]), np.array([0]), -1)


def test_draft_lookahead_does_not_mutate_caller_arrays():
    cache = EncoderCache()
    f = _feature("h0", 0, 8)
    cache.add_request("r", [f])
    cache.encoder_outputs["h0"] = _rows(f)
    computed = np.array([0])
    _runner(cache).gather_mm_embeddings(["r"], 8, np.array([8]), np.array([0]), np.array([100]), computed, 1)
    assert computed.tolist() == [0]


def test_window_of_only_non_embed_positions_needs_no_cache_entry():
    cache = EncoderCache()
    f = _feature("h0", 4, 6, is_embed=torch.tensor([False, False, True, True, True, True]))
    cache.add_request("r", [f])
    # Window [0, 6) covers only the two break tokens at 4, 5: no lookup, no miss.
    embeds, mask = _gather(_runner(cache), ["r"], [0], [6], [100])
    assert embeds == [] and not mask.any()


def test_docstring_mask_example_gathers_rows_1_to_3():
    cache = EncoderCache()
    f = _feature("h0", 2, 5, is_embed=torch.tensor([False, True, False, True, True]))
    cache.add_request("r", [f])
    cache.encoder_outputs["h0"] = _rows(f)
    # Window [5, 7) = relative [3, 5) -> rows [1, 3), slots 0 and 1 both embeds.
    embeds, mask = _gather(_runner(cache), ["r"], [5], [2], [100])
    assert len(embeds) == 1 and torch.equal(embeds[0], _rows(f)[1:3])
    assert mask.tolist() == [True, True]
    # Window [2, 6) = relative [0, 4) -> rows [0, 2) at slots 1 and 3.
    embeds, mask = _gather(_runner(cache), ["r"], [2], [4], [100])
    assert torch.equal(embeds[0], _rows(f)[0:2])
    assert mask.tolist() == [False, True, False, True]


def test_shared_placeholders_or_their_masks():
    # Audio and video interleaved inside one span (use_audio_in_video style).
    video_bits = torch.tensor([True, True, False, False, True, True, False, False])
    video = _feature("v", 2, 8, is_embed=video_bits, modality="video")
    audio = _feature("a", 2, 8, is_embed=~video_bits, modality="audio")
    cache = EncoderCache()
    cache.add_request("r", [video, audio])
    for f in (video, audio):
        cache.encoder_outputs[f.identifier] = _rows(f)
    embeds, mask = _gather(_runner(cache), ["r"], [0], [12], [100])
    assert [e.modality for e in embeds] == ["video", "audio"]
    assert mask.tolist() == [False, False] + [True] * 8 + [False, False]


def test_nested_span_outside_the_window_is_skipped():
    # A long item containing a short one that ends before the window starts.
    outer = _feature("outer", 0, 20, modality="video")
    inner = _feature("inner", 2, 3, modality="audio")
    cache = EncoderCache()
    cache.add_request("r", [outer, inner])
    for f in (outer, inner):
        cache.encoder_outputs[f.identifier] = _rows(f)
    embeds, mask = _gather(_runner(cache), ["r"], [10], [4], [100])
    assert [e.modality for e in embeds] == ["video"]
    assert torch.equal(embeds[0], _rows(outer)[10:14]) and mask.all()


# ---------------------------------------------------------------- gather: chunked windows


def _random_request(rng: random.Random, name: str, masked: bool):
    features, pos = [], rng.randint(0, 5)
    for k in range(rng.randint(1, 6)):
        length = rng.randint(1, 12)
        bits = None
        if masked and rng.random() < 0.7:
            bits = torch.tensor([rng.random() < 0.75 for _ in range(length)])
        features.append(_feature(f"{name}-{k}", pos, length, bits, modality=rng.choice(["image", "audio"])))
        pos += length + rng.randint(0, 4)
    return features, pos + rng.randint(1, 5)


def _reference(features, outputs, qs, qe, draft_lookahead=0):
    """Position by position: which rows fill which window slots."""
    slots, rows = [], []
    for f in features:
        pos = f.mm_position
        bits = [True] * pos.length if pos.is_embed is None else pos.is_embed.tolist()
        row = 0
        for k, bit in enumerate(bits):
            p = pos.offset + k
            if bit and qs <= p < qe:
                if f.identifier not in outputs:
                    assert pos.offset + draft_lookahead >= qe  # only the boundary item may be absent
                else:
                    slots.append(p - qs)
                    rows.append(outputs[f.identifier][row])
            row += bit
    return slots, rows


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("draft_lookahead", [0, 1])
def test_chunked_prefill_gathers_exactly_the_right_rows(seed, draft_lookahead):
    rng = random.Random(seed)
    masked = seed % 2 == 0
    reqs = {f"r{k}": _random_request(rng, f"r{k}", masked) for k in range(3)}
    cache = EncoderCache()
    for req_id, (features, _) in reqs.items():
        cache.add_request(req_id, features)
        for f in features:
            cache.encoder_outputs[f.identifier] = _rows(f)
    runner = _runner(cache)
    computed = {req_id: 0 for req_id in reqs}
    gathered_rows = {f.identifier: 0 for features, _ in reqs.values() for f in features}
    while True:
        batch = [r for r in reqs if computed[r] < reqs[r][1]]
        if not batch:
            break
        sched = [min(rng.randint(1, 9), reqs[r][1] - computed[r]) for r in batch]
        evicted = {}
        if draft_lookahead:
            # The drafter's boundary item (starting at the processed end) may not
            # be encoded yet: drop it for this step half of the time.
            for r, n in zip(batch, sched):
                for f in reqs[r][0]:
                    if f.mm_position.offset == computed[r] + n and rng.random() < 0.5:
                        evicted[f.identifier] = cache.encoder_outputs.pop(f.identifier)
        embeds, mask = _gather(
            runner, batch, [computed[r] for r in batch], sched, [reqs[r][1] for r in batch], draft_lookahead
        )
        want_slots, want_rows, start = [], [], 0
        for r, n in zip(batch, sched):
            qs = computed[r] + draft_lookahead
            if qs < reqs[r][1]:
                slots, rows = _reference(reqs[r][0], cache.encoder_outputs, qs, qs + n, draft_lookahead)
                want_slots += [start + s for s in slots]
                want_rows += rows
            start += n
        assert torch.nonzero(mask).squeeze(1).tolist() == want_slots
        want = torch.stack(want_rows) if want_rows else torch.zeros(0, HIDDEN)
        got = torch.cat(list(embeds)) if embeds else torch.zeros(0, HIDDEN)
        assert torch.equal(got, want)
        # The merge's path (spans as plain tensors, no per-item views) reads the same rows.
        plain = embeds.tensors() if embeds else []
        assert torch.equal(torch.cat(plain) if plain else torch.zeros(0, HIDDEN), want)
        assert (embeds.num_rows if embeds else 0) == want.shape[0]
        for e in embeds:
            assert e.modality in ("image", "audio")
        cache.encoder_outputs.update(evicted)
        if draft_lookahead == 0:
            for r, n in zip(batch, sched):
                for f in reqs[r][0]:
                    pos = f.mm_position
                    s = max(computed[r] - pos.offset, 0)
                    e = min(computed[r] + n - pos.offset, pos.length)
                    if s < e:
                        es, ee = pos.get_embeds_indices_in_range(s, e)
                        gathered_rows[f.identifier] += ee - es
        for r, n in zip(batch, sched):
            computed[r] += n
    if draft_lookahead == 0:
        # Over all steps, every row of every item is gathered exactly once.
        for features, _ in reqs.values():
            for f in features:
                assert gathered_rows[f.identifier] == f.mm_position.get_num_embeds()


def test_decoding_request_in_a_mixed_batch_keeps_its_slots_false():
    cache = EncoderCache()
    f = _feature("h0", 0, 4)
    cache.add_request("p", [f])
    cache.add_request("d", [_feature("gone", 0, 4)])  # decoding: its item may be freed
    cache.encoder_outputs["h0"] = _rows(f)
    embeds, mask = _gather(_runner(cache), ["d", "p"], [10, 0], [1, 4], [10, 100])
    assert mask.tolist() == [False, True, True, True, True] and len(embeds) == 1


class _CountingSequence:
    def __init__(self, items):
        self.items = items
        self.reads = 0

    def __len__(self):
        return len(self.items)

    def __getitem__(self, k):
        got = self.items[k]
        self.reads += len(got) if isinstance(k, slice) else 1  # items read
        return got


def test_gather_finds_window_items_by_bisection_not_a_scan():
    n = 5000
    features = [_feature(f"h{k}", 2 * k, 1) for k in range(n)]
    cache = EncoderCache()
    cache.add_request("r", features)
    for f in features[2000:2003]:
        cache.encoder_outputs[f.identifier] = _rows(f)
    index = cache.feature_index("r")
    counted = {name: _CountingSequence(getattr(index, name)) for name in ("offsets", "max_ends", "entries")}
    for name, seq in counted.items():
        setattr(index, name, seq)
    embeds, mask = _gather(_runner(cache), ["r"], [4000], [6], [100000])
    assert len(embeds) == 3 and int(mask.sum()) == 3
    assert counted["entries"].reads == 3  # only the items in the window
    assert counted["offsets"].reads + counted["max_ends"].reads <= 2 * 14  # two bisections


# ---------------------------------------------------------------- merge


def test_get_inputs_embeds_scatters_rows_into_masked_positions():
    model = FakeModel()
    runner = _runner(EncoderCache(), model, max_num_tokens=16)
    input_ids = torch.tensor([1, 2, 3, 4, 5, 6, 7])
    mask = torch.tensor([False, True, True, False, False, True, False])
    a, b = torch.full((2, HIDDEN), 10.0), torch.full((1, HIDDEN), 20.0)
    out = runner.get_inputs_embeds(input_ids, [a, b], mask)
    expected = model.table[input_ids].clone()
    expected[1:3] = a
    expected[5] = b[0]
    assert torch.equal(out, expected)
    assert out.data_ptr() == runner.inputs_embeds.data_ptr()  # the persistent buffer
    assert out.shape == (7, HIDDEN)
    # No multimodal rows: plain token embeddings.
    out = runner.get_inputs_embeds(input_ids[:3], [], torch.zeros(3, dtype=torch.bool))
    assert torch.equal(out, model.table[input_ids[:3]])


def test_get_inputs_embeds_casts_dtype():
    model = FakeModel()
    runner = _runner(EncoderCache(), model, max_num_tokens=4)
    out = runner.get_inputs_embeds(torch.tensor([0, 1]), [torch.ones(1, HIDDEN, dtype=torch.float64)], torch.tensor([False, True]))
    assert out.dtype == torch.float32 and torch.equal(out[1], torch.ones(HIDDEN))


def test_get_inputs_embeds_errors():
    runner = _runner(EncoderCache(), FakeModel(), max_num_tokens=4)
    ids = torch.tensor([1, 2, 3])
    with pytest.raises(RuntimeError, match=r"is_mm_embed marks 2 positions but mm_embeds hold 1 rows"):
        runner.get_inputs_embeds(ids, [torch.zeros(1, HIDDEN)], torch.tensor([True, True, False]))
    with pytest.raises(ValueError, match=r"expected is_mm_embed of dtype torch.bool and shape \(3,\), got torch.bool \(2,\)"):
        runner.get_inputs_embeds(ids, [], torch.tensor([True, False]))
    with pytest.raises(ValueError, match=r"expected 1-D input_ids of at most 4 tokens, got shape \(5,\)"):
        runner.get_inputs_embeds(torch.arange(5), [], torch.zeros(5, dtype=torch.bool))


def test_gather_then_merge_end_to_end():
    model = FakeModel()
    cache = EncoderCache()
    f = _feature("h0", 1, 3, data=torch.arange(3 * HIDDEN, dtype=torch.float32).reshape(3, HIDDEN))
    cache.add_request("r", [f])
    runner = _runner(cache, model, max_num_tokens=8)
    hashes, kwargs = runner.prepare_mm_inputs({"r": [0]})
    cache.encoder_outputs.update(zip(hashes, runner.execute_mm_encoder(kwargs)))
    embeds, mask = _gather(runner, ["r"], [0], [5], [5])
    ids = torch.tensor([3, 0, 0, 0, 4])
    out = runner.get_inputs_embeds(ids, embeds, mask)
    torch.testing.assert_close(out[1:4], 2 * f.data + 1)
    torch.testing.assert_close(out[[0, 4]], model.table[[3, 4]])


def test_draft_lookahead_miss_one_before_the_boundary_still_raises():
    # Processed range [0, 8); the drafter reads [1, 9). An item starting at 7 is
    # interior (the target consumed position 7), so its miss is a real error.
    cache = EncoderCache()
    cache.add_request("r", [_feature("h7", 7, 4)])
    with pytest.raises(RuntimeError, match="Encoder cache miss for h7"):
        _gather(_runner(cache), ["r"], [0], [8], [100], draft_lookahead=1)
    # The item starting exactly at 8 is the boundary one: tolerated.
    cache.add_request("r", [_feature("h8", 8, 4)])
    embeds, mask = _gather(_runner(cache), ["r"], [0], [8], [100], draft_lookahead=1)
    assert embeds == [] and not mask.any()


def test_windows_out_of_slot_order_and_with_gaps():
    # Request b's window sits before a's in the batch, with a gap of 2 slots
    # between them: the mask still marks each window's own slots.
    cache = EncoderCache()
    fa, fb = _feature("fa", 1, 3), _feature("fb", 0, 2)
    cache.add_request("a", [fa])
    cache.add_request("b", [fb])
    for f in (fa, fb):
        cache.encoder_outputs[f.identifier] = _rows(f)
    embeds, mask = _runner(cache).gather_mm_embeddings(
        ["a", "b"], 12, np.array([4, 4]), np.array([6, 0]), np.array([100, 100]), np.array([0, 0])
    )
    assert [e.shape[0] for e in embeds] == [3, 2]
    assert mask.tolist() == [True, True, False, False, False, False, False, True, True, True, False, False]
    mask[0] = False  # the caller may edit it
    assert not mask[0]


def test_missing_boundary_item_sharing_placeholders_keeps_the_gathered_items_slots():
    # Two items share the span starting at the drafter's boundary position 8:
    # the cached one is gathered, the one not yet encoded is skipped, and only
    # the gathered one's embed positions are marked.
    bits = torch.tensor([True, False, True, False])
    video = _feature("v", 8, 4, is_embed=bits, modality="video")
    audio = _feature("a", 8, 4, is_embed=~bits, modality="audio")
    cache = EncoderCache()
    cache.add_request("r", [_feature("h0", 0, 8), video, audio])
    cache.encoder_outputs["h0"] = _rows(cache.mm_features["r"][0])
    cache.encoder_outputs["v"] = _rows(video)
    embeds, mask = _gather(_runner(cache), ["r"], [0], [8], [100], draft_lookahead=1)
    assert [e.modality for e in embeds] == ["image", "video"]
    assert mask.tolist() == [True] * 8  # slot 7 = position 8: video's first embed
    del cache.encoder_outputs["v"]
    cache.encoder_outputs["a"] = _rows(audio)
    embeds, mask = _gather(_runner(cache), ["r"], [0], [8], [100], draft_lookahead=1)
    assert [e.modality for e in embeds] == ["image"]  # audio has no embed at position 8
    assert mask.tolist() == [True] * 7 + [False]


def test_gathered_rows_views_on_access_and_merge_from_spans():
    """The gather's result: views with .modality made on access (kept), whole
    items served to the merge as the cached tensors themselves, and the merge
    from spans equal to the merge from the views."""
    model = FakeModel()
    cache = EncoderCache()
    whole, cut = _feature("w", 1, 3), _feature("c", 6, 4, torch.tensor([True, False, True, True]), "audio")
    cache.add_request("r", [whole, cut])
    cache.encoder_outputs.update({"w": _rows(whole), "c": _rows(cut)})
    runner = _runner(cache, model, max_num_tokens=16)
    rows, mask = _gather(runner, ["r"], [0], [8], [12])  # "c" cut after its second position
    assert len(rows) == 2 and rows.modalities == ["image", "audio"] and rows.num_rows == 4
    plain = rows.tensors()
    assert plain[0] is cache.encoder_outputs["w"] and torch.equal(plain[1], _rows(cut)[:1])
    assert [e.modality for e in rows] == ["image", "audio"] and rows[0] is rows.views()[0]
    assert torch.equal(rows[1], _rows(cut)[:1]) and rows != [] and rows == rows.views()
    ids = torch.arange(8)
    from_views = runner.get_inputs_embeds(ids, list(rows), mask).clone()
    assert torch.equal(runner.get_inputs_embeds(ids, rows, mask), from_views)
    assert torch.equal(from_views[1:4], _rows(whole)) and torch.equal(from_views[6], _rows(cut)[0])
