"""Per-request behaviour: bad input, stop rules, seeds, n > 1, logprobs, chat."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import AutoModelForCausalLM
from utils_engine import GREEDY, PROMPTS, assert_pool_clean, make_engine, run_all

from omnistage.sampling_params import SamplingParams

ARCH = "llama"


@pytest.fixture(scope="module")
def loaded(tiny_loaded):
    return tiny_loaded(ARCH)


@pytest.fixture
def engine(loaded):
    return make_engine(loaded, max_model_len=128)


def _ref(hf_reference, loaded, prompt: str, n: int) -> list[int]:
    return hf_reference(ARCH, loaded.tokenizer.encode(prompt), n)


# -- bad input ----------------------------------------------------------------


def test_bad_requests_raise_and_engine_keeps_serving(engine, loaded, hf_reference):
    engine.add_request("good", PROMPTS[0], GREEDY)
    engine.step()
    vocab = engine.vocab_size
    bad = {
        "empty-str": "",
        "empty-ids": [],
        "too-long": list(range(1, 129)),  # 128 tokens leave no room in max_model_len=128
        "out-of-vocab": [1, 2, vocab],
        "negative-id": [1, -3],
        "not-ints": [1, "2"],
        "bad-dict": {"text": "hello"},
        "bad-type": 3.5,
    }
    for rid, prompt in bad.items():
        with pytest.raises(ValueError, match=rid):
            engine.add_request(rid, prompt, GREEDY)
    with pytest.raises(ValueError, match="good"):
        engine.add_request("good", PROMPTS[1], GREEDY)  # duplicate id
    with pytest.raises(ValueError, match="logprobs"):
        engine.add_request("lp", PROMPTS[1], SamplingParams(logprobs=vocab + 1))
    with pytest.raises(ValueError, match="sampling_params"):
        engine.add_request("sp", PROMPTS[1], {"temperature": 0.0})
    for field, value in [("temperature", -1.0), ("top_p", 0.0), ("top_k", -2), ("max_tokens", 0), ("n", 0)]:
        with pytest.raises(ValueError, match=field):
            SamplingParams(**{field: value})
    assert engine.get_num_unfinished_requests() == 1
    outs = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            outs[o.request_id] = o
    assert outs["good"].outputs[0].token_ids == _ref(hf_reference, loaded, PROMPTS[0], GREEDY.max_tokens)
    assert_pool_clean(engine)


def test_request_too_big_for_the_pool_is_rejected(loaded):
    engine = make_engine(loaded, block_size=4, num_kv_blocks=4)
    with pytest.raises(ValueError, match="big"):
        engine.add_request("big", PROMPTS[3], SamplingParams(max_tokens=8))
    (out,) = run_all(engine, ["hello"], SamplingParams(temperature=0.0, max_tokens=4))
    assert len(out.outputs[0].token_ids) <= 4
    assert_pool_clean(engine)


# -- stop rules -----------------------------------------------------------------


def test_max_tokens_and_token_prompts(engine, loaded, hf_reference):
    ids = loaded.tokenizer.encode(PROMPTS[1])
    outs = run_all(engine, [ids, {"prompt_token_ids": ids}, {"prompt": PROMPTS[1]}], GREEDY)
    ref = _ref(hf_reference, loaded, PROMPTS[1], GREEDY.max_tokens)
    for o in outs:
        assert o.outputs[0].token_ids == ref and o.outputs[0].finish_reason == "length"
        assert o.prompt_token_ids == ids
    assert outs[0].prompt is None and outs[2].prompt == PROMPTS[1]


def test_stop_token_ids(engine, loaded, hf_reference):
    ref = _ref(hf_reference, loaded, PROMPTS[1], GREEDY.max_tokens)
    stop = ref[4]
    (out,) = run_all(engine, [PROMPTS[1]], dataclasses.replace(GREEDY, stop_token_ids=[stop]))
    c = out.outputs[0]
    assert c.token_ids == ref[: ref.index(stop) + 1]
    assert (c.finish_reason, c.stop_reason) == ("stop", stop)


def test_eos_stops_unless_ignore_eos(loaded, hf_reference):
    ref = _ref(hf_reference, loaded, PROMPTS[1], GREEDY.max_tokens)
    eos = ref[3]  # pretend this token is the model's EOS
    engine = make_engine(dataclasses.replace(loaded, eos_token_ids=[eos]))
    params = SamplingParams(temperature=0.0, max_tokens=GREEDY.max_tokens)
    stopped, ignored = run_all(engine, [PROMPTS[1]] * 2, [params, dataclasses.replace(params, ignore_eos=True)])
    assert stopped.outputs[0].token_ids == ref[: ref.index(eos) + 1]
    assert (stopped.outputs[0].finish_reason, stopped.outputs[0].stop_reason) == ("stop", None)
    assert ignored.outputs[0].token_ids == ref and ignored.outputs[0].finish_reason == "length"


def test_min_tokens_matches_hf_min_new_tokens(engine, loaded, hf_reference, tiny_paths):
    ref = _ref(hf_reference, loaded, PROMPTS[1], GREEDY.max_tokens)
    stop = ref[1]
    params = dataclasses.replace(GREEDY, stop_token_ids=[stop], min_tokens=5)
    (out,) = run_all(engine, [PROMPTS[1]], params)
    hf = AutoModelForCausalLM.from_pretrained(tiny_paths[ARCH], dtype=torch.float32).eval()
    ids = torch.tensor([loaded.tokenizer.encode(PROMPTS[1])])
    with torch.no_grad():
        expect = hf.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=GREEDY.max_tokens, min_new_tokens=5,
            do_sample=False, eos_token_id=[stop], pad_token_id=0,
        )[0, ids.shape[1]:].tolist()  # fmt: skip
    if stop in expect:
        expect = expect[: expect.index(stop) + 1]
    got = out.outputs[0].token_ids
    assert got == expect
    assert stop not in got[:5]


def test_stop_strings_truncate_text(engine, loaded, hf_reference):
    full = run_all(engine, [PROMPTS[3]], GREEDY, prefix="full")[0].outputs[0]
    text = full.text
    # A stop string from the middle of the answer that does not occur earlier.
    stop = next(
        text[i : i + 3]
        for i in range(len(text) // 3, len(text) - 3)
        if text.find(text[i : i + 3]) == i and "\ufffd" not in text[i : i + 3]
    )
    idx = text.index(stop)
    plain, incl = run_all(
        engine, [PROMPTS[3]] * 2,
        [dataclasses.replace(GREEDY, stop=[stop, "never-appears"]),
         dataclasses.replace(GREEDY, stop=[stop], include_stop_str_in_output=True)],
    )  # fmt: skip
    assert plain.outputs[0].text == text[:idx]
    assert incl.outputs[0].text == text[: idx + len(stop)]
    for o in (plain, incl):
        assert (o.outputs[0].finish_reason, o.outputs[0].stop_reason) == ("stop", stop)
        assert full.token_ids[: len(o.outputs[0].token_ids)] == o.outputs[0].token_ids
    assert_pool_clean(engine)


def test_min_tokens_holds_back_stop_strings(engine):
    """``min_tokens`` holds back stop strings as it holds back stop ids (vLLM's rule): a stop
    string in the first tokens' text ends the completion only without it."""
    full = run_all(engine, [PROMPTS[3]], GREEDY, prefix="full")[0].outputs[0]
    for n in range(1, 8):  # the first token whose text holds a printable character
        (out,) = run_all(engine, [PROMPTS[3]], dataclasses.replace(GREEDY, max_tokens=n), prefix=f"n{n}")
        text = out.outputs[0].text
        stop = next((ch for ch in text if ch.isprintable() and not ch.isspace() and ch != "\ufffd"), None)
        if stop is not None:
            break
    assert stop is not None and n + 2 <= GREEDY.max_tokens
    unheld, at_min, held = run_all(
        engine, [PROMPTS[3]] * 3,
        [dataclasses.replace(GREEDY, stop=[stop], min_tokens=m) for m in (0, n, n + 2)],
    )  # fmt: skip
    assert len(unheld.outputs[0].token_ids) == n and unheld.outputs[0].finish_reason == "stop"
    # The n-th token's stop string is held back by min_tokens=n too: stops count after the first n tokens.
    got = at_min.outputs[0].token_ids
    assert len(got) > n and got == full.token_ids[: len(got)]
    got = held.outputs[0].token_ids
    assert len(got) >= n + 2 and got == full.token_ids[: len(got)]
    assert_pool_clean(engine)


def test_streamed_text_only_grows_and_matches_decode(engine, loaded):
    params = dataclasses.replace(GREEDY, stop=["zzz-not-there"], max_tokens=20)
    engine.add_request("s", PROMPTS[2], params)
    seen: list[str] = []
    while engine.has_unfinished_requests():
        for o in engine.step():
            seen.append(o.outputs[0].text)
    for a, b in zip(seen, seen[1:]):
        assert b.startswith(a)
    final_ids = o.outputs[0].token_ids
    assert seen[-1] == loaded.tokenizer.decode(final_ids, skip_special_tokens=True)


# -- sampling -------------------------------------------------------------------


def test_seeds_reproducible_across_batches_and_engines(loaded):
    seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=7, max_tokens=10, ignore_eos=True)
    alone = run_all(make_engine(loaded), [PROMPTS[1]], seeded)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True)] * 3
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[3], PROMPTS[2]]
    mixed = run_all(make_engine(loaded, seed=5), prompts, [others[0], seeded] + others[1:])
    assert mixed[1].outputs[0].token_ids == alone
    other_seed = run_all(make_engine(loaded), [PROMPTS[1]], dataclasses.replace(seeded, seed=8))[0]
    assert other_seed.outputs[0].token_ids != alone
    # Unseeded requests repeat under the same engine seed.
    unseeded = SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True)
    a = run_all(make_engine(loaded, seed=3), PROMPTS, unseeded)
    b = run_all(make_engine(loaded, seed=3), PROMPTS, unseeded)
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]


def test_n_greater_than_one(engine, loaded, hf_reference):
    params = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=8, ignore_eos=True)
    (out,) = run_all(engine, [PROMPTS[1]], params)
    assert out.finished and [c.index for c in out.outputs] == [0, 1, 2]
    for i, c in enumerate(out.outputs):
        (single,) = run_all(engine, [PROMPTS[1]], dataclasses.replace(params, n=1, seed=11 + i), prefix=f"single{i}-")
        assert c.token_ids == single.outputs[0].token_ids
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    (greedy,) = run_all(engine, [PROMPTS[1]], dataclasses.replace(GREEDY, n=2), prefix="g")
    ref = _ref(hf_reference, loaded, PROMPTS[1], GREEDY.max_tokens)
    assert [c.token_ids for c in greedy.outputs] == [ref, ref]
    engine.add_request("gone", PROMPTS[0], params)
    engine.step()
    engine.abort_request("gone")
    assert_pool_clean(engine)


def test_logprobs_equal_hf_log_softmax(engine, loaded, tiny_paths):
    (out,) = run_all(engine, [PROMPTS[1]], dataclasses.replace(GREEDY, logprobs=3, max_tokens=6))
    c = out.outputs[0]
    hf = AutoModelForCausalLM.from_pretrained(tiny_paths[ARCH], dtype=torch.float32).eval()
    ids = torch.tensor([out.prompt_token_ids + c.token_ids])
    with torch.no_grad():
        logits = hf(ids).logits[0].float()
    ref = torch.log_softmax(logits[len(out.prompt_token_ids) - 1 : -1], dim=-1)
    assert len(c.logprobs) == len(c.token_ids)
    total = 0.0
    for step, (token, lp) in enumerate(zip(c.token_ids, c.logprobs)):
        assert lp[token] == pytest.approx(ref[step, token].item(), abs=1e-4)
        top = ref[step].topk(3)
        for t, v in zip(top.indices.tolist(), top.values.tolist()):
            assert lp[t] == pytest.approx(v, abs=1e-4)
        assert len(lp) <= 4
        total += lp[token]
    assert c.cumulative_logprob == pytest.approx(total)


# -- chat -------------------------------------------------------------------------


def test_chat_template_applied(engine, loaded):
    messages = [{"role": "user", "content": "hello world!"}]
    text = engine.apply_chat_template(messages)
    assert text == loaded.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n")
    prompt = engine.encode_chat(messages)
    assert prompt["prompt_token_ids"] == loaded.tokenizer.encode(text, add_special_tokens=False)
    (out,) = run_all(engine, [prompt], GREEDY)
    assert out.prompt == text and len(out.outputs[0].token_ids) == GREEDY.max_tokens


def test_metrics_and_stats(engine):
    outs = run_all(engine, PROMPTS, GREEDY)
    for o in outs:
        m = o.metrics
        assert m.first_scheduled_time >= m.arrival_time
        assert 0 < m.time_to_first_token <= m.finished_time - m.arrival_time
    stats = engine.get_stats()
    assert stats.num_generated_tokens == len(PROMPTS) * GREEDY.max_tokens
    assert stats.kv_blocks_total == engine.num_kv_blocks and stats.num_steps > 0
    assert 0.0 <= stats.prefix_cache_hit_rate <= 1.0


def _run_to_end(engine) -> dict:
    """Step until idle; the final output of every request, by id."""
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return done


def test_a_request_that_cannot_join_the_batch_fails_alone(loaded, monkeypatch):
    """Issue 13: a request whose state cannot be built in the worker (here: its sampling
    row raises) fails with finish reason "error"; the request beside it in the same step
    answers as it would alone, and nothing stays held."""
    greedy = SamplingParams(temperature=0.0, max_tokens=6)
    alone = make_engine(loaded, block_size=4, num_kv_blocks=64, max_model_len=128)
    alone.add_request("ok", [5, 6, 7, 8, 9], greedy)
    reference = _run_to_end(alone)["ok"]

    engine = make_engine(loaded, block_size=4, num_kv_blocks=64, max_model_len=128)
    state = engine.runner.sampling_state
    real_set_row = state.set_row

    def set_row(row, params):
        if params.seed == 1234:
            raise OverflowError("injected: this request's values do not fit the sampler's tensors")
        real_set_row(row, params)

    monkeypatch.setattr(state, "set_row", set_row)
    engine.add_request("bad", [1, 2, 3], SamplingParams(temperature=1.0, max_tokens=6, seed=1234))
    engine.add_request("ok", [5, 6, 7, 8, 9], greedy)
    outs = _run_to_end(engine)
    assert outs["bad"].outputs[0].finish_reason == "error"
    assert "request 'bad'" in outs["bad"].error and "injected" in outs["bad"].error
    assert outs["ok"].outputs[0].token_ids == reference.outputs[0].token_ids
    assert engine.held().is_empty
    # The engine keeps serving, and the failed id may be used again.
    engine.add_request("bad", [5, 6, 7, 8, 9], greedy)
    assert _run_to_end(engine)["bad"].outputs[0].token_ids == reference.outputs[0].token_ids


def test_a_step_that_raises_fails_only_its_requests(loaded, monkeypatch):
    """Issue 13: when the forward itself raises, the requests of that step fail with
    finish reason "error", a request still waiting (not in the step) is untouched, and
    the engine then serves the same prompt with the same answer."""
    # One request per step: the second waits while the first's step fails.
    greedy = SamplingParams(temperature=0.0, max_tokens=6)
    engine = make_engine(loaded, block_size=4, num_kv_blocks=64, max_model_len=128, max_num_seqs=1)
    real = engine.runner.execute_model
    calls = {"n": 0}

    def execute_model(so):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected forward failure")
        return real(so)

    monkeypatch.setattr(engine.runner, "execute_model", execute_model)
    engine.add_request("first", [5, 6, 7, 8, 9], greedy)
    engine.add_request("second", [5, 6, 7, 8, 9], greedy)
    outs = _run_to_end(engine)
    assert outs["first"].outputs[0].finish_reason == "error" and "injected forward failure" in outs["first"].error
    assert outs["second"].outputs[0].finish_reason == "length" and outs["second"].error is None
    assert engine.held().is_empty and engine.scheduler.kv_cache_manager.num_used_blocks == 0


def test_numpy_prompt_ids_are_token_ids(engine, loaded, hf_reference):
    """Prompt ids held in NumPy integers (as a tokenizer's arrays give them) are ids like any
    other; a bool or a float is not, and the error says what an id must be."""
    import numpy as np

    ids = loaded.tokenizer.encode(PROMPTS[1])
    (out,) = run_all(engine, [list(np.asarray(ids, dtype=np.int64))], GREEDY)
    assert out.outputs[0].token_ids == _ref(hf_reference, loaded, PROMPTS[1], GREEDY.max_tokens)
    for bad in ([1, True], [1, 2.0]):
        with pytest.raises(ValueError, match=r"prompt token ids must be integers in \[0, \d+\)"):
            engine.add_request("bad", bad, GREEDY)


def test_vocabulary_limits_are_checked_at_admission(engine):
    """logprobs and allowed_token_ids past the vocabulary are refused by name before
    anything is queued (they used to fail only when the worker built the row)."""
    too_big = engine.vocab_size + 5
    with pytest.raises(ValueError, match=r"request 'a': SamplingParams\.allowed_token_ids must be ids below"):
        engine.add_request("a", PROMPTS[0], SamplingParams(allowed_token_ids=[1, too_big]))
    with pytest.raises(ValueError, match=r"request 'b': SamplingParams\.logprobs .* exceeds the vocabulary size"):
        engine.add_request("b", PROMPTS[0], SamplingParams(logprobs=too_big))
    with pytest.raises(ValueError, match=r"request 'c': SamplingParams\.allowed_token_ids are all in suppress_tok"):
        engine.add_request("c", PROMPTS[0], SamplingParams(allowed_token_ids=[5, 6], suppress_token_ids=[6, 5, 7]))
    assert not engine.has_unfinished_requests() and not engine.output_processor.states


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_what_an_overflowed_request_left_in_its_blocks_never_reaches_the_next_owner(tmp_path, dtype):
    """A request whose activations overflow leaves NaN keys/values in its blocks. A request given
    those blocks later reads whole blocks and masks their unused tail, where a NaN would still
    win (NaN - inf is NaN): blocks are zeroed when given out, so it answers as on a fresh pool."""
    from safetensors.torch import load_file, save_file

    from omnistage.models.loader import load_model
    from omnistage.testing.tiny_checkpoints import write_tiny_checkpoint

    path = write_tiny_checkpoint("llama", tmp_path / "overflows")
    poison, dim = 300, 5  # token `poison` alone sets residual dimension `dim`, where the MLP overflows
    file = next(path.glob("*.safetensors"))
    weights = load_file(file)
    embed = weights["model.embed_tokens.weight"]
    embed[:, dim], embed[poison] = 0, 0
    embed[poison, dim] = 1000.0
    for name, w in weights.items():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            w[dim] = 0
        if name.endswith(("gate_proj.weight", "up_proj.weight")):
            w[:, dim] = 1e20 if dtype == "float32" else 100.0
    save_file(weights, file, metadata={"format": "pt"})
    loaded = load_model(str(path), dtype=dtype)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    innocent = [[10, 11, 12, 13, 14], [20, 21, 22]]
    limits = dict(block_size=16, num_kv_blocks=8, enable_prefix_caching=False)
    fresh = [o.outputs[0].token_ids for o in run_all(make_engine(loaded, **limits), innocent, params)]
    engine = make_engine(loaded, **limits)
    overflowing = [list(range(30, 45)) + [poison] + list(range(45, 60)) for _ in range(4)]
    run_all(engine, overflowing, params, prefix="overflow-")
    assert any(not torch.isfinite(cache).all() for cache in engine.runner.kv_caches)  # the blocks hold NaN
    assert [o.outputs[0].token_ids for o in run_all(engine, innocent, params, prefix="after-")] == fresh
