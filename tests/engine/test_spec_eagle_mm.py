"""EAGLE speculation on multimodal targets (tiny Qwen2.5-VL, Qwen2.5-Omni thinker).

The head's input at a placeholder position is the encoder row of the *next*
position (``gather_mm_embeddings(draft_lookahead=1)``). Greedy outputs with
the head equal speculation off under every batching, chunking and caching
shape; the scheduler encodes the drafter's boundary item early when it can
and never stalls on it when it cannot; nothing is held afterwards.
"""

from __future__ import annotations

from typing import Any

import pytest
from utils_engine import assert_pool_clean, make_engine, run_all
from utils_mm import chat_prompt, clip, image, video, write_sensitive_checkpoint

from omnistage.core.spec_policy import DEFAULT_VERIFY_COSTS
from omnistage.models.loader import load_model
from omnistage.multimodal.processing import MultiModalProcessor
from omnistage.sampling_params import SamplingParams
from omnistage.testing.tiny_eagle import write_tiny_eagle_head

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
K = 3

CASES = {
    "vl": [
        (["image", "text"], lambda: {"image": image(0)}),
        (
            ["text", "image", "text", "image"],
            lambda: {"image": [image(1), image(2, 140, 140)]},
        ),
        (["video", "text"], lambda: {"video": video(0)}),
    ],
    "omni": [
        (["audio", "text"], lambda: {"audio": clip(0, 1.3)}),
        (
            ["image", "audio", "text"],
            lambda: {"image": image(1), "audio": clip(1, 2.0)},
        ),
    ],
}
TEXT = "a plain text request in the same batch"


class Target:
    def __init__(self, kind: str, root: Any) -> None:
        path = write_sensitive_checkpoint(kind, root / kind)
        self.loaded = load_model(path)
        self.proc = MultiModalProcessor.from_pretrained(path)
        self.head = str(write_tiny_eagle_head(path, root / f"{kind}_head"))
        self.kind = kind

    def prompts(self) -> list:
        return [
            chat_prompt(self.proc, parts, data()) for parts, data in CASES[self.kind]
        ] + [TEXT]

    def eagle(self, k: int = K) -> dict:
        return {"method": "eagle", "model": self.head, "num_speculative_tokens": k}


@pytest.fixture(autouse=True)
def _draft_every_step(always_draft):
    """These tests cover verification, rollback and caching: the draft policy
    asks the head for full runs every step (its EAGLE behaviour is tested in
    test_spec_policy.py)."""


@pytest.fixture(scope="module")
def targets(tmp_path_factory) -> dict[str, Target]:
    root = tmp_path_factory.mktemp("spec_eagle_mm")
    return {kind: Target(kind, root) for kind in ("vl", "omni")}


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def _drain_and_check_clean(engine) -> None:
    while engine.has_unfinished_requests():
        engine.step()
    engine.step()  # the worker hears of the last finished ids
    assert engine.held().is_empty, engine.held()
    assert_pool_clean(engine)
    assert engine.scheduler.encoder_cache_manager.num_referenced_entries == 0
    assert not engine.runner.encoder_cache.mm_features


SHAPES = {
    "whole": {},
    "chunk8": {"max_num_batched_tokens": 8},  # splits every item
}


@pytest.mark.parametrize("kind", ["vl", "omni"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_greedy_equals_speculation_off(kind, shape, targets):
    """A mixed batch (items and text), twice (the second round hits the prefix
    cache when it is on): tokens and prefix-hit counts equal speculation off."""
    t = targets[kind]
    kwargs = {"block_size": 4, **SHAPES[shape]}
    results = []
    for spec in (None, t.eagle()):
        engine = make_engine(t.loaded, speculative_config=spec, **kwargs)
        first = run_all(engine, t.prompts(), GREEDY, prefix="a")
        second = run_all(engine, t.prompts(), GREEDY, prefix="b")
        stats = engine.get_stats()
        results.append((_tokens(first), _tokens(second), stats.prefix_cache_hit_tokens))
        if spec is not None:
            assert stats.num_draft_tokens > 0
        _drain_and_check_clean(engine)
    assert results[0] == results[1]


def _spy_schedule(engine) -> list:
    outs = []
    schedule = engine.scheduler.schedule

    def spy():
        so = schedule()
        outs.append(so)
        return so

    engine.scheduler.schedule = spy
    return outs


def _spy_gather(engine) -> list[tuple[int, int]]:
    """(draft_lookahead, encoder rows gathered) of every gather, target and drafter."""
    calls = []
    runner = engine.runner.model_state.encoder_runner
    gather = runner.gather_mm_embeddings

    def spy(*args, **kwargs):
        rows, mask = gather(*args, **kwargs)
        lookahead = kwargs.get("draft_lookahead", args[6] if len(args) > 6 else 0)
        calls.append((lookahead, int(mask.sum())))
        return rows, mask

    runner.gather_mm_embeddings = spy
    return calls


def test_image_at_a_step_boundary_is_encoded_early_when_the_budget_allows(targets):
    """A window that ends exactly where an image starts: with the head, the
    image is encoded in that step (its first row is the drafter's input at the
    window's last position); without, one step later. Outputs agree."""
    t = targets["vl"]
    prompt = chat_prompt(t.proc, ["image", "text"], {"image": image(0)})
    offset = t.proc.process(prompt).mm_features[0].mm_position.offset
    outs = []
    for spec in (None, t.eagle()):
        engine = make_engine(t.loaded, block_size=4, max_num_batched_tokens=offset, enable_prefix_caching=False,
                             speculative_config=spec)  # fmt: skip
        seen = _spy_schedule(engine)
        gathers = _spy_gather(engine)
        outs.append(_tokens(run_all(engine, [prompt], GREEDY)))
        encodes = [i for i, so in enumerate(seen) if so.scheduled_encoder_inputs]
        assert seen[0].num_scheduled_tokens == {
            "0": offset
        }  # window 0 ends at the image
        assert encodes[0] == (0 if spec else 1)
        # Step 0: the target's window holds no image row; the drafter's, one
        # position ahead, holds the image's first.
        assert gathers[0] == (0, 0)
        if spec:
            assert gathers[1] == (1, 1)
        _drain_and_check_clean(engine)
    assert outs[0] == outs[1]


def _one_item_cache(engine, size: int):
    """Shrink a fresh engine's encoder cache to ``size`` embeddings. (The engine
    sizes it to at least the largest item its processor could ever produce,
    far above these prompts' items, so the option alone cannot make it this small.)"""
    manager = engine.scheduler.encoder_cache_manager
    assert manager.num_free_slots == manager.cache_size  # nothing allocated yet
    manager.cache_size = manager.num_free_slots = manager.num_freeable_slots = size
    return engine


@pytest.mark.parametrize("kind", ["vl", "omni"])
def test_encoder_cache_of_one_item_never_stalls_on_the_look_ahead(kind, targets):
    """An encoder cache that holds one item (the largest) and a budget of 8:
    while one item is referenced the next boundary item can never be taken
    early, so the drafter falls back to token embeddings there; every request
    still finishes with speculation-off tokens."""
    t = targets[kind]
    prompts = t.prompts()
    engine_off = make_engine(t.loaded, block_size=4, max_num_batched_tokens=8)
    biggest = max(
        f.mm_position.get_num_embeds()
        for p in prompts[:-1]
        for f in engine_off.process_inputs("x", p).mm_features
    )
    kwargs = {"block_size": 4, "max_num_batched_tokens": 8}
    ref = _tokens(
        run_all(
            _one_item_cache(make_engine(t.loaded, **kwargs), biggest), prompts, GREEDY
        )
    )
    engine = _one_item_cache(
        make_engine(t.loaded, speculative_config=t.eagle(), **kwargs), biggest
    )
    seen = _spy_schedule(engine)
    assert _tokens(run_all(engine, prompts, GREEDY)) == ref
    assert all(
        so.total_num_scheduled_tokens > 0 for so in seen[:-1]
    )  # progress every step
    _drain_and_check_clean(engine)


def test_preemption_and_batch_of_sixteen(targets):
    """Sixteen requests (items and text) in a pool too small for them all:
    requests are preempted mid-prompt and resumed; tokens equal speculation off."""
    t = targets["vl"]
    prompts = (t.prompts() * 4)[:16]
    kwargs = {
        "block_size": 4,
        "num_kv_blocks": 64,
        "max_num_batched_tokens": 32,
        "max_num_seqs": 16,
    }
    ref = _tokens(run_all(make_engine(t.loaded, **kwargs), prompts, GREEDY))
    engine = make_engine(t.loaded, speculative_config=t.eagle(), **kwargs)
    assert _tokens(run_all(engine, prompts, GREEDY)) == ref
    assert engine.get_stats().num_preemptions > 0
    _drain_and_check_clean(engine)


def test_abort_mid_item_holds_nothing(targets):
    t = targets["omni"]
    engine = make_engine(
        t.loaded, block_size=4, max_num_batched_tokens=8, speculative_config=t.eagle()
    )
    for i, p in enumerate(t.prompts()):
        engine.add_request(f"r{i}", p, GREEDY)
    for _ in range(4):
        engine.step()
    engine.abort_request(["r0", "r2"])
    while engine.has_unfinished_requests():
        engine.step()
    _drain_and_check_clean(engine)


@pytest.mark.parametrize("kind", ["vl", "omni"])
def test_step_costs_measured_on_a_multimodal_target(kind, targets, monkeypatch):
    """The start-up timing runs an M-RoPE target's forward too (``worker/step_costs.py``),
    and what it leaves in the KV cache never reaches a request."""
    monkeypatch.setenv("OMNISTAGE_MEASURE_STEP_COST", "1")
    t = targets[kind]
    engine = make_engine(t.loaded, speculative_config=t.eagle(), block_size=4)
    cost = engine.scheduler.draft_policy.step_cost
    assert cost.verify_curves != DEFAULT_VERIFY_COSTS and cost.verify_curves[1][0] == (1, 1.0)  # measured
    off = run_all(make_engine(t.loaded, block_size=4), t.prompts(), GREEDY, prefix="off")
    assert _tokens(run_all(engine, t.prompts(), GREEDY)) == _tokens(off)
    _drain_and_check_clean(engine)
