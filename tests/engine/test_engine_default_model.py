"""The embedded default (SmolLM2-135M-Instruct): greedy equals transformers, briefly."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM
from utils_engine import assert_pool_clean, hf_greedy, run_all

from omnistage.entrypoints.llm import LLM
from omnistage.kernels.native import native_kernels
from omnistage.sampling_params import SamplingParams

pytestmark = pytest.mark.slow
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def llm():
    return LLM(block_size=16, max_model_len=512)


def test_default_model_greedy_matches_hf(llm):
    engine = llm.llm_engine
    hf = AutoModelForCausalLM.from_pretrained(engine.loaded_model.model_path, dtype=torch.float32).eval()
    conversations = [
        [{"role": "user", "content": "What is the capital of France?"}],
        [{"role": "user", "content": "Write a haiku about the sea."}],
        [{"role": "user", "content": "List three primary colors."}],
    ]
    prompts = [engine.encode_chat(c) for c in conversations]
    refs = [hf_greedy(hf, p["prompt_token_ids"], NEW_TOKENS) for p in prompts]
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = run_all(engine, prompts, params)  # one batch, different lengths
    assert [o.outputs[0].token_ids for o in outs] == refs
    assert "Paris" in outs[0].outputs[0].text
    assert_pool_clean(engine)


def test_default_model_chat_second_turn_hits_prefix_cache(llm):
    params = SamplingParams(temperature=0.0, max_tokens=8)
    turn1 = [{"role": "user", "content": "Name a fruit."}]
    (first,) = llm.chat(turn1, params, use_tqdm=False)
    turn2 = turn1 + [
        {"role": "assistant", "content": first.outputs[0].text},
        {"role": "user", "content": "And a vegetable?"},
    ]
    (second,) = llm.chat(turn2, params, use_tqdm=False)
    assert first.outputs[0].text and second.outputs[0].text
    # The first turn's prompt (full blocks of it) is served from the cache.
    assert second.num_cached_tokens >= (len(first.prompt_token_ids) // 16) * 16 > 0


def test_default_model_greedy_rows_take_the_screened_argmax(llm):
    model = llm.llm_engine.runner.model
    lib = native_kernels()
    if lib is None or not lib.group_int8_argmax_available():
        pytest.skip("the screened argmax needs AVX-512 VNNI")
    assert model._lean.argmax_norms is not None  # the Q8_0 tied embedding is the LM head
    # Hidden states of the size and spread the final norm gives, with a few outlier channels.
    hidden = torch.randn(12, model._lean.lm_head.int8.in_features, generator=torch.Generator().manual_seed(0))
    hidden[:, :3] *= 20
    alone = [int(model.compute_logits(hidden[r : r + 1]).argmax()) for r in range(12)]
    assert model.greedy_token_ids(hidden).tolist() == alone
