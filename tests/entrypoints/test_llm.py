"""The offline API: LLM.generate / LLM.chat on a tiny checkpoint."""

from __future__ import annotations

import base64

import pytest
import torch

import omnistage
from omnistage import LLM, RequestOutput, SamplingParams
from omnistage.testing.tiny_checkpoints import write_tiny_checkpoint


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny model: threads only add barrier waits on a busy machine
    path = write_tiny_checkpoint("qwen2", tmp_path_factory.mktemp("ckpt") / "qwen2")
    yield LLM(str(path), block_size=4, max_num_batched_tokens=32)
    torch.set_num_threads(threads)


GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def test_exports():
    assert omnistage.LLM is LLM and omnistage.SamplingParams is SamplingParams
    assert omnistage.RequestOutput is RequestOutput


def test_generate_accepts_every_prompt_form(llm):
    tok = llm.get_tokenizer()
    (single,) = llm.generate("hello world!", GREEDY, use_tqdm=False)
    ids = tok.encode("hello world!")
    forms = ["hello world!", {"prompt": "hello world!"}, {"prompt_token_ids": ids}, ids]
    for form in forms:
        (out,) = llm.generate(form, GREEDY, use_tqdm=False)
        assert out.outputs[0].token_ids == single.outputs[0].token_ids
    outs = llm.generate([{"prompt_token_ids": ids}, {"prompt_token_ids": ids}], GREEDY, use_tqdm=False)
    assert len(outs) == 2 and outs[0].outputs[0].token_ids == single.outputs[0].token_ids


def test_generate_keeps_input_order(llm):
    prompts = ["one two three four five six seven", "hi", "the quick brown fox", "paris"]
    # Different max_tokens: requests finish out of order.
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (9, 2, 5, 1)]
    outs = llm.generate(prompts, params)
    assert [o.prompt for o in outs] == prompts
    assert [len(o.outputs[0].token_ids) for o in outs] == [9, 2, 5, 1]
    assert all(o.finished for o in outs)
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate(prompts, params[:2])


def test_bad_prompt_in_a_batch_leaves_engine_clean(llm):
    with pytest.raises(ValueError, match="empty"):
        llm.generate(["fine", ""], GREEDY, use_tqdm=False)
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests()
    (out,) = llm.generate("fine", GREEDY, use_tqdm=False)
    assert len(out.outputs[0].token_ids) == GREEDY.max_tokens


def test_chat_single_and_batch(llm):
    conv = [{"role": "system", "content": "you are a helpful assistant."}, {"role": "user", "content": "hello"}]
    (out,) = llm.chat(conv, GREEDY, use_tqdm=False)
    tok = llm.get_tokenizer()
    rendered = tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
    assert out.prompt == rendered
    assert out.prompt_token_ids == tok.encode(rendered, add_special_tokens=False)
    outs = llm.chat([conv, conv[1:]], GREEDY, use_tqdm=False)
    assert outs[0].outputs[0].token_ids == out.outputs[0].token_ids
    assert outs[1].prompt.startswith("<|im_start|>user")


def test_get_stats_reports_prefix_hits(llm):
    prompt = "a small model reads a short prompt and writes a short answer."
    llm.generate(prompt, GREEDY, use_tqdm=False)
    before = llm.get_stats().prefix_cache_hit_tokens
    (out,) = llm.generate(prompt, GREEDY, use_tqdm=False)
    stats = llm.get_stats()
    assert out.num_cached_tokens > 0
    assert stats.prefix_cache_hit_tokens == before + out.num_cached_tokens
    assert stats.kv_blocks_used == 0 and stats.num_generated_tokens > 0


def test_chat_media_on_a_text_model_is_refused_for_its_modality_first(llm):
    """Issue 12: what the model takes is checked before a media part is read,
    so audio to a text model says so, whatever its bytes or format (never
    "not a WAV" or "send WAV"), naming the part; nothing is queued."""
    garbage = base64.b64encode(b"OggS....").decode()
    parts = {
        "audio": [
            {"type": "input_audio", "input_audio": {"data": garbage, "format": "wav"}},
            {"type": "input_audio", "input_audio": {"data": garbage, "format": "mp3"}},
            {"type": "audio", "audio": "/no/such/file.wav"},
        ],
        "image": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,!!!!"}}],
    }
    engine = llm.llm_engine
    steps = engine.num_steps
    for modality, cases in parts.items():
        for part in cases:
            msgs = [{"role": "user", "content": [{"type": "text", "text": "hi"}, part]}]
            with pytest.raises(ValueError, match=rf"^messages\[0\]\.content\[1\]: this model does not take {modality} input"):
                llm.chat(msgs, GREEDY, use_tqdm=False)
    assert not engine.has_unfinished_requests() and engine.num_steps == steps
