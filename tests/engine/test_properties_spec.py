"""Property test: speculation never changes a greedy request's output, whatever else is asked.

Three speculating setups: prompt lookup on the "copying" tiny checkpoint
(attention scaled down, so greedy text falls into a cycle that prompt lookup
predicts, yet attention still matters), and an EAGLE head on a bigram target,
one that agrees with the target almost always and a random one that almost
never does. Hypothesis draws a few requests, each either inside the model's
cycle (a cut of a prompt whose continuation is the cycle) or free text over a
few words, each with its own mix of greedy options: length, minimum length,
penalties, logprobs, stop ids and stop strings taken from the cycle's tokens
(so stops land inside accepted runs), suppressed and allowed tokens. It also
draws the engine's limits (block size, a KV pool small enough to preempt, a
token budget that splits prompts, a cap on running requests) and sometimes
aborts a request a few steps in. The same requests then run on a speculating
engine and on one without speculation: every request not aborted must come
out the same (tokens, text, finish and stop reason, logprobs within fp32
rounding), and afterwards neither engine holds a KV block, a request or a
drafter's state. Every proposal is verified in full (``always_draft``).
Profiles: tests/conftest.py.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from test_spec_eagle import targets  # noqa: F401  (a fixture)
from test_spec_ngram import (  # noqa: F401  (copying is a fixture)
    NGRAM,
    _assert_held_nothing,
    _in_cycle,
    _token_ids,
    assert_same_logprobs,
    copying,
)
from utils_engine import make_engine, run_all

from omnistage.core.kv_cache_utils import cdiv
from omnistage.sampling_params import SamplingParams

K = NGRAM["num_speculative_tokens"]
CYCLE = 12  # tokens of the cycle that stops and allowed tokens are drawn from
WORDS = ["one", "two", "three", "the", "cat", "sat", "on", "mat", "def", "return"]

CYCLE_INDEX = st.integers(0, CYCLE - 1)
OPTIONS = {  # what each option is drawn as; indices into the cycle become its tokens in the test
    "min_tokens": st.integers(0, 24),
    "ignore_eos": st.just(True),
    "logprobs": st.integers(0, 3),
    "repetition_penalty": st.sampled_from([0.9, 1.3]),
    "presence_penalty": st.sampled_from([-0.5, 1.0]),
    "frequency_penalty": st.sampled_from([-0.3, 0.8]),
    "stop": st.lists(CYCLE_INDEX, min_size=1, max_size=2),
    "stop_token_ids": st.lists(CYCLE_INDEX, min_size=1, max_size=2),
    "include_stop_str_in_output": st.just(True),
    "suppress_token_ids": st.lists(CYCLE_INDEX, min_size=1, max_size=2),
    "allowed_token_ids": st.lists(CYCLE_INDEX, min_size=2, max_size=CYCLE),
}
REQUEST = st.fixed_dictionaries(
    {
        "prompt": st.integers(0, 8) | st.lists(st.sampled_from(WORDS), min_size=2, max_size=24),
        "max_tokens": st.integers(1, 24),
        "options": st.fixed_dictionaries({}, optional=OPTIONS),
    }
)
ENGINE_LIMITS = st.fixed_dictionaries(
    {},
    optional={
        "block_size": st.sampled_from([4, 8]),
        "num_kv_blocks": st.integers(24, 48),
        "max_num_batched_tokens": st.sampled_from([8, 16]),
        "max_num_seqs": st.integers(1, 3),
        "enable_prefix_caching": st.just(False),
    },
)
ABORT = st.none() | st.tuples(st.integers(0, 4), st.integers(0, 12))  # (request, step)
_CYCLES: dict[int, tuple[dict, list[int]]] = {}  # per model: the in-cycle prompt and the cycle


def _cycle(loaded) -> tuple[dict, list[int]]:
    if id(loaded) not in _CYCLES:
        prompt = _in_cycle(loaded)
        params = SamplingParams(temperature=0.0, max_tokens=CYCLE, ignore_eos=True)
        _CYCLES[id(loaded)] = prompt, _token_ids(run_all(make_engine(loaded), [prompt], params))[0]
    return _CYCLES[id(loaded)]


def _request(loaded, drawn: dict) -> tuple[dict, SamplingParams]:
    prompt, cycle = _cycle(loaded)
    if isinstance(drawn["prompt"], int):  # inside the cycle, cut a few tokens early
        ids = prompt["prompt_token_ids"][: len(prompt["prompt_token_ids"]) - drawn["prompt"]]
    else:
        ids = loaded.tokenizer.encode(" ".join(drawn["prompt"]))
    options = dict(drawn["options"])
    for key in ("stop_token_ids", "suppress_token_ids", "allowed_token_ids"):
        if key in options:
            options[key] = sorted({cycle[i] for i in options[key]})
    if "allowed_token_ids" in options:  # one allowed token that no rule holds back (else refused)
        eos = set(getattr(loaded, "eos_token_ids", None) or ())
        kept = next((t for t in options["allowed_token_ids"] if t not in eos), None)
        if kept is None:
            del options["allowed_token_ids"]
        for key in ("suppress_token_ids", "stop_token_ids"):
            if key in options:
                options[key] = [t for t in options[key] if t != kept]
    if "stop" in options:
        options["stop"] = [loaded.tokenizer.decode([cycle[i]]).strip() or "x" for i in options["stop"]]
    options["min_tokens"] = min(options.get("min_tokens", 0), drawn["max_tokens"])
    return {"prompt_token_ids": ids}, SamplingParams(temperature=0.0, max_tokens=drawn["max_tokens"], **options)


def _run(engine, prompts, params, abort: tuple[int, int] | None) -> dict:
    """Finished outputs by request index; ``abort`` (request, step) aborts that request then."""
    for i, (prompt, sp) in enumerate(zip(prompts, params)):
        engine.add_request(str(i), prompt, sp)
    done, step = {}, 0
    while engine.has_unfinished_requests():
        if abort is not None and step == abort[1] and abort[0] not in done:
            engine.abort_request(str(abort[0]))
        done.update({int(o.request_id): o for o in engine.step() if o.finished})
        step += 1
    _assert_held_nothing(engine)
    return done


@pytest.mark.usefixtures("always_draft")
@pytest.mark.parametrize("method", ["ngram", "eagle-accepting", "eagle-random"])
@settings(
    max_examples=max(settings.default.max_examples // 4, 1),  # ~0.1 s each
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(requests=st.lists(REQUEST, min_size=1, max_size=5), limits=ENGINE_LIMITS, abort=ABORT)
def test_speculation_never_changes_a_greedy_output(copying, targets, method, requests, limits, abort):
    if method == "ngram":
        (loaded, _), spec = copying("llama", 0.01), NGRAM
    else:  # a head that agrees with its bigram target almost always, or a random one that almost never does
        loaded, head, _ = targets("llama", method.split("-")[1])
        spec = {"method": "eagle", "model": head, "num_speculative_tokens": K}
    prompts, params = map(list, zip(*(_request(loaded, r) for r in requests)))
    if abort is not None:
        abort = (abort[0] % len(requests), abort[1])
    # The pool must hold the largest request (one it never could is refused, as tested elsewhere).
    block = limits.get("block_size", 16)
    need = max(cdiv(len(p["prompt_token_ids"]) + sp.max_tokens + K, block) for p, sp in zip(prompts, params))
    if limits.get("num_kv_blocks", need) < need:
        limits = {**limits, "num_kv_blocks": need}
    off = _run(make_engine(loaded, **limits), prompts, params, abort=None)
    on = _run(make_engine(loaded, speculative_config=spec, **limits), prompts, params, abort)
    kept = [i for i in range(len(prompts)) if abort is None or i != abort[0]]
    assert set(kept) <= set(on)
    assert_same_logprobs([on[i] for i in kept], [off[i] for i in kept])
    for i in kept:
        a, b = on[i].outputs[0], off[i].outputs[0]
        assert (a.text, a.finish_reason, a.stop_reason) == (b.text, b.finish_reason, b.stop_reason), i
    accepted = sum(on[i].metrics.num_accepted_tokens for i in kept)
    event("drafts accepted" if accepted else "no draft accepted")  # --hypothesis-show-statistics
