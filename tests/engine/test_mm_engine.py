"""Multimodal requests end to end on tiny Qwen2.5-VL / Qwen2.5-Omni thinker
checkpoints: greedy outputs equal transformers' ``generate`` whatever the
batching, chunking, prefix caching and encoder caching; encoder outputs are
shared by content and released when requests end; bad media is refused
naming the request and the item."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
from utils_engine import assert_pool_clean, make_engine, run_all
from utils_mm import chat_prompt, clip, hf_greedy_mm, image, video, write_sensitive_checkpoint

from omnistage.models.loader import LoadedModel, load_model
from omnistage.multimodal.processing import MultiModalProcessor
from omnistage.sampling_params import SamplingParams

N = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True)

CASES: dict[str, dict[str, tuple[list[str], Any]]] = {
    "vl": {
        "one image": (["image", "text"], lambda: {"image": image(0)}),
        "images interleaved": (
            ["text", "image", "text", "image", "image"],
            lambda: {"image": [image(1), image(2, 140, 140), image(3, 300, 50)]},
        ),
        "video": (["video", "text"], lambda: {"video": video(0)}),
        "video with fps and an image": (
            ["video", "image", "text"],
            lambda: {"video": (video(1, 4), {"fps": 1.0}), "image": image(4)},
        ),
    },
    "omni": {
        "one image": (["image", "text"], lambda: {"image": image(0)}),
        "audio clip": (["audio", "text"], lambda: {"audio": clip(0, 1.3)}),
        "image and audio": (["image", "audio", "text"], lambda: {"image": image(1), "audio": clip(1, 2.0)}),
        "video": (["text", "video"], lambda: {"video": video(2)}),
    },
}
TEXT_ONLY = "a plain text request in the same batch"


@dataclass
class MMModel:
    kind: str
    loaded: LoadedModel
    proc: MultiModalProcessor
    hf: Any
    refs: dict[tuple, list[int]] = field(default_factory=dict)

    def prompt(self, case: str) -> dict:
        parts, data = CASES[self.kind][case]
        return chat_prompt(self.proc, parts, data())

    def ref(self, key: Any, prompt: dict | str, n: int = N) -> list[int]:
        """transformers' greedy answer to ``prompt``, memoized under ``key``."""
        if (key, n) not in self.refs:
            out = self.proc.process(prompt)
            self.refs[(key, n)] = hf_greedy_mm(self.hf, out, n)
        return self.refs[(key, n)]

    def case_ref(self, case: str) -> list[int]:
        return self.ref(case, self.prompt(case))


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, MMModel]:
    from transformers import Qwen2_5_VLForConditionalGeneration, Qwen2_5OmniThinkerForConditionalGeneration

    out = {}
    for kind, cls in (("vl", Qwen2_5_VLForConditionalGeneration), ("omni", Qwen2_5OmniThinkerForConditionalGeneration)):
        path = write_sensitive_checkpoint(kind, tmp_path_factory.mktemp(kind))
        loaded = load_model(path)
        out[kind] = MMModel(kind, loaded, MultiModalProcessor.from_pretrained(path), cls.from_pretrained(path).eval())
    return out


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def assert_encoder_clean(engine) -> None:
    """No request holds an encoder-cache entry any more (entries may stay
    cached). Steps once so that the worker hears of the last finished ids."""
    assert not engine.has_unfinished_requests()
    engine.step()
    manager = engine.scheduler.encoder_cache_manager
    assert manager.num_referenced_entries == 0
    assert not manager._holders
    assert not engine.runner.encoder_cache.mm_features  # the worker dropped every request's items


# ---------------------------------------------------------------- equality


@pytest.mark.parametrize("kind", ["vl", "omni"])
def test_mixed_batch_matches_transformers(kind, models):
    """Every case and a text-only request in one batch, then each case alone."""
    m = models[kind]
    cases = list(CASES[kind])
    refs = [m.case_ref(c) for c in cases] + [m.ref("text", TEXT_ONLY)]
    assert len({tuple(r) for r in refs}) == len(refs), "the tiny model should answer each input differently"
    engine = make_engine(m.loaded, block_size=4)
    prompts = [m.prompt(c) for c in cases] + [TEXT_ONLY]
    assert _tokens(run_all(engine, prompts, GREEDY, prefix="batch-")) == refs
    solo = make_engine(m.loaded, block_size=4, enable_prefix_caching=False, enable_encoder_cache=False)
    for i, case in enumerate(cases):
        assert _tokens(run_all(solo, [m.prompt(case)], GREEDY, prefix=f"solo{i}-")) == [refs[i]]
    assert engine.input_modalities == ({"text", "image", "video"} | ({"audio"} if kind == "omni" else set()))
    for e in (engine, solo):
        assert_pool_clean(e)
        assert_encoder_clean(e)


@pytest.mark.parametrize("budget", [7, 64])
@pytest.mark.parametrize("prefix_caching", [True, False])
@pytest.mark.parametrize("encoder_cache", [True, False])
def test_caches_and_chunking_do_not_change_outputs(budget, prefix_caching, encoder_cache, models):
    """Token budgets that split items across steps; the same prompts twice,
    so the second round hits whichever caches are on."""
    m = models["vl"]
    cases = list(CASES["vl"])
    refs = [m.case_ref(c) for c in cases] + [m.ref("text", TEXT_ONLY)]
    engine = make_engine(
        m.loaded,
        block_size=4,
        max_num_batched_tokens=budget,
        enable_prefix_caching=prefix_caching,
        enable_encoder_cache=encoder_cache,
    )
    prompts = [m.prompt(c) for c in cases] + [TEXT_ONLY]
    num_items = sum(len(engine.process_inputs("x", p).mm_features) for p in prompts)
    first = run_all(engine, prompts, GREEDY, prefix="a")
    encoded_first = engine.runner.num_encoded_items
    second = run_all(engine, prompts, GREEDY, prefix="b")
    assert _tokens(first) == refs and _tokens(second) == refs
    # identical images inside one prompt would share; these are all distinct
    assert encoded_first == num_items
    encoded_again = engine.runner.num_encoded_items - encoded_first
    if prefix_caching or encoder_cache:
        assert encoded_again == 0  # items inside KV hits need no encoder; else the encoder cache holds them
    else:
        assert encoded_again == num_items
    stats = engine.get_stats()
    assert (stats.prefix_cache_hit_tokens > 0) == prefix_caching
    # The encoder cache's queries are the items a window needed (none inside a KV hit), its hits
    # those it held: every second-round query hits while it retains outputs.
    second_round = 0 if prefix_caching else num_items
    assert stats.encoder_cache_queries == num_items + second_round
    assert stats.encoder_cache_hits == (second_round if encoder_cache else 0)
    assert_pool_clean(engine)
    assert_encoder_clean(engine)


def test_omni_audio_split_across_steps(models):
    m = models["omni"]
    cases = ["audio clip", "image and audio"]
    engine = make_engine(m.loaded, block_size=4, max_num_batched_tokens=8, enable_prefix_caching=False)
    assert _tokens(run_all(engine, [m.prompt(c) for c in cases], GREEDY)) == [m.case_ref(c) for c in cases]
    assert_encoder_clean(engine)


def test_long_video_with_a_tiny_token_budget(models):
    """A 256-embedding video with max_num_batched_tokens=8: the encoder
    budget and cache are sized from the largest item, not from the step."""
    m = models["vl"]
    prompt = chat_prompt(m.proc, ["video", "text"], {"video": video(7, t=32, h=112, w=112)})
    (feature,) = m.proc.process(prompt).mm_features
    assert feature.mm_position.get_num_embeds() == 256
    engine = make_engine(m.loaded, block_size=4, max_num_batched_tokens=8)
    assert engine.scheduler.config.encoder_cache_size >= 256
    refs = [m.ref("long video", prompt), m.ref("text", TEXT_ONLY)]
    assert _tokens(run_all(engine, [prompt, TEXT_ONLY], GREEDY)) == refs
    assert engine.runner.num_encoded_items == 1  # encoded whole, once, read over ~35 steps
    assert_encoder_clean(engine)


# ---------------------------------------------------------------- sharing


def count_encoder_calls(adapter, monkeypatch) -> list[int]:
    """Items per call of ``adapter.embed_multimodal`` from now on (the list fills as it runs)."""
    calls: list[int] = []
    original = adapter.embed_multimodal

    def counting(modality, items):
        calls.append(len(items))
        return original(modality, items)

    monkeypatch.setattr(adapter, "embed_multimodal", counting)
    return calls


def test_second_request_reuses_the_encoder_output(models, monkeypatch):
    m = models["vl"]
    calls = count_encoder_calls(m.loaded.mm_adapter, monkeypatch)
    first = chat_prompt(m.proc, ["image", "text"], {"image": image(11)}, text="describe it")
    # other text before the image: no KV prefix in common, the encoder cache alone must serve it
    second = chat_prompt(m.proc, ["text", "image"], {"image": image(11)}, text="and now?")
    engine = make_engine(m.loaded, block_size=4)
    assert _tokens(run_all(engine, [first], GREEDY, prefix="1-")) == [m.ref("reuse 1", first)]
    assert calls == [1]
    (out,) = run_all(engine, [second], GREEDY, prefix="2-")
    assert out.outputs[0].token_ids == m.ref("reuse 2", second)
    assert calls == [1]  # the encoder did not run again
    assert out.num_cached_tokens <= m.proc.process(second).mm_features[0].mm_position.offset  # KV did not cover it
    # two requests with the same new image in one step: encoded once for both
    third = chat_prompt(m.proc, ["image", "text"], {"image": image(12)}, text="one")
    fourth = chat_prompt(m.proc, ["text", "image"], {"image": image(12)}, text="two")
    outs = run_all(engine, [third, fourth], GREEDY, prefix="3-")
    assert _tokens(outs) == [m.ref("reuse 3", third), m.ref("reuse 4", fourth)]
    assert calls == [1, 1]
    assert_encoder_clean(engine)


def test_cache_salt_keeps_tenants_apart_in_the_encoder_cache(models, monkeypatch):
    """Equal images in requests with different salts are encoded once per salt,
    so one tenant's cache hit cannot reveal another tenant's media; same salt shares."""
    m = models["vl"]
    calls = count_encoder_calls(m.loaded.mm_adapter, monkeypatch)
    base = chat_prompt(m.proc, ["text", "image"], {"image": image(31)}, text="salted")
    engine = make_engine(m.loaded, block_size=4)
    for i, salt in enumerate(["tenant-a", "tenant-b", "tenant-a"]):
        (out,) = run_all(engine, [{**base, "cache_salt": salt}], GREEDY, prefix=f"s{i}-")
        assert out.outputs[0].token_ids == m.ref("salted", base)  # the salt never changes the answer
    assert calls == [1, 1]  # tenant-b encoded again; tenant-a's second request hit its own entry
    with pytest.raises(ValueError, match=r"request 'bad'.*cache_salt must be a non-empty string"):
        engine.add_request("bad", {**base, "cache_salt": 7}, GREEDY)
    assert_encoder_clean(engine)


def test_different_images_behind_identical_text_never_share(models):
    m = models["vl"]
    a = chat_prompt(m.proc, ["text", "image", "text"], {"image": image(21)}, text="same words " * 3)
    b = chat_prompt(m.proc, ["text", "image", "text"], {"image": image(22)}, text="same words " * 3)
    pa, pb = m.proc.process(a), m.proc.process(b)
    assert pa.prompt_token_ids == pb.prompt_token_ids  # equal sizes: identical token ids
    offset = pa.mm_features[0].mm_position.offset
    engine = make_engine(m.loaded, block_size=4)
    (out_a,) = run_all(engine, [a], GREEDY, prefix="a")
    engine.add_request("b", b, GREEDY)
    engine.step()
    req_b = engine.scheduler.requests["b"]
    req_a_hashes = [h for h in _block_hashes(engine, pa)]
    # blocks up to the image may be shared; from the image's block on, none is
    first_mm_block = offset // 4
    assert req_b.block_hashes[:first_mm_block] == req_a_hashes[:first_mm_block]
    assert not set(req_b.block_hashes[first_mm_block:]) & set(req_a_hashes)
    assert req_b.num_cached_tokens <= offset
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                out_b = out
    assert out_a.outputs[0].token_ids == m.ref("diff a", a)
    assert out_b.outputs[0].token_ids == m.ref("diff b", b)
    assert out_a.outputs[0].token_ids != out_b.outputs[0].token_ids
    ids = {pa.mm_features[0].identifier, pb.mm_features[0].identifier}
    assert len(ids) == 2 and ids <= set(engine.runner.encoder_cache.encoder_outputs)
    assert_encoder_clean(engine)


def _block_hashes(engine, processed) -> list[bytes]:
    from omnistage.core.kv_cache_utils import update_block_hashes
    from omnistage.core.request import Request

    req = Request("probe", processed.prompt_token_ids, GREEDY, mm_features=processed.mm_features)
    update_block_hashes(req, engine.scheduler.block_size)
    return req.block_hashes


# ---------------------------------------------------------------- lifetime


def test_no_entry_referenced_after_finish_or_abort(models):
    m = models["omni"]
    engine = make_engine(m.loaded, block_size=4, max_num_batched_tokens=8)
    cases = list(CASES["omni"])
    for i, case in enumerate(cases):
        engine.add_request(f"r{i}", m.prompt(case), GREEDY)
    manager = engine.scheduler.encoder_cache_manager
    holders: list[str] = []
    for _ in range(300):  # until a request is inside an item that spans several steps
        engine.step()
        holders = [rid for rid, r in engine.scheduler.requests.items() if manager.get_cached_input_ids(r)]
        if holders:
            break
    assert holders and manager.num_referenced_entries > 0
    aborted = {holders[0], "r3" if holders[0] != "r3" else "r2"}
    engine.abort_request(list(aborted))
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    assert done == {f"r{i}": m.case_ref(c) for i, c in enumerate(cases) if f"r{i}" not in aborted}
    assert_pool_clean(engine)
    assert_encoder_clean(engine)


def test_preemption_re_encodes_or_hits(models):
    """A KV pool that fits about one request at a time: requests are
    preempted mid-prompt and resumed; outputs do not change."""
    m = models["vl"]
    cases = ["images interleaved", "video with fps and an image", "one image"]
    engine = make_engine(m.loaded, block_size=4, num_kv_blocks=48, max_num_batched_tokens=16)
    outs = run_all(engine, [m.prompt(c) for c in cases], GREEDY)
    assert _tokens(outs) == [m.case_ref(c) for c in cases]
    assert engine.get_stats().num_preemptions > 0
    assert_pool_clean(engine)
    assert_encoder_clean(engine)


# ---------------------------------------------------------------- bad input


def test_bad_input_is_refused_naming_request_and_item(models):
    m = models["omni"]
    engine = make_engine(m.loaded, block_size=4, max_num_batched_tokens=64)
    good = m.prompt("image and audio")
    engine.add_request("good-1", good, GREEDY)
    engine.step()  # running already when the bad ones arrive
    bad = {
        "bad-image": (
            chat_prompt(m.proc, ["image", "text"], {"image": b"\x89PNG not really"}),
            r"request 'bad-image': image item 0: could not decode",
        ),
        "bad-audio": (
            chat_prompt(m.proc, ["audio", "text"], {"audio": (clip(0, 0.5)[0].reshape(2, -1), 16000)}),
            r"request 'bad-audio': audio item 0: expected a mono waveform of shape \(num_samples,\), "
            r"got shape \(2, 4000\)",
        ),
        "too-many": (
            chat_prompt(m.proc, ["image", "text"], {"image": [image(0), image(1)]}),
            r"request 'too-many': image item 1: the prompt has 1 <\|IMAGE\|> placeholder\(s\) for 2 image item\(s\)",
        ),
        "text-model-style": (
            {"prompt": "no placeholder here", "multi_modal_data": {"image": image(0)}},
            r"request 'text-model-style': image item 0: the prompt has 0 <\|IMAGE\|> placeholder",
        ),
    }
    for rid, (prompt, message) in bad.items():
        with pytest.raises(ValueError, match=message):
            engine.add_request(rid, prompt, GREEDY)
    # An item larger than the encoder cache: Qwen2.5-VL's holds its largest default item (a 32-frame video).
    vl = make_engine(models["vl"].loaded, block_size=4, max_num_batched_tokens=64)
    assert vl.scheduler.config.encoder_cache_size == 256
    too_big = {
        **chat_prompt(models["vl"].proc, ["image", "text"], {"image": image(5, 812, 812)}),
        "mm_processor_kwargs": {"images_kwargs": {"max_pixels": 900 * 900}},
    }
    message = r"request 'too-big': image item 0 \(mm_features\[0\]\) has 841 encoder embeddings, more than the encoder"
    with pytest.raises(ValueError, match=message):
        vl.add_request("too-big", too_big, GREEDY)
    assert not vl.has_unfinished_requests()
    engine.add_request("good-2", m.prompt("audio clip"), GREEDY)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    assert done == {"good-1": m.case_ref("image and audio"), "good-2": m.case_ref("audio clip")}
    assert_pool_clean(engine)
    assert_encoder_clean(engine)


def test_a_prompt_the_model_cannot_position_fails_alone(models):
    """An image prompt whose text holds an audio marker token (as a chat client gets by typing
    it) is admitted, but the model cannot lay out its M-RoPE positions: that request fails,
    naming why, and the request beside it in the same step answers as alone."""
    m = models["omni"]
    engine = make_engine(m.loaded, block_size=4)
    engine.add_request("good", m.prompt("image and audio"), GREEDY)
    marker = chat_prompt(m.proc, ["image", "text"], {"image": image(1)}, text="is <|audio_bos|> it?")
    engine.add_request("marker", marker, GREEDY)
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert done["good"].outputs[0].token_ids == m.case_ref("image and audio")
    assert done["marker"].outputs[0].finish_reason == "error"
    assert "M-RoPE positions could not be computed" in done["marker"].error
    assert_pool_clean(engine)
    assert_encoder_clean(engine)


def test_an_item_whose_request_failed_is_never_a_hit_on_nothing(models, monkeypatch):
    """An image's cache entry is taken when its request is scheduled; if the request fails
    before the image is encoded (it cannot join the batch, or the encoder run raises), no
    request is left reading an output that does not exist: one beside it in the same step
    with the same image, and later ones, answer as alone, and so does unrelated text."""
    m = models["omni"]
    same, other = (chat_prompt(m.proc, ["image", "text"], {"image": image(i)}) for i in (1, 2))
    ref_same, ref_other = (o.outputs[0].token_ids for o in run_all(make_engine(m.loaded), [same, other], GREEDY))
    engine = make_engine(m.loaded, block_size=4)

    def answers(*requests):
        for rid, prompt in requests:
            engine.add_request(rid, prompt, GREEDY)
        done = {}
        while engine.has_unfinished_requests():
            done.update({o.request_id: o for o in engine.step() if o.finished})
        return done

    marker = chat_prompt(m.proc, ["image", "text"], {"image": image(1)}, text="is <|audio_bos|> it?")
    done = answers(("marker", marker), ("same", same), ("text", "a plain text request"))
    assert done["marker"].outputs[0].finish_reason == "error"
    assert done["same"].outputs[0].token_ids == ref_same and done["text"].error is None
    assert answers(("again", same))["again"].outputs[0].token_ids == ref_same

    adapter = engine.runner.mm_adapter
    real, calls = adapter.embed_multimodal, []

    def fails_once(modality, items):
        calls.append(modality)
        if len(calls) == 1:
            raise RuntimeError("out of memory (simulated)")
        return real(modality, items)

    monkeypatch.setattr(adapter, "embed_multimodal", fails_once)
    assert "out of memory" in answers(("oom", other))["oom"].error
    done = answers(("retry", other), ("text-2", "a plain text request"))
    assert done["retry"].outputs[0].token_ids == ref_other and done["text-2"].error is None
    assert_pool_clean(engine)
    assert_encoder_clean(engine)


def test_text_model_refuses_media(tiny_loaded):
    engine = make_engine(tiny_loaded("qwen3"))
    assert engine.input_modalities == {"text"}
    with pytest.raises(ValueError, match=r"request 'x': this model takes text only; got multimodal input \['image'\]"):
        engine.add_request("x", {"prompt": "hi", "multi_modal_data": {"image": image(0)}})
    assert not engine.has_unfinished_requests()
