"""Speculative decoding with an EAGLE-1 head (``{"method": "eagle", "model": <folder>, ...}``).

Greedy outputs with the head equal speculation off (and transformers) token
for token on tiny Llama / Qwen2 / Qwen3 targets, for a random head (it
accepts almost nothing: every step rolls back) and for a head that predicts
what the target predicts (it accepts almost everything: the accept path,
bonus tokens and stops inside accepted runs). Prefix-hit counts equal
speculation off; preemption and aborts leave nothing held.

The accepting head: a "bigram" target (attention output and every layer
after the first zeroed, final-norm gains one, so the next token is a
function of the current one through layer 0's MLP) and a head that copies
that layer with ``fc = [I | 0]``: at position ``q`` it computes, from the
embedding of token ``q + 1``, the target's own pre-norm hidden state there,
so its argmax is the target's next token.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from utils_engine import PROMPTS, assert_pool_clean, hf_greedy, make_engine, run_all

from omnistage.core.spec_decode import SpeculativeConfig, take_worker_drafts
from omnistage.engine.arg_utils import EngineArgs
from omnistage.models.loader import load_model
from omnistage.sampling_params import SamplingParams
from omnistage.testing.tiny_checkpoints import write_tiny_checkpoint
from omnistage.testing.tiny_eagle import write_tiny_eagle_head

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
BATCH16 = [f"{p} #{i}" for i in range(4) for p in PROMPTS]


@pytest.fixture(autouse=True)
def _draft_every_step(always_draft):
    """These tests cover verification, rollback and caching: the draft policy
    asks the head for full runs every step (its EAGLE behaviour is tested in
    test_spec_policy.py)."""


def _bigram(path: Path) -> None:
    for f in path.glob("*.safetensors"):
        sd = load_file(f)
        for k, v in sd.items():
            if k.endswith("o_proj.weight") or (
                k.endswith("down_proj.weight") and ".layers.0." not in k
            ):
                sd[k] = torch.zeros_like(v)
            elif k == "model.norm.weight":
                sd[k] = torch.ones_like(v)
        save_file(sd, f, metadata={"format": "pt"})


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    """(arch, kind) -> (loaded target, head folder, HF model); kind "random" or "accepting"."""
    cache: dict = {}

    def get(arch: str, kind: str):
        if (arch, kind) not in cache:
            from transformers import AutoModelForCausalLM

            root = tmp_path_factory.mktemp(f"eagle_{arch}_{kind}")
            path = Path(write_tiny_checkpoint(arch, root / "target"))
            if kind == "accepting":
                _bigram(path)
            head = write_tiny_eagle_head(
                path, root / "head", mimic_target_layer=kind == "accepting"
            )
            hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
            cache[arch, kind] = (load_model(str(path)), str(head), hf)
        return cache[arch, kind]

    return get


def _eagle(head: str, k: int = 3) -> dict:
    return {"method": "eagle", "model": head, "num_speculative_tokens": k}


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def _drain_and_check_clean(engine) -> None:
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.held().is_empty, engine.held()
    assert_pool_clean(engine)


# -- configuration ------------------------------------------------------------------


def test_config_and_head_errors_name_the_problem(targets, tmp_path):
    cfg = SpeculativeConfig.from_dict(
        {"method": "eagle", "model": "/x", "num_speculative_tokens": 2}
    )
    assert (cfg.method, cfg.model, cfg.num_speculative_tokens, cfg.uses_drafter) == (
        "eagle",
        "/x",
        2,
        True,
    )
    assert not SpeculativeConfig.from_dict(
        {"method": "ngram", "num_speculative_tokens": 2}
    ).uses_drafter
    with pytest.raises(ValueError, match="'model' .* is required"):
        SpeculativeConfig.from_dict({"method": "eagle", "num_speculative_tokens": 2})
    with pytest.raises(
        ValueError, match="unknown key 'prompt_lookup_max' for method 'eagle'"
    ):
        SpeculativeConfig.from_dict({"method": "eagle", "model": "/x", "num_speculative_tokens": 2,
                                     "prompt_lookup_max": 3})  # fmt: skip
    with pytest.raises(ValueError, match="'eagle3' is not supported yet"):
        SpeculativeConfig.from_dict(
            {"method": "eagle3", "model": "/x", "num_speculative_tokens": 2}
        )
    assert (
        EngineArgs(speculative_config=_eagle("/x")).speculative_config["method"]
        == "eagle"
    )
    loaded, head, _ = targets("llama", "random")
    with pytest.raises(ValueError, match="EAGLE head .*config.json"):
        make_engine(loaded, speculative_config=_eagle(str(tmp_path)))
    # A head for another width: refused naming both sizes.
    other = tmp_path / "wide"
    other.mkdir()
    text = (
        (Path(head) / "config.json")
        .read_text()
        .replace('"hidden_size": 64', '"hidden_size": 96')
    )
    (other / "config.json").write_text(text)
    with pytest.raises(ValueError, match="hidden_size 96 differs from the target's 64"):
        make_engine(loaded, speculative_config=_eagle(str(other)))
    # A config.json that is not JSON, and one whose layer sizes its weights do not have.
    for name, config in (("broken", "{not json"), ("narrow", _with_intermediate_size(head, 8))):
        bad = tmp_path / name
        shutil.copytree(head, bad)
        (bad / "config.json").write_text(config)
        expected = "config.json is not valid JSON" if name == "broken" else "layers.0 weights do not match config.json"
        with pytest.raises(ValueError, match=f"EAGLE head .*{name}.*: {expected}"):
            make_engine(loaded, speculative_config=_eagle(str(bad)))


def _with_intermediate_size(head: str, size: int) -> str:
    config = json.loads((Path(head) / "config.json").read_text())
    return json.dumps({**config, "intermediate_size": size})


def test_take_worker_drafts_cuts_at_k_and_placeholders():
    assert take_worker_drafts([4, 5, 6, 7], 2) == [4, 5]
    assert take_worker_drafts([4, 99, 6], 3, banned={99}) == [4]
    assert take_worker_drafts([4, 5], 0) == []


# -- greedy exactness -----------------------------------------------------------------


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("kind", ["random", "accepting"])
def test_greedy_equals_speculation_off_and_hf(arch, kind, targets):
    """A mixed batch (prefills beside speculating decodes), then one prompt
    alone; for the accepting head also in far fewer steps."""
    loaded, head, hf = targets(arch, kind)
    refs = [
        hf_greedy(hf, loaded.tokenizer.encode(p), GREEDY.max_tokens) for p in PROMPTS
    ]
    off = make_engine(loaded)
    on = make_engine(loaded, speculative_config=_eagle(head))
    assert _tokens(run_all(off, PROMPTS, GREEDY)) == refs
    assert _tokens(run_all(on, PROMPTS, GREEDY)) == refs
    batch_steps = on.get_stats().num_steps
    assert _tokens(run_all(on, PROMPTS[:1], GREEDY, prefix="solo-")) == refs[:1]
    stats = on.get_stats()
    assert stats.num_draft_tokens > 0
    if kind == "accepting":
        assert stats.num_accepted_tokens >= 0.9 * stats.num_draft_tokens
        assert batch_steps < off.get_stats().num_steps / 2
    _drain_and_check_clean(on)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])  # qwen2: q/k/v biases; qwen3: q/k norms
def test_lean_head_equals_hf_layer(arch, targets):
    """The head runs the lean decoder's layer (fused, prepacked matmuls, native norms and RoPE).
    Every head pass of a run (prefill chunks, catch-ups, draft steps) is also run through HF's
    decoder-layer module on the same inputs, cache and weights: the outputs agree up to fp32
    summation order (relative to the pass's largest value: a random head's outputs reach the
    hundreds along a draft chain)."""
    loaded, head, _ = targets(arch, "random")
    engine = make_engine(loaded, speculative_config=_eagle(head))
    module = engine.runner.proposer.head
    lean, forward = module.lean, module.forward
    assert lean is not None
    worst = []

    def both(*args):
        module.lean = None
        ref = forward(*args)  # HF's module (it writes the same KV slots; the lean pass rewrites them)
        module.lean = lean
        out = forward(*args)
        if out.numel():  # a pass asked for no output row (a release) only writes KV
            worst.append(float((out - ref).abs().max() / ref.abs().max().clamp(min=1.0)))
        return out

    module.forward = both
    off = _tokens(run_all(make_engine(loaded), PROMPTS, GREEDY))
    assert _tokens(run_all(engine, PROMPTS, GREEDY)) == off
    assert len(worst) > len(PROMPTS) and max(worst) < 1e-5, max(worst)
    _drain_and_check_clean(engine)


def test_a_failed_catch_up_of_a_leaving_request_fails_nothing(targets, caplog):
    """The head's pass over a finished request's owed positions is best effort: when it raises,
    the requests still running finish as with speculation off, and nothing stays held (before,
    the finished request's row stayed in the batch for good and the engine never went idle)."""
    loaded, head, _ = targets("llama", "random")
    engine = make_engine(loaded, speculative_config=_eagle(head))
    proposer = engine.runner.proposer
    release, failed = proposer.release, []

    def release_once_failing(req_ids, batch):
        if req_ids and not failed:
            failed.append(sorted(req_ids))
            raise RuntimeError("head pass failed")
        return release(req_ids, batch)

    proposer.release = release_once_failing
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (4, 12, 20)]
    off = _tokens(run_all(make_engine(loaded), PROMPTS[:3], params))
    for i, (prompt, p) in enumerate(zip(PROMPTS[:3], params)):
        engine.add_request(str(i), prompt, p)
    done = {}
    for _ in range(100):  # a bounded loop: an engine that never goes idle fails here, not by hanging
        done |= {o.request_id: o for o in engine.step() if o.finished}
        if not engine.has_unfinished_requests():
            break
    assert not engine.has_unfinished_requests() and _tokens([done[str(i)] for i in range(3)]) == off
    assert failed == [["0"]] and "catch-up pass of leaving requests ['0'] failed" in caplog.text
    _drain_and_check_clean(engine)


@pytest.mark.parametrize("kind", ["random", "accepting"])
def test_batch_of_sixteen_chunked_by_eight_with_prefix_hits(kind, targets):
    """Sixteen requests, a budget of 8 tokens per step (every prompt is split),
    run twice: the second round hits the prefix cache exactly as often as with
    speculation off."""
    loaded, head, _ = targets("qwen2", kind)
    kwargs = {"block_size": 4, "max_num_batched_tokens": 8, "max_num_seqs": 16}
    results = []
    for spec in (None, _eagle(head)):
        engine = make_engine(loaded, speculative_config=spec, **kwargs)
        first = run_all(engine, BATCH16, GREEDY, prefix="a")
        second = run_all(engine, BATCH16, GREEDY, prefix="b")
        hits = [o.num_cached_tokens for o in second]
        results.append(
            (
                _tokens(first),
                _tokens(second),
                hits,
                engine.get_stats().prefix_cache_hit_tokens,
            )
        )
        _drain_and_check_clean(engine)
    assert results[0] == results[1]
    assert sum(results[1][2]) > 0


@pytest.mark.parametrize("kind", ["random", "accepting"])
def test_forced_preemption(kind, targets):
    loaded, head, _ = targets("llama", kind)
    prompts = BATCH16[:8]
    kwargs = {"block_size": 4, "num_kv_blocks": 24}
    ref = _tokens(run_all(make_engine(loaded, **kwargs), prompts, GREEDY))
    engine = make_engine(loaded, speculative_config=_eagle(head), **kwargs)
    assert _tokens(run_all(engine, prompts, GREEDY)) == ref
    assert engine.get_stats().num_preemptions > 0
    _drain_and_check_clean(engine)


@pytest.mark.parametrize("max_tokens", [2, 5, 7])
def test_stops_and_length_inside_an_accepted_run(max_tokens, targets):
    loaded, head, _ = targets("llama", "accepting")
    prompt = PROMPTS[1]
    long = _tokens(run_all(make_engine(loaded), [prompt], GREEDY))[0]
    engine = make_engine(loaded, speculative_config=_eagle(head, k=4))
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    assert _tokens(run_all(engine, [prompt], params)) == [long[:max_tokens]]
    stop = long[max_tokens]
    first = long.index(stop)
    stopped = SamplingParams(
        temperature=0.0, max_tokens=16, ignore_eos=True, stop_token_ids=[stop]
    )
    out = run_all(engine, [prompt], stopped, prefix="stop-")[0].outputs[0]
    assert out.token_ids == long[: first + 1] and out.finish_reason == "stop"
    assert engine.get_stats().num_accepted_tokens > 0
    _drain_and_check_clean(engine)


def test_seeded_sampling_repeats_and_aborts_hold_nothing(targets):
    """Sampled requests speculate too (the head's argmax drafts are verified
    by the rejection sampler): a seeded request gives the same tokens twice."""
    loaded, head, _ = targets("qwen3", "accepting")
    engine = make_engine(loaded, speculative_config=_eagle(head))
    sampled = SamplingParams(
        temperature=0.8, top_k=20, seed=7, max_tokens=16, ignore_eos=True
    )
    a = _tokens(run_all(engine, PROMPTS, sampled, prefix="a"))
    b = _tokens(run_all(engine, PROMPTS, sampled, prefix="b"))
    assert a == b and engine.get_stats().num_accepted_tokens > 0
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"abort{i}", p, GREEDY)
    for _ in range(3):
        engine.step()
    engine.abort_request([f"abort{i}" for i in range(len(PROMPTS))])
    _drain_and_check_clean(engine)


@pytest.mark.slow
def test_embedded_default_model_with_a_random_head(tmp_path):
    """The embedded default (SmolLM2-135M, a Llama) with a random head of its
    width: greedy chat answers equal speculation off, chunked by 8 (prefills beside decodes).
    Its weights are GGUF's Q4_1, so the head runs in Q8_0 (only that form kept)."""
    loaded = load_model(None)
    head = str(write_tiny_eagle_head(loaded.model_path, tmp_path / "head"))
    off = make_engine(loaded, block_size=16, max_model_len=512)
    prompts = [
        off.encode_chat([{"role": "user", "content": q}])
        for q in ("What is the capital of France?", "Hi!")
    ]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    ref = _tokens(run_all(off, prompts, params))
    on = make_engine(
        loaded,
        block_size=16,
        max_model_len=512,
        max_num_batched_tokens=8,
        speculative_config=_eagle(head),
    )
    lean = on.runner.proposer.head.lean
    layer = lean.layer
    assert all(lin.int8 is not None for lin in (lean.fc, layer.qkv, layer.o, layer.gate_up, layer.down))
    assert on.runner.proposer.head.fc.weight.untyped_storage().nbytes() == 4  # the fp32 copy released
    assert _tokens(run_all(on, prompts, params)) == ref
    assert on.get_stats().num_draft_tokens > 0
    _drain_and_check_clean(on)


@pytest.mark.parametrize("kind", ["random", "accepting"])
def test_logprobs_equal_speculation_off(kind, targets):
    """Requests with logprobs speculate: one entry per emitted token, as speculation off reports it."""
    from test_spec_ngram import assert_same_logprobs

    loaded, head, _ = targets("qwen2", kind)
    params = [
        SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True, logprobs=0),
        SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=5),
    ]
    off = run_all(make_engine(loaded), PROMPTS, params)
    engine = make_engine(loaded, speculative_config=_eagle(head))
    on = run_all(engine, PROMPTS, params)
    assert_same_logprobs(on, off)
    assert all(o.metrics.num_drafts > 0 for o in on)
    if kind == "accepting":
        assert all(o.metrics.num_accepted_tokens > 0 for o in on)
    _drain_and_check_clean(engine)
