"""Penalties and suppressed tokens end to end: greedy output equal to transformers'
``generate(repetition_penalty=..., suppress_tokens=...)`` and to a reference loop
for vLLM's presence / frequency penalties, in a mixed batch that preempts."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from transformers import AutoModelForCausalLM
from utils_engine import PROMPTS, assert_pool_clean, hf_greedy, make_engine, run_all

from omnistage.sampling_params import SamplingParams

ARCH = "llama"
MAX_TOKENS = 16
PROMPTS6 = PROMPTS[:3] + ["images, audio and video go in", "one two three four five", "paris"]


@pytest.fixture(scope="module")
def hf(tiny_paths):
    return AutoModelForCausalLM.from_pretrained(tiny_paths[ARCH], dtype=torch.float32).eval()


def _reference_loop(hf, prompt_ids: list[int], p: SamplingParams) -> list[int]:
    """Greedy with vLLM's presence / frequency penalties over the output, one full forward per token."""
    ids, output = list(prompt_ids), []
    for _ in range(MAX_TOKENS):
        with torch.no_grad():
            logits = hf(torch.tensor([ids])).logits[0, -1].float()
        for token, count in Counter(output).items():
            logits[token] -= p.frequency_penalty * count + p.presence_penalty
        output.append(int(logits.argmax()))
        ids.append(output[-1])
    return output


def _params(**kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, **kw)


def test_penalties_match_references_in_a_mixed_batch_that_preempts(tiny_loaded, hf, hf_reference):
    loaded = tiny_loaded(ARCH)
    params = [
        _params(repetition_penalty=1.3),
        _params(presence_penalty=1.5, frequency_penalty=0.5),
        _params(),
        _params(repetition_penalty=0.8, suppress_token_ids=[3, 17, 40]),
        _params(frequency_penalty=-1.0),  # negative: repeats are favoured
        _params(suppress_token_ids=[5]),
    ]
    # 20 blocks of 4 hold ~2.5 of the six requests: they preempt and resume with their output.
    engine = make_engine(loaded, block_size=4, num_kv_blocks=20)
    outs = [o.outputs[0].token_ids for o in run_all(engine, PROMPTS6, params)]
    assert engine.get_stats().num_preemptions > 0
    prompt_ids = [loaded.tokenizer.encode(p) for p in PROMPTS6]
    for i, (ids, p) in enumerate(zip(prompt_ids, params)):
        if p.presence_penalty or p.frequency_penalty:
            expected = _reference_loop(hf, ids, p)
        else:
            expected = hf_greedy(
                hf, ids, MAX_TOKENS, repetition_penalty=p.repetition_penalty, suppress_tokens=p.suppress_token_ids or None
            )
        assert outs[i] == expected, i
    plain = [hf_reference(ARCH, ids, MAX_TOKENS) for ids in prompt_ids]
    assert outs[2] == plain[2]
    # Each rule changed the output (so the comparisons above are not vacuous).
    assert [i for i in (0, 1, 3, 4) if outs[i] == plain[i]] == []
    assert_pool_clean(engine)


def test_logit_bias_matches_transformers_sequence_bias(tiny_loaded, hf, hf_reference):
    """logit_bias adds to the raw logits before the penalties, as transformers' ``sequence_bias`` of
    one-token sequences does (and vLLM): greedy outputs equal, alone and beside a penalty."""
    loaded = tiny_loaded(ARCH)
    prompt_ids = [loaded.tokenizer.encode(p) for p in PROMPTS6[:3]]
    plain = [hf_reference(ARCH, ids, MAX_TOKENS) for ids in prompt_ids]
    biases = [
        {plain[0][0]: -3.0, 7: 1.5},  # demotes the plain first token: the output must change
        {plain[1][2]: -2.5, 11: 2.0, 40: -1.0},
        {plain[2][0]: -4.0},
    ]
    params = [
        _params(logit_bias=biases[0]),
        _params(logit_bias=biases[1], repetition_penalty=1.3),
        _params(logit_bias=biases[2], suppress_token_ids=[3]),
    ]
    outs = [o.outputs[0].token_ids for o in run_all(make_engine(loaded), PROMPTS6[:3], params)]
    for i, (ids, p) in enumerate(zip(prompt_ids, params)):
        expected = hf_greedy(
            hf, ids, MAX_TOKENS, sequence_bias={(t,): b for t, b in p.logit_bias.items()},
            repetition_penalty=p.repetition_penalty, suppress_tokens=p.suppress_token_ids or None,
        )  # fmt: skip
        assert outs[i] == expected, i
        assert outs[i] != plain[i], i  # the bias mattered
