"""The embedded SmolLM2-135M-Instruct: converted once, loads, matches HF.

The first run converts the GGUF (about half a minute on 2 cores) into
``$OMNISTAGE_CACHE_DIR`` or ``~/.cache/omnistage``; later runs reuse it.
"""

from __future__ import annotations

import time

import pytest
import torch
from transformers import AutoModelForCausalLM

from omnistage.models.default_model import DEFAULT_MODEL_NAME, default_model_path
from omnistage.models.gguf_convert import MARKER
from omnistage.models.loader import load_model
from omnistage.sampling_params import SamplingParams
from omnistage.attention.paged_attention import DECODE, PREFILL_SINGLE, allocate_kv_caches, build_attention_metadata
from omnistage.worker.input_batch import InputBatch

pytestmark = pytest.mark.slow

BLOCK = 16


@pytest.fixture(scope="module")
def default_path():
    return default_model_path()


def test_conversion_is_cached(default_path):
    assert (default_path / MARKER).is_file()
    for name in ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json"):
        assert (default_path / name).is_file(), name
    start = time.perf_counter()
    assert default_model_path() == default_path
    assert time.perf_counter() - start < 1.0


def test_default_model_matches_hf(default_path):
    loaded = load_model(None)
    assert loaded.name == DEFAULT_MODEL_NAME
    assert loaded.model_path == str(default_path)
    assert 2 in loaded.eos_token_ids and loaded.max_model_len == 8192
    tok, lm = loaded.tokenizer, loaded.model
    assert (lm.num_layers, lm.num_kv_heads, lm.head_dim) == (30, 3, 64)

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
    assert "What is the capital of France?<|im_end|>" in text
    prompt = tok(text)["input_ids"]

    ref = AutoModelForCausalLM.from_pretrained(default_path, dtype=torch.float32, attn_implementation="sdpa").eval()
    caches = allocate_kv_caches(lm.num_layers, 8, BLOCK, lm.num_kv_heads, lm.head_dim, lm.dtype, lm.device)
    batch = InputBatch(max_num_reqs=1, max_model_len=8 * BLOCK, block_size=BLOCK)
    batch.add_request("r", prompt, len(prompt), 0, [5, 2, 7, 0], SamplingParams())
    tokens, sched, kinds, got = list(prompt), len(prompt), [], []
    for _ in range(7):  # prefill, then decode up to "The capital of France is Paris"
        step = batch.prepare_step({"r": sched})
        md = build_attention_metadata(step, BLOCK)
        kinds.append(md.kind)
        hidden = lm.forward(step.input_ids, step.positions, md, caches)
        got.append(lm.compute_logits(hidden[step.logits_indices])[0])
        batch.update_request("r", [], int(step.seq_lens[0]))
        batch.append_token("r", int(got[-1].argmax()))
        tokens.append(int(got[-1].argmax()))
        sched = 1
    assert kinds == [PREFILL_SINGLE] + [DECODE] * 6
    # One HF forward over the whole greedy sequence gives the reference for every step.
    with torch.no_grad():
        want = ref(torch.tensor([tokens[:-1]])).logits[0, len(prompt) - 1 :].float()
    torch.testing.assert_close(torch.stack(got), want, atol=2e-4, rtol=1e-4)
    assert "Paris" in tok.decode(tokens[len(prompt):])
