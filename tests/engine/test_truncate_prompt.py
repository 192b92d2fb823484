"""``SamplingParams.truncate_prompt_tokens`` (vLLM's): a prompt keeps its last ``k`` tokens, so one
longer than the context is served from its end. Outputs equal transformers' greedy run on the kept
tokens, through the engine and ``LLM``; a cut into a multimodal item is refused naming it."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM
from utils_engine import assert_pool_clean, hf_greedy, make_engine, run_all

from omnistage.entrypoints.llm import LLM
from omnistage.sampling_params import SamplingParams

ARCH = "llama"
CONTEXT = 32
LONG = [(7 * i) % 90 + 3 for i in range(50)]  # longer than the context


def _params(**kw) -> SamplingParams:
    return SamplingParams(**{"temperature": 0.0, "max_tokens": 1, "ignore_eos": True, **kw})


def test_a_prompt_keeps_its_last_tokens_as_transformers_would_read_them(tiny_loaded, tiny_paths):
    hf = AutoModelForCausalLM.from_pretrained(tiny_paths[ARCH], dtype=torch.float32).eval()
    engine = make_engine(tiny_loaded(ARCH), block_size=4, max_model_len=CONTEXT, max_num_batched_tokens=8)
    with pytest.raises(ValueError, match=r"request 'whole': the prompt has 50 tokens; the context holds 32"):
        engine.add_request("whole", LONG, _params())
    short = LONG[:10]
    outs = run_all(engine, [LONG, LONG, short], [
        _params(truncate_prompt_tokens=20, max_tokens=4),
        _params(truncate_prompt_tokens=-1),  # what the context holds with room for one token: 31
        _params(truncate_prompt_tokens=20, max_tokens=4),  # shorter already: unchanged
    ])  # fmt: skip
    kept = [LONG[-20:], LONG[-(CONTEXT - 1):], short]
    assert [o.prompt_token_ids for o in outs] == kept
    for out, ids in zip(outs, kept):
        assert out.outputs[0].token_ids == hf_greedy(hf, ids, len(out.outputs[0].token_ids))
    with pytest.raises(ValueError, match=r"SamplingParams\.truncate_prompt_tokens must be None, -1 .* got 0"):
        _params(truncate_prompt_tokens=0)
    assert_pool_clean(engine)
    llm = LLM(model=str(tiny_paths[ARCH]), max_model_len=CONTEXT)
    via_llm = llm.generate([{"prompt_token_ids": LONG}], _params(truncate_prompt_tokens=20, max_tokens=4))[0]
    assert via_llm.prompt_token_ids == kept[0] and via_llm.outputs[0].token_ids == outs[0].outputs[0].token_ids


def test_an_image_prompt_is_cut_only_before_its_items(tmp_path):
    """Qwen2.5-VL: a cut in the text before the image serves the rest (the image's offset moves,
    its rows and M-RoPE positions as transformers computes them on the kept ids); a cut inside the
    image is refused naming it, and the engine keeps serving."""
    from transformers import Qwen2_5_VLForConditionalGeneration
    from utils_mm import chat_prompt, hf_greedy_mm, image, write_sensitive_checkpoint

    from omnistage.models.loader import load_model
    from omnistage.multimodal.processing import MultiModalProcessor, ProcessedPrompt

    path = write_sensitive_checkpoint("vl", tmp_path / "vl")
    proc = MultiModalProcessor.from_pretrained(path)
    hf = Qwen2_5_VLForConditionalGeneration.from_pretrained(path).eval()
    prompt = chat_prompt(proc, ["text", "image", "text"], {"image": image(3)})
    full = proc.process(prompt)
    start = full.mm_features[0].mm_position.offset
    engine = make_engine(load_model(path), block_size=4, max_num_batched_tokens=8)
    inside = len(full.prompt_token_ids) - (start + 2)
    with pytest.raises(ValueError, match=rf"truncate_prompt_tokens={inside} .* cuts image item 0 \(prompt positions"):
        engine.add_request("inside", prompt, _params(truncate_prompt_tokens=inside))
    keep = len(full.prompt_token_ids) - (start - 3)  # three tokens before the image's start marker
    out = run_all(engine, [prompt], _params(truncate_prompt_tokens=keep, max_tokens=4))[0]
    kept = full.prompt_token_ids[-keep:]
    assert out.prompt_token_ids == kept
    assert out.outputs[0].token_ids == hf_greedy_mm(hf, ProcessedPrompt(kept, full.mm_features), 4)
    assert_pool_clean(engine)
