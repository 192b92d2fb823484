"""Caches never change what Qwen3-Omni says: thinker prefix hits (whole or chunked
prefill, hits and misses in one step, after a preemption) give the talker every
row through the tensor prefix cache; the talker's frames take the deferred path
(staged at sampling, committed at finish, discarded on abort)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from qwen3_utils import assert_nothing_held, assert_same_answer, chat_ids, run_until_idle

from omnistage.core.spec_policy import StepCost
from omnistage.sampling_params import SamplingParams

SP = SamplingParams(temperature=0.0, max_tokens=6)
STORY = "tell me a story about a fox and a dog, please"


def conversation(llm: Any) -> list[Any]:
    """Turn 1, then three requests added together: a second turn (a hit on turn 1's
    prompt and answer), an unrelated prompt (a miss), and turn 1 again (a hit)."""
    tok = llm.get_tokenizer()
    base = chat_ids(tok, STORY)
    first = llm.generate([{"prompt_token_ids": base}], SP, use_tqdm=False)[0]
    follow = tok(
        "\n<|im_start|>user\nand then what?<|im_end|>\n<|im_start|>assistant\n"
    ).input_ids
    turn2 = base + list(first.outputs[0].token_ids) + follow
    # No system turn: it shares no block with the others.
    other = tok(
        "<|im_start|>user\nan unrelated question<|im_end|>\n<|im_start|>assistant\n"
    ).input_ids
    prompts = [{"prompt_token_ids": p} for p in (turn2, other, base)]
    return [first, *llm.generate(prompts, SP, use_tqdm=False)]


def _chunk(chunk: int | None) -> dict[str, int]:
    return {} if chunk is None else {"max_num_batched_tokens": chunk}


@pytest.fixture(scope="module")
def cache_off(make_q3: Any) -> dict[int | None, list[Any]]:
    return {
        c: conversation(make_q3(enable_prefix_caching=False, **_chunk(c)))
        for c in (None, 16)
    }


@pytest.mark.parametrize(
    "chunk", [None, 16], ids=["whole-prefill", "chunked-prefill-16"]
)
def test_second_turn_hits_and_equals_cache_off(
    make_q3: Any, cache_off: dict, chunk: int | None
) -> None:
    llm = make_q3(**_chunk(chunk))
    cache = llm.llm_engine.stages["thinker"].runner.tensor_cache
    steps: list[tuple[int, int]] = []  # (requests in a thinker step, hits merged in it)
    original = cache.merge

    def spy(step: Any, *args: Any) -> Any:
        before = cache.num_hit_requests
        merged = original(step, *args)
        steps.append((len(step.req_ids), cache.num_hit_requests - before))
        return merged

    cache.merge = spy  # type: ignore[method-assign]
    outs = conversation(llm)
    assert [o.num_cached_tokens > 0 for o in outs] == [False, True, False, True]
    assert cache.num_hit_requests == 2
    assert any(n > hits > 0 for n, hits in steps)  # a hit and a miss merged in one step
    for ours, ref in zip(outs, cache_off[chunk]):
        assert ours.audio is not None and len(ours.extra["codec_frames"]) > 0
        assert_same_answer(ours, ref)
    assert_nothing_held(llm)


@pytest.mark.parametrize("stage", ["thinker", "talker"])
def test_preempted_requests_equal_a_roomy_pool(make_q3: Any, stage: str) -> None:
    """A pool too small for all requests at once preempts (the thinker's: the merge
    rebuilds the resumed request's rows; the talker's: its frames survive, they are
    the request's state). Results equal those of a roomy pool."""
    tok = make_q3().get_tokenizer()
    prompts = [
        {"prompt_token_ids": chat_ids(tok, STORY + " " + s)}
        for s in ("aaaa", "bbbb", "cccc")
    ]
    params = SamplingParams(temperature=0.0, max_tokens=12)
    roomy = make_q3().generate(prompts, params, use_tqdm=False)
    tight = make_q3(
        **(
            {"num_kv_blocks": 48}
            if stage == "thinker"
            else {"talker_num_kv_blocks": 33}
        )
    )
    outs = tight.generate(prompts, params, use_tqdm=False)
    assert tight.llm_engine.stages[stage].scheduler.num_preemptions > 0
    for ours, ref in zip(outs, roomy):
        assert_same_answer(ours, ref)
    assert_nothing_held(tight)


def test_frames_take_the_deferred_path(make_q3: Any) -> None:
    """The talker declares ``codes.audio`` deferred: while a request speaks its frames
    are staged; at finish they are committed to the tensor cache at the rows of the
    tokens that sampled them (and nothing stays staged)."""
    llm = make_q3()
    talker = llm.llm_engine.stages["talker"]
    cache = talker.runner.tensor_cache
    assert cache is not None and cache.policy.deferred_keys == frozenset(
        {"codes.audio"}
    )
    assert not talker.runner.tensor_cache.policy.full_prefix_hidden
    staged_seen = 0
    pipeline = llm.llm_engine
    pipeline.add_request(
        "r", {"prompt_token_ids": chat_ids(llm.get_tokenizer(), STORY)}, SP
    )
    done = []
    while pipeline.has_unfinished_requests():
        done.extend(o for o in pipeline.step() if o.finished)
        staged_seen = max(staged_seen, talker.held().staged_tensors)
    assert staged_seen == 1 and talker.held().staged_tensors == 0
    rows = cache.cache.mm_outputs_cache["codes.audio"]
    frames = done[0].extra["codec_frames"]
    flat = {tuple(r) for r in rows.reshape(-1, 4).tolist()}
    assert all(tuple(f) in flat for f in frames)
    assert_nothing_held(llm)


_MEDIA_PROMPTS = {
    "image": "look at this picture <|vision_start|><|image_pad|><|vision_end|>what is it?",
    "video": "watch this <|vision_start|><|video_pad|><|vision_end|>what happens?",
}


def _media_conversation(llm: Any, modality: str, item: Any) -> list[Any]:
    tok = llm.get_tokenizer()
    text = f"<|im_start|>user\n{_MEDIA_PROMPTS[modality]}<|im_end|>\n"
    text += "<|im_start|>assistant\n"
    first = llm.generate(
        [{"prompt": text, "multi_modal_data": {modality: item}}], SP, use_tqdm=False
    )[0]
    answer = tok.decode(first.outputs[0].token_ids, skip_special_tokens=False)
    second = (
        text
        + answer
        + "\n<|im_start|>user\nand then?<|im_end|>\n<|im_start|>assistant\n"
    )
    return [
        first,
        llm.generate(
            [{"prompt": second, "multi_modal_data": {modality: item}}],
            SP,
            use_tqdm=False,
        )[0],
    ]


@pytest.mark.parametrize("modality", ["image", "video"])
def test_media_second_turn_hits_and_equals_cache_off(make_q3: Any, modality: str) -> None:
    """A second turn with the same image or video hits the thinker's prefix (media
    blocks included): same text, frames and audio as with prefix caching off."""
    from PIL import Image

    rng = np.random.default_rng(1)
    # Qwen3-Omni's processor sizes every video to at least 128 merged tokens per frame pair: one pair.
    item = (
        Image.fromarray(rng.integers(0, 255, (64, 96, 3), dtype=np.uint8))
        if modality == "image"
        else rng.integers(0, 255, (2, 32, 32, 3), dtype=np.uint8)
    )
    room = {"max_model_len": 512, "talker_max_model_len": 640}
    off = _media_conversation(
        make_q3(enable_prefix_caching=False, max_num_batched_tokens=16, **room), modality, item
    )
    llm = make_q3(max_num_batched_tokens=16, **room)
    on = _media_conversation(llm, modality, item)
    assert on[1].num_cached_tokens > 0
    for ours, ref in zip(on, off):
        assert list(ours.prompt_token_ids) == list(ref.prompt_token_ids)
        assert_same_answer(ours, ref)
    assert_nothing_held(llm)


def test_speculating_neighbour_leaves_the_talker_rows_exact(make_q3: Any) -> None:
    """Speculation on the thinker, chunked prefill: an image prefilled in the steps where a
    neighbour's drafts are rejected hands the talker (and the tensor prefix cache) the rows
    of its own tokens. The placeholder rows are a layer's output the model captured during
    the step's forward, cut to the verified tokens like the step: the same answer as alone
    without speculation, and again on a prefix hit."""
    from PIL import Image

    rng = np.random.default_rng(5)
    picture = Image.fromarray(rng.integers(0, 255, (224, 280, 3), dtype=np.uint8))
    prompt = {
        "prompt": "<|im_start|>user\nlook <|vision_start|><|image_pad|><|vision_end|>what is it?<|im_end|>\n"
        "<|im_start|>assistant\n",
        "multi_modal_data": {"image": picture},
    }
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    alone = make_q3(enable_prefix_caching=False).generate([prompt], params, use_tqdm=False)[0]
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2, "prompt_lookup_min": 1}
    llm = make_q3(speculative_config=ngram, max_num_batched_tokens=16)
    engine = llm.llm_engine
    engine.thinker.scheduler.draft_policy.step_cost = StepCost.linear(0.01)  # drafts cheap: k every step
    repeating = chat_ids(llm.get_tokenizer(), "one two three four one two three four one two three four one two")
    engine.add_request(
        "copier", {"prompt_token_ids": repeating}, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True),
        return_audio=False,
    )  # fmt: skip
    for _ in range(3):
        engine.step()  # the copier decodes and drafts
    engine.add_request("image", prompt, params)  # prefilled in chunks beside the copier's verify steps
    done = {o.request_id: o for o in run_until_idle(llm)}
    copier = done["copier"].metrics
    assert 0 < copier.num_accepted_tokens < copier.num_draft_tokens  # drafts kept and drafts rejected
    assert_same_answer(done["image"], alone)
    again = llm.generate([prompt], params, use_tqdm=False)[0]
    assert again.num_cached_tokens > 0
    assert_same_answer(again, alone)
    assert_nothing_held(llm)


def test_thinker_keeps_no_step_tensors_between_steps(make_q3: Any) -> None:
    """Found in review: the thinker adapter kept the last step's captured layer output
    (``[1, tokens, hidden]``) after every request had ended. Whatever the step read it
    (the tensor prefix cache, or a request's rows for the talker), nothing of a step
    outlives it, and the answer is that of the same request with the cache off."""
    from PIL import Image

    picture = Image.fromarray(np.random.default_rng(3).integers(0, 255, (64, 96, 3), dtype=np.uint8))
    prompt = {
        "prompt": "<|im_start|>user\nlook <|vision_start|><|image_pad|><|vision_end|>what is it?<|im_end|>\n"
        "<|im_start|>assistant\n",
        "multi_modal_data": {"image": picture},
    }
    answers = []
    for cache in (True, False):
        llm = make_q3(enable_tensor_prefix_cache=cache, max_num_batched_tokens=16)
        adapter = llm.llm_engine.thinker.runner.mm_adapter
        assert adapter.accept_hidden_layer < len(adapter.language_model.layers)  # its layer output is captured
        requests = {"speaks": True, "text-only": False} if cache else {"speaks": True}
        for rid, audio in requests.items():
            llm.llm_engine.add_request(rid, prompt, SP, return_audio=audio)
        done = {}
        while llm.llm_engine.has_unfinished_requests():
            done.update((o.request_id, o) for o in llm.llm_engine.step() if o.finished)
            assert adapter._accepted is None and adapter._step_deepstack is None
        assert all(o.error is None for o in done.values())
        answers.append(done["speaks"])
        assert_nothing_held(llm)
    assert_same_answer(*answers)
