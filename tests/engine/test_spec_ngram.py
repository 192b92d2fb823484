"""Speculative decoding with prompt lookup (``speculative_config={"method": "ngram", ...}``).

Greedy outputs with speculation equal those without it and transformers',
token for token; drafts are accepted where the model repeats itself; stop
rules cut inside an accepted run; prefix caching and preemption see only
verified tokens; the rejection sampler keeps the target's distribution.

Two kinds of tiny checkpoints: the plain random ones (they rarely repeat, so
almost every draft is rejected and rolled back) and "copying" ones whose
attention output is scaled down (``o_proj`` times a factor), so the next
token depends mostly on the current one and greedy decoding falls into
cycles that prompt lookup predicts. Factor 0 is a pure bigram model (every
draft of a cycle is accepted); 0.01 keeps attention in play.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM
from utils_engine import PROMPTS, assert_pool_clean, hf_greedy, make_engine, run_all

from omnistage.core.spec_decode import SpeculativeConfig, propose_ngram
from omnistage.core.spec_policy import StepCost
from omnistage.engine.arg_utils import EngineArgs
from omnistage.models.loader import load_model
from omnistage.sampling_params import SamplingParams
from omnistage.testing.tiny_checkpoints import write_tiny_checkpoint
from omnistage.worker.rejection_sampler import accept_greedy, accept_random

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
REPEATING = "one two three four one two three four one two three four one two"


pytestmark = pytest.mark.usefixtures("always_draft")  # tests/engine/conftest.py


@pytest.fixture(scope="module")
def copying(tmp_path_factory):
    """(arch, factor) -> (loaded model, HF model) of a tiny checkpoint with scaled attention output."""
    cache: dict = {}

    def get(arch: str, factor: float):
        if (arch, factor) not in cache:
            path = Path(write_tiny_checkpoint(arch, tmp_path_factory.mktemp(f"copy_{arch}_{factor}")))
            for f in path.glob("*.safetensors"):
                sd = load_file(f)
                sd = {k: v * factor if k.endswith("o_proj.weight") else v for k, v in sd.items()}
                save_file(sd, f, metadata={"format": "pt"})
            hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
            cache[arch, factor] = (load_model(str(path)), hf)
        return cache[arch, factor]

    return get


def _token_ids(outs):
    return [o.outputs[0].token_ids for o in outs]


def _assert_held_nothing(engine):
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.held().is_empty
    assert_pool_clean(engine)


# -- configuration -------------------------------------------------------------------


def test_config_from_dict_and_errors_name_the_key():
    cfg = SpeculativeConfig.from_dict(NGRAM)
    assert (cfg.num_speculative_tokens, cfg.prompt_lookup_max, cfg.prompt_lookup_min) == (4, 3, 1)
    with pytest.raises(ValueError, match="'eagle3' is not supported yet"):
        SpeculativeConfig.from_dict({"method": "eagle3", "model": "x", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="unknown method 'bogus'"):
        SpeculativeConfig.from_dict({"method": "bogus", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="unknown key 'lookahead'"):
        SpeculativeConfig.from_dict({**NGRAM, "lookahead": 2})
    with pytest.raises(ValueError, match="'num_speculative_tokens' must be an integer >= 1"):
        SpeculativeConfig.from_dict({**NGRAM, "num_speculative_tokens": 0})
    with pytest.raises(ValueError, match="'prompt_lookup_min'=4 exceeds 'prompt_lookup_max'=3"):
        SpeculativeConfig.from_dict({**NGRAM, "prompt_lookup_min": 4})
    with pytest.raises(ValueError, match="'num_speculative_tokens' is required"):
        SpeculativeConfig.from_dict({"method": "ngram"})
    with pytest.raises(ValueError, match="unknown key 'typo'"):
        EngineArgs(speculative_config={**NGRAM, "typo": 1})
    assert EngineArgs().speculative_config is None  # off by default


def test_llm_takes_speculative_config(copying):
    from omnistage.entrypoints.llm import LLM

    loaded, _ = copying("qwen2", 0.0)
    prompt = _in_cycle(loaded)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    off = LLM(loaded).generate([prompt], params, use_tqdm=False)
    llm = LLM(loaded, speculative_config=NGRAM)
    assert llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids == off[0].outputs[0].token_ids
    assert llm.get_stats().num_accepted_tokens > 0
    with pytest.raises(ValueError, match="'model' .* is required"):
        LLM(loaded, speculative_config={"method": "eagle", "num_speculative_tokens": 2})


def test_cli_flag_takes_json(capsys):
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = parser.parse_args(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}'])
    assert EngineArgs.from_cli_args(args).speculative_config == {"method": "ngram", "num_speculative_tokens": 3}
    assert EngineArgs.from_cli_args(parser.parse_args([])).speculative_config is None
    for bad in ['{"method": ngram}', "[1, 2]"]:
        with pytest.raises(SystemExit):
            parser.parse_args(["--speculative-config", bad])
        assert "--speculative-config" in capsys.readouterr().err
    with pytest.raises(ValueError, match="unknown key 'k'"):
        EngineArgs.from_cli_args(parser.parse_args(["--speculative-config", '{"method": "ngram", "k": 3}']))


# -- the proposer -----------------------------------------------------------------


def test_propose_ngram_longest_then_latest_match():
    """Drafts, and where they start in the history (which tells a copy of the prompt from a
    repeat of the output)."""
    # Suffix [1, 2] occurs at 0 (then 3) and at 4 (then 9): latest wins.
    assert propose_ngram([1, 2, 3, 7, 1, 2, 9, 8, 1, 2], 2, 1, 3) == ([9, 8], 6)
    # The 3-gram [7, 1, 2] beats the later 2-gram match.
    assert propose_ngram([7, 1, 2, 5, 6, 1, 2, 4, 7, 1, 2], 2, 1, 3) == ([5, 6], 3)
    assert propose_ngram([1, 2, 3, 4], 3, 1, 3) == ([], -1)  # nothing repeats
    assert propose_ngram([5, 6, 5], 4, 1, 3) == ([6, 5], 1)  # cut at the end of the history
    assert propose_ngram([5, 6, 5], 4, 2, 3) == ([], -1)  # below prompt_lookup_min
    # Placeholder ids are never proposed: the draft stops before the first one.
    assert propose_ngram([4, 8, 99, 99, 3, 4], 4, 1, 2, banned={99}) == ([8], 1)
    assert propose_ngram([4, 99, 3, 4], 4, 1, 2, banned={99})[0] == []


# -- greedy exactness -----------------------------------------------------------------


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("factor", [0.0, 0.01, 1.0])
def test_greedy_equals_speculation_off_and_hf(arch, factor, copying):
    loaded, hf = copying(arch, factor)
    prompts = [REPEATING, *PROMPTS[:3]]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    refs = [hf_greedy(hf, loaded.tokenizer.encode(p), 24) for p in prompts]
    off = make_engine(loaded)
    on = make_engine(loaded, speculative_config=NGRAM)
    # Mixed batch (prefills beside speculating decodes), then one at a time.
    assert _token_ids(run_all(off, prompts, params)) == refs
    assert _token_ids(run_all(on, prompts, params)) == refs
    for i, p in enumerate(prompts):
        assert _token_ids(run_all(on, [p], params, prefix=f"solo{i}-")) == [refs[i]]
    stats = on.get_stats()
    assert stats.num_draft_tokens > 0
    assert off.get_stats().num_draft_tokens == 0
    if factor < 1.0:
        assert stats.num_accepted_tokens > 0
        assert stats.num_steps < off.get_stats().num_steps * (len(prompts) + 1)  # fewer steps than tokens
    _assert_held_nothing(on)


def test_a_verify_step_takes_every_rows_argmax_in_one_pass(copying):
    """Plain rows and verified runs share one LM-head pass (a row's argmax does not depend
    on the others): a second pass would stream the head's weights again."""
    loaded, _ = copying("llama", 0.0)
    on = make_engine(loaded, speculative_config=NGRAM)
    model, schedule = on.runner.model, on.scheduler.schedule
    passes: list[int] = []  # rows of each greedy pass of the current step
    steps: list[tuple[list[int], int]] = []  # each verify step's passes, and the rows its runs verify
    greedy = model.greedy_token_ids
    model.greedy_token_ids = lambda rows: passes.append(rows.shape[0]) or greedy(rows)
    scheduled = {}

    def schedule_and_record():
        passes.clear()
        scheduled["out"] = schedule()
        return scheduled["out"]

    on.scheduler.schedule = schedule_and_record

    def step():
        on.step()
        verified = sum(len(d) + 1 for d in scheduled["out"].scheduled_spec_decode_tokens.values())
        if verified:
            steps.append((list(passes), verified))

    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    for i, prompt in enumerate([REPEATING, *PROMPTS[:3]]):  # each arrives while the others decode
        on.add_request(f"r{i}", prompt, params)
        step()
    while on.has_unfinished_requests():
        step()
    assert steps and all(len(p) == 1 for p, _ in steps), steps
    assert any(p[0] > verified for p, verified in steps), steps  # plain rows joined a verify step's pass
    _assert_held_nothing(on)


def _in_cycle(loaded) -> dict:
    """A prompt whose greedy continuation under the bigram model is already in
    its cycle, so prompt lookup drafts right from the first decode."""
    ids = loaded.tokenizer.encode(REPEATING)
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    warmup = _token_ids(run_all(make_engine(loaded), [{"prompt_token_ids": ids}], params))[0]
    return {"prompt_token_ids": ids + warmup}


@pytest.mark.parametrize("max_tokens", [2, 5, 6, 7, 9, 13])
def test_max_tokens_and_stop_ids_inside_an_accepted_run(max_tokens, copying):
    loaded, _ = copying("llama", 0.0)
    prompt = _in_cycle(loaded)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    off = _token_ids(run_all(make_engine(loaded), [prompt], params))
    on_engine = make_engine(loaded, speculative_config={**NGRAM, "num_speculative_tokens": 6})
    outs = run_all(on_engine, [prompt], params)
    assert _token_ids(outs) == off and len(off[0]) == max_tokens
    assert outs[0].outputs[0].finish_reason == "length"
    stats, metrics = on_engine.get_stats(), outs[0].metrics
    assert (metrics.num_draft_tokens, metrics.num_accepted_tokens) == (stats.num_draft_tokens, stats.num_accepted_tokens)
    if max_tokens > 2:
        assert stats.num_accepted_tokens > 0 and metrics.draft_acceptance_rate > 0
    # A stop id met inside an accepted run: nothing after it is emitted.
    long_params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    long = _token_ids(run_all(make_engine(loaded), [prompt], long_params))[0]
    stop = long[max_tokens - 1]
    first = long.index(stop)
    stopped = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, stop_token_ids=[stop])
    out = run_all(on_engine, [prompt], stopped, prefix="stop-")[0].outputs[0]
    assert out.token_ids == long[: first + 1] and out.finish_reason == "stop" and out.stop_reason == stop
    # Generated tokens count what requests output, not what verified runs emitted past a stop or a limit.
    assert on_engine.get_stats().num_generated_tokens == max_tokens + len(out.token_ids)
    _assert_held_nothing(on_engine)


def test_stop_string_inside_an_accepted_run(copying):
    loaded, _ = copying("qwen2", 0.0)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    prompt = _in_cycle(loaded)
    full = run_all(make_engine(loaded), [prompt], params)[0].outputs[0]
    tok = loaded.tokenizer
    # A stop string that ends inside the 8th token's text.
    text8 = tok.decode(full.token_ids[:8], skip_special_tokens=True)
    if len(text8.strip()) < 2:
        pytest.skip("the tiny tokenizer decodes these ids to no text")
    stop = text8[-2:]
    stop_params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, stop=[stop])
    ref = run_all(make_engine(loaded), [prompt], stop_params)[0].outputs[0]
    engine = make_engine(loaded, speculative_config=NGRAM)
    out = run_all(engine, [prompt], stop_params)[0].outputs[0]
    assert (out.text, out.token_ids, out.finish_reason) == (ref.text, ref.token_ids, ref.finish_reason)
    assert out.finish_reason == "stop" and len(out.token_ids) <= 8
    stats = engine.get_stats()
    assert stats.num_accepted_tokens > 0
    # Verified tokens past the stop string are never reported, nor counted as generated.
    assert stats.num_generated_tokens == len(out.token_ids)
    _assert_held_nothing(engine)


@pytest.mark.parametrize("factor, max_tokens", [(0.0, 20), (1.0, 20), (0.0, 9), (0.0, 14)])
def test_prefix_cache_second_turn_hits_the_same(factor, max_tokens, copying, always_draft):
    """Only verified tokens' blocks are cached: a second turn that extends the
    first hits as much with speculation as without, and outputs agree (with
    the full model, rejected drafts' KV would show in the hit's outputs). The
    block a request's last verified run completes is cached before it ends
    (at 9 and 14 tokens, such a block)."""
    loaded, hf = copying("llama", factor)
    prompt = _in_cycle(loaded)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    results = []
    for spec in (None, NGRAM):
        engine = make_engine(loaded, block_size=4, speculative_config=spec)
        (first,) = run_all(engine, [prompt], params, prefix="t1-")
        turn2 = {"prompt_token_ids": list(first.prompt_token_ids) + first.outputs[0].token_ids + [5, 6, 7]}
        (second,) = run_all(engine, [turn2], params, prefix="t2-")
        stats = engine.get_stats()
        results.append((_token_ids([first, second]), stats.prefix_cache_hit_tokens, second.num_cached_tokens))
        if spec is not None:
            assert stats.num_draft_tokens > 0
            assert stats.num_accepted_tokens > 0 or factor == 1.0
        _assert_held_nothing(engine)
    assert results[0] == results[1]
    assert results[1][1] > 0
    ids = turn2["prompt_token_ids"]
    assert results[1][0][1] == hf_greedy(hf, ids, max_tokens)


@pytest.mark.parametrize("factor", [0.0, 1.0])
def test_preemption_under_a_small_pool(factor, copying):
    loaded, _ = copying("llama", factor)
    prompts = [REPEATING, *PROMPTS[:3], "one two three four five", "paris paris paris paris"]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    refs = _token_ids(run_all(make_engine(loaded, block_size=4), prompts, params))
    engine = make_engine(loaded, block_size=4, num_kv_blocks=20, speculative_config=NGRAM)
    assert _token_ids(run_all(engine, prompts, params)) == refs
    stats = engine.get_stats()
    assert stats.num_preemptions > 0 and stats.num_draft_tokens > 0
    _assert_held_nothing(engine)


def test_small_budget_and_context_length_cap_drafts(copying):
    """A budget of 3 leaves room for 2 drafts; the context length for fewer at the end."""
    loaded, hf = copying("qwen3", 0.0)
    prompt = _in_cycle(loaded)
    ids = prompt["prompt_token_ids"]
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    engine = make_engine(
        loaded, max_num_batched_tokens=3, max_model_len=len(ids) + 10, speculative_config=NGRAM
    )
    (out,) = run_all(engine, [prompt], params)
    assert out.outputs[0].token_ids == hf_greedy(hf, ids, 10)
    assert out.outputs[0].finish_reason == "length"
    assert engine.get_stats().num_accepted_tokens > 0
    _assert_held_nothing(engine)


# fp32 rounding: a verify forward's multi-row matmuls and attention sum in another order than a
# one-row decode step's, and the difference grows with the logits' size. Over 3,000 random
# examples of the property test (test_properties_spec.py, HYPOTHESIS_PROFILE=long) logprobs
# differed by up to 1.1e-5, at most 4.4e-6 of the logprob's size; the worst case found so far,
# 1.4e-5 at -2.19, is 6.4e-6 of it. The bound is three times that.
LOGPROB_RTOL = 2e-5


def _close(got: float, want: float) -> bool:
    return abs(got - want) <= _tolerance(want)


def _tolerance(logprob: float) -> float:
    return LOGPROB_RTOL * max(1.0, abs(logprob))


def assert_same_logprobs(on, off) -> None:
    """Same tokens; per token the same ids (the sampled one, then the top-N, in order)
    with values within fp32 rounding (``LOGPROB_RTOL``); one entry per token."""
    assert _token_ids(on) == _token_ids(off)
    for a, b in zip(on, off):
        la, lb = a.outputs[0].logprobs, b.outputs[0].logprobs
        if lb is None:
            assert la is None
            continue
        assert len(la) == len(lb) == len(b.outputs[0].token_ids)
        for da, db in zip(la, lb):
            assert list(da) == list(db)
            assert all(_close(da[t], db[t]) for t in db), (da, db)
        # The sum of the sampled tokens' values, within the sum of their bounds.
        within = sum(_tolerance(entry[t]) for entry, t in zip(lb, b.outputs[0].token_ids))
        assert a.outputs[0].cumulative_logprob == pytest.approx(b.outputs[0].cumulative_logprob, abs=within)


def test_logprobs_with_drafts_equal_speculation_off(copying, always_draft):
    """Requests with logprobs speculate too: one entry per emitted token, from the
    logits at its position, as speculation off reports them; a stop inside an
    accepted run keeps the entries of the tokens before it only."""
    loaded, _ = copying("llama", 0.0)
    prompt = _in_cycle(loaded)
    params = [
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=0),
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),  # beside ones that ask
        SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True, logprobs=1),  # length inside a run
    ]
    prompts = [prompt, REPEATING, prompt, prompt]
    off_engine = make_engine(loaded)
    off = run_all(off_engine, prompts, params)
    engine = make_engine(loaded, speculative_config=NGRAM)
    on = run_all(engine, prompts, params)
    assert_same_logprobs(on, off)
    assert all(o.metrics.num_accepted_tokens > 0 for o in on[:2])
    # A sampled request draws other tokens with speculation (the same distribution):
    # its entry for token j equals a plain decode's after the tokens before j.
    sampled = SamplingParams(temperature=0.2, max_tokens=16, ignore_eos=True, seed=5, logprobs=3)
    (out,) = run_all(engine, [prompt], sampled, prefix="sampled-")
    toks, entries = out.outputs[0].token_ids, out.outputs[0].logprobs
    assert len(entries) == len(toks) and out.metrics.num_accepted_tokens > 0
    ids = prompt["prompt_token_ids"]
    probes = [{"prompt_token_ids": ids + toks[:j]} for j in range(len(toks))]
    probe = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, logprobs=3)
    for j, ref in enumerate(run_all(off_engine, probes, probe, prefix="probe-")):
        (want,) = ref.outputs[0].logprobs
        got = entries[j]
        assert next(iter(got)) == toks[j]
        top = [t for t in want if t != ref.outputs[0].token_ids[0]][:2]  # past the greedy token
        assert all(_close(got[t], want[t]) for t in top)
        assert toks[j] not in want or _close(got[toks[j]], want[toks[j]])
    _assert_held_nothing(engine)


@pytest.mark.slow
def test_embedded_default_verifies_up_to_16_tokens_as_decoding_them_bit_for_bit():
    """On the embedded default (GGUF weights, the group-int8 matmul) a step of up to 16
    tokens computes each one as a step of one would: two copying requests with 7 drafts
    each, verified at full length, report the logprobs each gets decoded alone, exactly."""
    loaded = load_model(None)
    off = make_engine(loaded, block_size=16, max_model_len=512)
    texts = [
        "Repeat this sentence exactly: the quick brown fox jumps over the lazy dog by the river bank.",
        "Copy this list: apples, pears, plums, cherries, grapes, lemons, limes, oranges, figs.",
    ]
    prompts = [off.encode_chat([{"role": "user", "content": t}]) for t in texts]
    params = SamplingParams(temperature=0.0, max_tokens=32, logprobs=2)
    alone = [run_all(off, [p], params, prefix=f"alone{i}-")[0] for i, p in enumerate(prompts)]
    k7 = {**NGRAM, "num_speculative_tokens": 7}  # two rows of 1 + 7 tokens: 16
    on = make_engine(loaded, block_size=16, max_model_len=512, speculative_config=k7)
    together = run_all(on, prompts, params)
    assert _token_ids(together) == _token_ids(alone)
    assert [o.outputs[0].logprobs for o in together] == [o.outputs[0].logprobs for o in alone]
    assert all(o.metrics.num_accepted_tokens > 0 for o in together)
    _assert_held_nothing(on)


@pytest.mark.parametrize("factor", [0.0, 0.01])
def test_penalties_and_min_tokens_verify_exactly(factor, copying):
    """Each draft position's penalties count the drafts before it, and min_tokens
    holds stop ids back per position: outputs equal speculation off (and
    transformers' processors for the repetition penalty), with drafts accepted."""
    loaded, hf = copying("llama", factor)
    prompt = _in_cycle(loaded)
    cycle = _token_ids(run_all(make_engine(loaded), [prompt], SamplingParams(temperature=0.0, max_tokens=8)))[0]
    stop = cycle[2]  # met early in the cycle: min_tokens must hold it back at every position
    params = [
        SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, repetition_penalty=1.5),
        SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, presence_penalty=1.5),
        SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, frequency_penalty=1.0),
        SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, min_tokens=7, stop_token_ids=[stop]),
        SamplingParams(temperature=0.9, max_tokens=16, ignore_eos=True, seed=3, repetition_penalty=1.1, min_tokens=5),
    ]
    prompts = [prompt] * len(params)
    off = _token_ids(run_all(make_engine(loaded), prompts, params))
    engine = make_engine(loaded, speculative_config=NGRAM)
    on = run_all(engine, prompts, params)
    assert _token_ids(on) == off[:4] + [_token_ids(on)[4]]  # greedy rows: identical
    ids = prompt["prompt_token_ids"]
    assert off[0] == hf_greedy(hf, ids, 16, repetition_penalty=1.5)
    # min_tokens mattered: without it the stop id ends the output at its third token.
    assert stop not in on[3].outputs[0].token_ids[:7]
    plain = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, stop_token_ids=[stop])
    assert _token_ids(run_all(engine, [prompt], plain, prefix="plain-")) == [cycle[:3]]
    per_request = [o.metrics.num_accepted_tokens for o in on]
    assert engine.get_stats().num_draft_tokens > 0 and sum(per_request[:4]) > 0
    # One at a time too (the greedy rows), where no other request shares the step.
    for i in range(4):
        assert _token_ids(run_all(engine, [prompt], params[i], prefix=f"solo{i}-")) == [off[i]]
    _assert_held_nothing(engine)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_suppressed_and_allowed_tokens_and_biases_speculate(temperature, copying):
    """Token masks and logit biases do not depend on the position, so such requests
    speculate; greedy ones keep their outputs, no masked token is ever emitted and a
    token biased by +100 is emitted every time."""
    loaded, _ = copying("llama", 0.0)
    prompt = _in_cycle(loaded)
    plain = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    plain_ids = _token_ids(run_all(make_engine(loaded), [prompt], plain))[0]
    cycle = set(plain_ids)
    outside = [t for t in range(20) if t not in cycle][:3]
    params = [
        SamplingParams(temperature=temperature, seed=3, max_tokens=16, ignore_eos=True, suppress_token_ids=outside),
        SamplingParams(temperature=temperature, seed=4, max_tokens=16, ignore_eos=True, allowed_token_ids=sorted(cycle)),
        # Steers the copy off its cycle every few tokens: drafts are proposed, some rejected.
        SamplingParams(temperature=temperature, seed=5, max_tokens=16, ignore_eos=True, logit_bias={min(cycle): -3.0}),
        SamplingParams(temperature=temperature, seed=6, max_tokens=16, ignore_eos=True, logit_bias={outside[0]: 100}),
    ]
    engine = make_engine(loaded, speculative_config=NGRAM)
    on = _token_ids(run_all(engine, [prompt] * 4, params))
    assert not set(on[0]) & set(outside) and set(on[1]) <= cycle and on[3] == [outside[0]] * 16
    if temperature == 0.0:
        assert on == _token_ids(run_all(make_engine(loaded), [prompt] * 4, params)) and on[2] != plain_ids
        assert engine.get_stats().num_accepted_tokens > 0
    assert engine.get_stats().num_draft_tokens > 0
    _assert_held_nothing(engine)


def test_omni_thinker_with_audio_and_a_payload_stage_refused(tmp_path, monkeypatch):
    """A Qwen2.5-Omni thinker serving text speculates (same outputs, audio in);
    so does a thinker whose rows go to a talker; a payload-driven stage is refused."""
    from transformers import Qwen2_5OmniThinkerForConditionalGeneration
    from utils_mm import chat_prompt, clip, hf_greedy_mm, write_sensitive_checkpoint

    from omnistage.models.qwen2_5_omni import THINKER_FOR_TALKER_POLICY
    from omnistage.multimodal.processing import MultiModalProcessor

    path = write_sensitive_checkpoint("omni", tmp_path / "omni")
    loaded = load_model(path)
    proc = MultiModalProcessor.from_pretrained(path)
    prompts = [chat_prompt(proc, ["audio", "text"], {"audio": clip(0, 1.3)}), REPEATING]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    engine = make_engine(loaded, block_size=4, speculative_config=NGRAM)
    assert engine.scheduler.config.speculative_config.banned_token_ids == set(proc.placeholder_ids.values())
    on = _token_ids(run_all(engine, prompts, params))
    assert on == _token_ids(run_all(make_engine(loaded, block_size=4), prompts, params))
    hf = Qwen2_5OmniThinkerForConditionalGeneration.from_pretrained(path).eval()
    assert on[0] == hf_greedy_mm(hf, proc.process(prompts[0]), 10)
    assert engine.get_stats().num_draft_tokens > 0
    _assert_held_nothing(engine)
    # A thinker whose rows go to a talker speculates (only verified rows are handed on:
    # tests/engine/omni/test_omni_spec.py); a stage whose inputs are payloads is refused.
    monkeypatch.setattr(loaded.mm_adapter, "tensor_cache_policy", THINKER_FOR_TALKER_POLICY, raising=False)
    assert make_engine(loaded, speculative_config=NGRAM).runner.tensor_cache is not None
    monkeypatch.setattr(loaded.model, "step_inputs", lambda *args: None, raising=False)
    with pytest.raises(ValueError, match="speculative_config is not supported yet for the 'llm' stage"):
        make_engine(loaded, speculative_config=NGRAM)


# -- sampling -------------------------------------------------------------------------


@pytest.mark.parametrize("factor", [0.0, 1.0])
def test_seeded_sampling_is_reproducible_with_speculation(factor, copying):
    """A seeded request draws once per emitted token, as without speculation, so it emits
    the tokens speculation off emits, whatever its drafts, their allocation (here its
    step prices) or its neighbours."""
    loaded, _ = copying("llama", factor)
    prompts = [REPEATING, PROMPTS[1], REPEATING]
    params = [
        SamplingParams(temperature=0.7, seed=11, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=1.0, top_k=5, seed=12, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
    ]
    off = _token_ids(run_all(make_engine(loaded), prompts, params))
    drafted = []
    for token_cost in (0.05, 0.3):  # cheap drafts, dear drafts: different allocations
        engine = make_engine(loaded, speculative_config=NGRAM)
        engine.scheduler.draft_policy.step_cost = StepCost.linear(token_cost)
        assert _token_ids(run_all(engine, prompts, params)) == off
        drafted.append(engine.get_stats().num_draft_tokens)
        _assert_held_nothing(engine)
    assert drafted[0] > drafted[1] > 0
    alone = make_engine(loaded, speculative_config=NGRAM)
    assert _token_ids(run_all(alone, prompts[:1], params[:1])) == off[:1]


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    keep = expected > 0
    assert counts[~keep].sum() == 0  # a zero-probability token is never emitted
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


# 0.999 quantiles of chi-square with df = 5 and df = 24 degrees of freedom.
_CHI2_999 = {5: 20.52, 24: 51.18}


@pytest.mark.parametrize("draft", [0, 2, 5])
def test_rejection_sampler_keeps_the_target_distribution(draft):
    """With a one-hot draft the emitted first token is distributed as the
    target ``p`` (accepted with p(d), else drawn from p without d), and the
    next one as the next position's ``p`` given an accepted draft."""
    p0 = torch.tensor([0.05, 0.1, 0.4, 0.0, 0.25, 0.2])
    p1 = torch.tensor([0.3, 0.1, 0.1, 0.2, 0.0, 0.3])
    probs = torch.stack([p0 * 3.0, p1])  # unnormalized weights are fine (min-p leaves them so)
    gen = torch.Generator().manual_seed(1234)
    n = 20000
    first = torch.zeros(6)
    pairs = torch.zeros(6, 6)
    for _ in range(n):
        out = accept_random(probs, [draft], gen)
        first[out[0]] += 1
        if len(out) == 2:
            assert out[0] == draft  # a second token only after an accepted draft
            pairs[out[0], out[1]] += 1
    assert _chi_square(first, p0) < _CHI2_999[5]
    if p0[draft] > 0:
        second = pairs[draft]
        assert abs(second.sum() / n - float(p0[draft])) < 0.02
        assert _chi_square(second, p1) < _CHI2_999[5]
    else:
        assert first[draft] == 0


def test_rejection_sampler_two_drafts_joint_distribution():
    p = torch.tensor([[0.5, 0.3, 0.2, 0.0, 0.0], [0.1, 0.6, 0.3, 0.0, 0.0], [0.2, 0.2, 0.2, 0.2, 0.2]])
    gen = torch.Generator().manual_seed(7)
    n = 20000
    joint = torch.zeros(5, 5)
    for _ in range(n):
        out = accept_random(p, [0, 1], gen)
        if out[0] == 0:  # the first draft was accepted, so a second token follows
            joint[out[0], out[1]] += 1
    # P(first = 0) = 0.5; given it, the second token ~ p[1].
    assert abs(joint[0].sum() / n - 0.5) < 0.015
    assert _chi_square(joint[0], p[1]) < _CHI2_999[5]


def test_accept_greedy():
    assert accept_greedy([4, 5, 6], [4, 5]) == [4, 5, 6]  # all accepted: bonus token
    assert accept_greedy([4, 9, 6], [4, 5]) == [4, 9]  # first mismatch: the target's token
    assert accept_greedy([3, 5, 6], [4, 5]) == [3]


def test_batched_verifier_draws_from_the_filtered_target():
    """Through ``RejectionSampler`` (temperature and top-k applied as the plain
    sampler does), a rejected-or-accepted draft leaves the emitted token
    distributed as the filtered target; a greedy neighbour takes the argmax."""
    from omnistage.worker.rejection_sampler import RejectionSampler
    from omnistage.worker.sampler import SamplingMetadata

    torch.manual_seed(0)
    logits = torch.randn(4, 8) * 2
    md = SamplingMetadata(
        temperature=torch.tensor([0.8, 0.8, 0.0, 0.0]),
        greedy=torch.tensor([False, False, True, True]),
        all_greedy=False,
        top_k=torch.tensor([5, 5, 0, 0]),
        top_p=None,
        min_p=None,
    )
    masked = logits[0] / 0.8
    masked[masked < masked.topk(5).values[-1]] = float("-inf")
    target = torch.softmax(masked, dim=-1)
    draft = int(target.argsort()[-2])  # a likely token, neither certain nor impossible
    gen = torch.Generator().manual_seed(99)
    sampler = RejectionSampler()
    counts = torch.zeros(8)
    greedy_draft = int(logits[2].argmax())
    for _ in range(20000):
        random_out, greedy_out = sampler(logits, md, [[draft], [greedy_draft]], gen)
        counts[random_out[0]] += 1
        assert greedy_out == [greedy_draft, int(logits[3].argmax())]
    assert _chi_square(counts, target) < _CHI2_999[5]


# -- multimodal ------------------------------------------------------------------------


def test_vision_language_outputs_equal_and_placeholders_never_proposed(tmp_path):
    """Qwen2.5-VL with an image and a video: the same greedy tokens with and
    without speculation, and transformers'; the placeholder ids are banned
    from drafts (a prompt full of pad runs would otherwise propose them)."""
    from transformers import Qwen2_5_VLForConditionalGeneration
    from utils_mm import chat_prompt, hf_greedy_mm, image, video, write_sensitive_checkpoint

    from omnistage.multimodal.processing import MultiModalProcessor

    path = write_sensitive_checkpoint("vl", tmp_path / "vl")
    loaded = load_model(path)
    proc = MultiModalProcessor.from_pretrained(path)
    hf = Qwen2_5_VLForConditionalGeneration.from_pretrained(path).eval()
    prompts = [
        chat_prompt(proc, ["image", "text", "image"], {"image": [image(0), image(0)]}),
        chat_prompt(proc, ["video", "text"], {"video": video(0)}),
        REPEATING,
    ]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    engine = make_engine(loaded, block_size=4, speculative_config=NGRAM)
    banned = engine.scheduler.config.speculative_config.banned_token_ids
    assert banned == set(proc.placeholder_ids.values()) and banned
    proposed: list[int] = []
    propose = engine.scheduler._propose

    def spy(request, n):
        drafts = propose(request, n)
        proposed.extend(drafts)
        return drafts

    engine.scheduler._propose = spy
    on = _token_ids(run_all(engine, prompts, params))
    off = _token_ids(run_all(make_engine(loaded, block_size=4), prompts, params))
    assert on == off
    for prompt, tokens in zip(prompts[:2], on):
        assert tokens == hf_greedy_mm(hf, proc.process(prompt), 10)
    assert proposed and not banned & set(proposed)
    # A history that ends like the token before an image's pad run: the pads
    # would be the draft, the engine's config cuts them.
    ids = proc.process(prompts[0]).prompt_token_ids
    first_pad = min(i for i, t in enumerate(ids) if t in banned)
    history = ids + ids[first_pad - 2 : first_pad]
    cfg = engine.scheduler.config.speculative_config
    unbanned, _ = propose_ngram(history, 4, 1, 3)
    assert len(unbanned) == 4 and set(unbanned) <= banned
    assert propose_ngram(history, 4, 1, 3, cfg.banned_token_ids)[0] == []
    _assert_held_nothing(engine)


# -- the scheduler alone -----------------------------------------------------------------


def _spec_scheduler(**kw):
    from omnistage.core.config import SchedulerConfig
    from omnistage.core.scheduler import Scheduler

    args = dict(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64, block_size=4, num_kv_blocks=16)
    args.update(kw)
    return Scheduler(SchedulerConfig(speculative_config=SpeculativeConfig.from_dict(NGRAM), **args))


def test_scheduler_rolls_back_rejected_drafts_and_caches_only_verified_blocks():
    from omnistage.core.request import Request
    from omnistage.core.runner_output import ModelRunnerOutput

    sched = _spec_scheduler()
    prompt = [1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1]  # 11 tokens
    req = Request("r", prompt, SamplingParams(max_tokens=20))
    sched.add_request(req)
    so = sched.schedule()
    assert so.num_scheduled_tokens == {"r": 11} and not so.scheduled_spec_decode_tokens
    sched.update_from_output(so, ModelRunnerOutput(req_ids=["r"], sampled_token_ids={"r": 2}))
    # Decode: last known token 2 follows [..., 1]; lookup of [5, 1, 2] proposes [3, 4, 5, 1].
    so = sched.schedule()
    assert so.scheduled_spec_decode_tokens == {"r": [3, 4, 5, 1]} and so.num_scheduled_tokens == {"r": 5}
    assert req.num_computed_tokens == 16 and len(sched.kv_cache_manager.get_block_ids("r")) == 4
    # Two drafts accepted, then the target's own token 9: 3 tokens emitted.
    out = ModelRunnerOutput(req_ids=["r"], sampled_token_ids={"r": 9}, spec_sampled_token_ids={"r": [3, 4, 9]})
    sched.update_from_output(so, out)
    assert req.output_token_ids == [2, 3, 4, 9]
    assert req.num_computed_tokens == 14  # positions 0..13 verified; the rejected drafts' slots are redone
    assert len(req.block_hashes) == 3  # 15 known tokens: 3 full blocks hashed, all verified
    assert sched.kv_cache_manager._num_cached_blocks["r"] == 3
    assert (sched.num_draft_tokens, sched.num_accepted_tokens) == (4, 2)
    assert (req.num_draft_tokens, req.num_accepted_tokens) == (4, 2)
    # A result that does not start with the drafts is refused, naming the request.
    so = sched.schedule()
    drafts = so.scheduled_spec_decode_tokens.get("r")
    if drafts:
        bad = ModelRunnerOutput(req_ids=["r"], sampled_token_ids={"r": 7}, spec_sampled_token_ids={"r": [99, 7]})
        with pytest.raises(RuntimeError, match="request 'r' verified drafts"):
            sched.update_from_output(so, bad)


def test_scheduler_tells_a_copy_of_the_prompt_from_a_repeat_of_the_reply():
    """The draft policy prices a proposal copying the prompt apart from one repeating the
    request's own output: the scheduler's lookup says which each is."""
    from omnistage.core.request import Request
    from omnistage.core.runner_output import ModelRunnerOutput

    sched = _spec_scheduler()
    copy = Request("c", [1, 2, 3, 4, 5, 1, 2], SamplingParams(max_tokens=20))
    repeat = Request("r", [6, 7, 8], SamplingParams(max_tokens=20))
    sched.add_request(copy)
    sched.add_request(repeat)
    seen = []
    for c, r in ((3, 9), (4, 10), (5, 9), (1, 11)):
        so = sched.schedule()
        drafts = so.scheduled_spec_decode_tokens
        seen.append({q.request_id: (list(q.draft_state.shadow), q.draft_state.from_prompt) for q in (copy, repeat)})
        spec = {rid: [tok] for rid, tok in (("c", c), ("r", r)) if drafts.get(rid)}  # every draft rejected
        out = ModelRunnerOutput(req_ids=["c", "r"], sampled_token_ids={"c": c, "r": r}, spec_sampled_token_ids=spec)
        sched.update_from_output(so, out)
    # After the prefill's token 3, [1, 2, 3] matches the prompt's start: drafts copied from it.
    assert seen[1]["c"] == ([4, 5, 1, 2], True)  # k = 4
    assert seen[1]["r"] == ([], False)  # [6, 7, 8, 9]: nothing repeats
    # [6, 7, 8, 9, 10, 9]: the 9 at position 3 is the reply's own, and so is what follows it.
    assert seen[3]["r"] == ([10, 9], False)
    assert seen[3]["c"][1]  # [..., 3, 4, 5]: the prompt again
@pytest.mark.parametrize(
    "ignore_eos, stop_token_ids, cut",
    [(False, [], 2), (True, [], None), (True, [5], 3), (False, [3], 1)],
)
def test_scheduler_never_drafts_past_a_stop_token(ignore_eos, stop_token_ids, cut):
    from omnistage.core.request import Request
    from omnistage.core.runner_output import ModelRunnerOutput

    sched = _spec_scheduler()
    prompt = [1, 2, 3, 9, 5, 6, 7, 1]  # 9 is EOS: a copy of the prompt would run past it
    params = SamplingParams(max_tokens=20, ignore_eos=ignore_eos, stop_token_ids=stop_token_ids)
    req = Request("r", prompt, params, eos_token_id=9)
    sched.add_request(req)
    so = sched.schedule()
    sched.update_from_output(so, ModelRunnerOutput(req_ids=["r"], sampled_token_ids={"r": 2}))
    # Decode: [1, 2] matches the prompt's start; the lookup proposes [3, 9, 5, 6, 7, 1, 2].
    drafts = sched.schedule().scheduled_spec_decode_tokens["r"]
    lookup = [3, 9, 5, 6, 7, 1, 2]
    if cut is None:  # no stop token among them: as many as the draft policy allows
        assert len(drafts) > 3 and drafts == lookup[: len(drafts)]
    else:  # through the first stop token, none after it
        assert drafts == lookup[:cut]


def test_scheduler_drafts_never_preempt_and_respect_max_tokens():
    from omnistage.core.request import Request
    from omnistage.core.runner_output import ModelRunnerOutput

    # 3 blocks of 4: the prompt (8 tokens) plus a decode fit, drafts past slot 12 do not.
    sched = _spec_scheduler(num_kv_blocks=3)
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]
    req = Request("r", prompt, SamplingParams(max_tokens=4))
    other = Request("o", [7, 8], SamplingParams(max_tokens=1))
    sched.add_request(req)
    sched.add_request(other)
    so = sched.schedule()
    sched.update_from_output(so, ModelRunnerOutput(req_ids=["r", "o"], sampled_token_ids={"r": 3, "o": 5}))
    so = sched.schedule()
    # max_tokens=4 with 1 out: at most 2 drafts (2 accepted + 1 bonus = 3 more tokens).
    assert so.scheduled_spec_decode_tokens == {"r": [1, 2]}
    sched.update_from_output(
        so, ModelRunnerOutput(req_ids=["r"], sampled_token_ids={"r": 3}, spec_sampled_token_ids={"r": [1, 2, 3]})
    )
    assert req.finished and req.output_token_ids == [3, 1, 2, 3]
    assert sched.num_preemptions == 0


def test_scheduler_drops_drafts_rather_than_preempt():
    from omnistage.core.request import Request
    from omnistage.core.runner_output import ModelRunnerOutput

    # Two 7-token prompts fill the 4 blocks of 4; their decodes fit in the blocks
    # they hold, drafts would need a fifth block.
    sched = _spec_scheduler(num_kv_blocks=4)
    a = Request("a", [1, 2, 3, 1, 2, 3, 1], SamplingParams(max_tokens=10))
    b = Request("b", [7, 8, 9, 10, 11, 12, 13], SamplingParams(max_tokens=10))
    sched.add_request(a)
    sched.add_request(b)
    so = sched.schedule()
    sched.update_from_output(so, ModelRunnerOutput(req_ids=["a", "b"], sampled_token_ids={"a": 2, "b": 5}))
    so = sched.schedule()
    assert so.num_scheduled_tokens == {"a": 1, "b": 1} and not so.scheduled_spec_decode_tokens
    assert sched.num_preemptions == 0 and not so.preempted_req_ids


def test_scheduler_drafts_come_after_every_requests_own_token(always_draft):
    """Drafts take only what the step has left once every running request has its token
    and its blocks: one request's drafts never preempt another (the pool has one free
    block, which B's decode needs) nor starve it of the step's budget."""
    from omnistage.core.request import Request
    from omnistage.core.runner_output import ModelRunnerOutput

    def second_step(budget=64, **kw):
        sched = _spec_scheduler(**kw)
        a = Request("a", [1, 2, 3, 1, 2, 3, 1], SamplingParams(max_tokens=10))  # a copy: lookup drafts [3, 1]
        b = Request("b", [7, 8, 9, 10, 11, 12, 13, 14], SamplingParams(max_tokens=10))
        sched.add_request(a)
        sched.add_request(b)
        so = sched.schedule()
        sched.update_from_output(so, ModelRunnerOutput(req_ids=["a", "b"], sampled_token_ids={"a": 2, "b": 15}))
        sched.config = dataclasses.replace(sched.config, max_num_batched_tokens=budget)  # both prefilled
        return sched, sched.schedule()

    sched, so = second_step(num_kv_blocks=5)  # 4 blocks held, 1 free: b's 9th token needs it
    assert so.num_scheduled_tokens == {"a": 1, "b": 1} and not so.scheduled_spec_decode_tokens
    assert not so.preempted_req_ids and sched.num_preemptions == 0
    sched, so = second_step(budget=3)  # a's drafts fit only in what b leaves
    assert so.num_scheduled_tokens == {"a": 2, "b": 1} and so.scheduled_spec_decode_tokens == {"a": [3]}
    sched, so = second_step()  # room for everything: a drafts its whole proposal
    assert so.num_scheduled_tokens == {"a": 1 + len(so.scheduled_spec_decode_tokens["a"]), "b": 1}
    assert so.scheduled_spec_decode_tokens["a"][:2] == [3, 1]
