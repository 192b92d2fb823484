"""Prompt logprobs (``SamplingParams.prompt_logprobs``) against transformers' log-softmax over the
same weights: chunked prefill that splits every prompt, prefix caching on, preemption, ``n > 1`` and
speculation on; the cache keeps serving the requests that do not ask."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM
from utils_engine import assert_pool_clean, make_engine, run_all

from omnistage.sampling_params import SamplingParams

ARCH = "qwen2"
TOP_N = 3
SHARED = list(range(3, 43))  # 40 tokens: several blocks of 4 and chunks of 8
PROMPTS = [SHARED + [50, 51, 52], SHARED + [60, 61], [7, 8, 9, 10, 11, 12, 13], [99]]


@pytest.fixture(scope="module")
def hf(tiny_paths):
    return AutoModelForCausalLM.from_pretrained(tiny_paths[ARCH], dtype=torch.float32).eval()


def _reference(hf, prompt: list[int]) -> torch.Tensor:
    """``[P, V]`` log-softmax at each prompt position (row j scores token j + 1)."""
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), -1)


def _assert_scored(entries, prompt: list[int], ref: torch.Tensor) -> None:
    assert len(entries) == len(prompt) and entries[0] is None
    for j in range(1, len(prompt)):
        top = ref[j - 1].topk(TOP_N)
        expected = {prompt[j]: ref[j - 1, prompt[j]].item(), **dict(zip(top.indices.tolist(), top.values.tolist()))}
        assert entries[j].keys() == expected.keys(), j
        assert list(entries[j].values()) == pytest.approx([expected[t] for t in entries[j]], abs=1e-4), j


def _params(**kw) -> SamplingParams:
    return SamplingParams(**{"temperature": 0.0, "max_tokens": 4, "ignore_eos": True, "prompt_logprobs": TOP_N, **kw})


def test_prompt_logprobs_match_transformers_in_chunks_beside_prefix_hits(tiny_loaded, hf):
    loaded = tiny_loaded(ARCH)
    engine = make_engine(loaded, block_size=4, max_num_batched_tokens=8, enable_prefix_caching=True)
    plain = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    warm = run_all(engine, [PROMPTS[0]], plain, prefix="warm")[0]  # caches the shared prefix
    assert warm.prompt_logprobs is None
    outs = run_all(engine, PROMPTS + [PROMPTS[1]], [_params()] * len(PROMPTS) + [plain])
    for prompt, out in zip(PROMPTS, outs):
        _assert_scored(out.prompt_logprobs, prompt, _reference(hf, prompt))
    # Asking reads no prefix (its positions must run); the request beside it that does not ask hits.
    assert [o.num_cached_tokens for o in outs] == [0, 0, 0, 0, 40]
    # The prompt logprobs change nothing else: the outputs are the plain run's.
    again = run_all(engine, PROMPTS, plain, prefix="plain")
    assert [o.outputs[0].token_ids for o in outs[:4]] == [o.outputs[0].token_ids for o in again]
    assert_pool_clean(engine)


def test_prompt_logprobs_once_per_token_through_preemption_n_and_speculation(tiny_loaded, hf, always_draft):
    loaded = tiny_loaded(ARCH)
    refs = [_reference(hf, p) for p in PROMPTS[:3]]
    # 16 blocks of 4 hold about one of the long requests: they preempt and run their prompts again.
    tight = make_engine(loaded, block_size=4, num_kv_blocks=16, max_num_batched_tokens=16)
    outs = run_all(tight, PROMPTS[:3], _params(max_tokens=12))
    assert tight.get_stats().num_preemptions > 0
    for out, prompt, ref in zip(outs, PROMPTS, refs):
        _assert_scored(out.prompt_logprobs, prompt, ref)
    assert_pool_clean(tight)
    two = run_all(make_engine(loaded), [PROMPTS[0]], _params(n=2, temperature=0.8, seed=1))[0]
    assert len(two.outputs) == 2
    _assert_scored(two.prompt_logprobs, PROMPTS[0], refs[0])
    ngram = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    spec = make_engine(loaded, speculative_config=ngram)
    on = run_all(spec, PROMPTS[:3], _params(max_tokens=12))
    off = run_all(make_engine(loaded), PROMPTS[:3], _params(max_tokens=12))
    assert [o.prompt_logprobs for o in on] == [o.prompt_logprobs for o in off]
    assert [o.outputs[0].token_ids for o in on] == [o.outputs[0].token_ids for o in off]
    assert spec.get_stats().num_draft_tokens > 0
    assert_pool_clean(spec)


def test_prompt_logprobs_past_the_vocabulary_are_refused(tiny_loaded):
    engine = make_engine(tiny_loaded(ARCH))
    with pytest.raises(ValueError, match=r"request 'big': SamplingParams\.prompt_logprobs \(\d+\) exceeds the vocab"):
        engine.add_request("big", {"prompt_token_ids": [1, 2]}, _params(prompt_logprobs=10**6))
    assert not engine.has_unfinished_requests()


def test_prompt_logprobs_of_an_image_prompt_in_chunks_that_split_the_image(tmp_path):
    """Qwen2.5-VL: the positions of the image's rows are scored like any other (transformers' forward with
    the pixels), with a chunk budget of 8 that splits the image's rows across steps."""
    from transformers import Qwen2_5_VLForConditionalGeneration
    from utils_mm import chat_prompt, image, write_sensitive_checkpoint

    from omnistage.models.loader import load_model
    from omnistage.multimodal.processing import MultiModalProcessor
    from omnistage.testing.hf_reference import hf_reference_inputs

    path = write_sensitive_checkpoint("vl", tmp_path / "vl")
    proc = MultiModalProcessor.from_pretrained(path)
    hf = Qwen2_5_VLForConditionalGeneration.from_pretrained(path).eval()
    prompt = chat_prompt(proc, ["text", "image", "text"], {"image": image(3)})
    processed = proc.process(prompt)
    ids = torch.tensor([processed.prompt_token_ids])
    with torch.no_grad():
        ref = torch.log_softmax(hf(**hf_reference_inputs(hf, processed, ids)).logits[0].float(), -1)
    engine = make_engine(load_model(path), block_size=4, max_num_batched_tokens=8)
    out = run_all(engine, [prompt], _params())[0]
    _assert_scored(out.prompt_logprobs, processed.prompt_token_ids, ref)
    assert_pool_clean(engine)


def test_prompt_logprobs_score_a_continuation_as_its_decode_did_on_the_embedded_default():
    """The embedded default (GGUF, 8-bit LM head): a prompt that is an earlier request's prompt and
    output scores those output tokens as decoding them reported (their logprobs and top-2)."""
    from omnistage.models.loader import load_model

    loaded = load_model(None)
    engine = make_engine(loaded)
    prompt = engine.encode_chat([{"role": "user", "content": "Name three colours."}])["prompt_token_ids"]
    decode = SamplingParams(temperature=0.0, max_tokens=8, logprobs=2)
    first = run_all(engine, [{"prompt_token_ids": prompt}], decode)[0]
    output = first.outputs[0]
    scored = run_all(engine, [{"prompt_token_ids": prompt + output.token_ids}], _params(prompt_logprobs=2), "again")[0]
    for got, decoded in zip(scored.prompt_logprobs[len(prompt) :], output.logprobs):
        assert got.keys() == decoded.keys()
        assert list(got.values()) == pytest.approx([decoded[t] for t in got], abs=1e-4)
    assert_pool_clean(engine)
