"""ModelState: encode-and-publish, gather, and inputs_embeds end to end."""

import dataclasses
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from omnistage.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from omnistage.worker.mm.encoder_cache import EncoderCache
from omnistage.worker.model_state import ModelState

HIDDEN = 6
IMG = 99  # placeholder token id


class FakeModel:
    def __init__(self):
        self.table = torch.randn(128, HIDDEN, generator=torch.Generator().manual_seed(1))
        self.calls: list[tuple[str, int]] = []

    def embed_multimodal(self, modality, items):
        self.calls.append((modality, len(items)))
        return [torch.tanh(x) * 3 for x in items]

    def embed_input_ids(self, input_ids):
        return self.table[input_ids]


@dataclass
class Step:
    """The BatchStep fields ModelState reads."""

    req_ids: list[str]
    num_scheduled_tokens: np.ndarray
    query_start_loc: np.ndarray
    num_computed_tokens: np.ndarray
    prefill_lens: np.ndarray
    num_tokens: int
    input_ids: torch.Tensor


def test_batch_step_has_the_fields_model_state_reads():
    from omnistage.worker.input_batch import BatchStep

    have = {f.name for f in dataclasses.fields(BatchStep)}
    assert {f.name for f in dataclasses.fields(Step)} <= have


def _prompt(rng: torch.Generator, items: list[tuple[str, int, int, torch.Tensor | None]]):
    """Token ids with IMG placeholders, and the features (identifier, offset,
    length, mask) with random encoder inputs as data."""
    length = max(off + n for _, off, n, _ in items) + 3
    ids = torch.randint(0, 90, (length,), generator=rng)
    features = []
    for ident, off, n, mask in items:
        ids[off : off + n] = IMG
        pos = PlaceholderRange(off, n, mask)
        data = torch.randn(pos.get_num_embeds(), HIDDEN, generator=rng)
        features.append(MultiModalFeatureSpec(data, "image", ident, pos))
    return ids, features


def _expected_embeds(model, ids, features):
    out = model.table[ids].clone()
    for f in features:
        rows = torch.tanh(f.data) * 3
        pos = f.mm_position
        bits = [True] * pos.length if pos.is_embed is None else pos.is_embed.tolist()
        row = 0
        for k, bit in enumerate(bits):
            if bit:
                out[pos.offset + k] = rows[row]
                row += 1
    return out


def test_prepare_inputs_embeds_chunked_prefill_end_to_end():
    rng = torch.Generator().manual_seed(0)
    model = FakeModel()
    cache = EncoderCache()
    state = ModelState(model, cache, max_num_tokens=64, hidden_size=HIDDEN, dtype=torch.float32, device=torch.device("cpu"))
    mask = torch.tensor([True, True, False, True, True, True, False, True])
    prompts = {
        "a": _prompt(rng, [("a-img0", 2, 5, None), ("a-img1", 10, 8, mask)]),
        "b": _prompt(rng, [("b-img0", 1, 6, None)]),
    }
    for req_id, (_, features) in prompts.items():
        cache.add_request(req_id, features)
    expected = {r: _expected_embeds(model, ids, feats) for r, (ids, feats) in prompts.items()}
    got = {r: [] for r in prompts}
    computed = {r: 0 for r in prompts}
    encoded: set[str] = set()
    chunk = 4
    while any(computed[r] < len(prompts[r][0]) for r in prompts):
        batch = [r for r in prompts if computed[r] < len(prompts[r][0])]
        sched = [min(chunk, len(prompts[r][0]) - computed[r]) for r in batch]
        # Scheduler's part: encode each item whose span meets the window, once.
        scheduled = {}
        for r, n in zip(batch, sched):
            for k, f in enumerate(prompts[r][1]):
                pos = f.mm_position
                if pos.offset < computed[r] + n and pos.offset + pos.length > computed[r] and f.identifier not in encoded:
                    scheduled.setdefault(r, []).append(k)
                    encoded.add(f.identifier)
        ns = np.array(sched)
        qsl = np.concatenate(([0], np.cumsum(ns)))
        step = Step(
            req_ids=batch,
            num_scheduled_tokens=ns,
            query_start_loc=qsl,
            num_computed_tokens=np.array([computed[r] for r in batch]),
            prefill_lens=np.array([len(prompts[r][0]) for r in batch]),
            num_tokens=int(qsl[-1]),
            input_ids=torch.cat([prompts[r][0][computed[r] : computed[r] + n] for r, n in zip(batch, sched)]),
        )
        embeds = state.prepare_inputs_embeds(scheduled, step)
        assert embeds.shape == (step.num_tokens, HIDDEN)
        for i, r in enumerate(batch):
            got[r].append(embeds[qsl[i] : qsl[i + 1]].clone())
            computed[r] += sched[i]
    for r in prompts:
        torch.testing.assert_close(torch.cat(got[r]), expected[r])
    assert sum(n for _, n in model.calls) == 3  # each item encoded exactly once
    assert set(cache.encoder_outputs) == {"a-img0", "a-img1", "b-img0"}


def test_execute_mm_encoder_publishes_and_batches():
    model = FakeModel()
    cache = EncoderCache()
    state = ModelState(model, cache, 16, HIDDEN, torch.float32, torch.device("cpu"))
    rng = torch.Generator().manual_seed(2)
    _, fa = _prompt(rng, [("x", 0, 2, None), ("y", 4, 3, None)])
    _, fb = _prompt(rng, [("z", 0, 2, None)])
    cache.add_request("a", fa)
    cache.add_request("b", fb)
    state.execute_mm_encoder({"a": [0, 1], "b": [0]})
    assert model.calls == [("image", 3)]
    assert set(cache.encoder_outputs) == {"x", "y", "z"}
    torch.testing.assert_close(cache.encoder_outputs["y"], torch.tanh(fa[1].data) * 3)
    state.execute_mm_encoder({})
    assert model.calls == [("image", 3)]


def test_gather_without_scheduled_items_uses_only_the_cache():
    model = FakeModel()
    cache = EncoderCache()
    state = ModelState(model, cache, 16, HIDDEN, torch.float32, torch.device("cpu"))
    f = MultiModalFeatureSpec(None, "image", "h", PlaceholderRange(0, 2))
    cache.add_request("r", [f])
    cache.encoder_outputs["h"] = torch.ones(2, HIDDEN)
    step = Step(["r"], np.array([3]), np.array([0, 3]), np.array([0]), np.array([10]), 3, torch.tensor([IMG, IMG, 5]))
    embeds, mask = state.gather_mm_embeddings(step)
    assert mask.tolist() == [True, True, False] and len(embeds) == 1
    embeds, mask = state.gather_mm_embeddings(step, draft_lookahead=1)
    assert mask.tolist() == [True, False, False]


def test_text_only_model_state():
    model = FakeModel()
    state = ModelState(model, None, 16, HIDDEN, torch.float32, torch.device("cpu"))
    assert state.encoder_runner is None and not state.supports_mm_inputs
    step = Step(["r"], np.array([3]), np.array([0, 3]), np.array([0]), np.array([3]), 3, torch.tensor([1, 2, 3, 0]))
    torch.testing.assert_close(state.prepare_inputs_embeds({}, step), model.table[[1, 2, 3]])
    embeds, mask = state.gather_mm_embeddings(step)
    assert embeds == [] and mask.shape == (3,) and not mask.any()
    state.execute_mm_encoder({})
    with pytest.raises(ValueError, match="for a model without an encoder cache"):
        state.execute_mm_encoder({"r": [0]})
    assert state.dummy_inputs_embeds(2) is None
