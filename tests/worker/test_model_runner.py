"""ModelRunner driven by hand-written SchedulerOutputs."""

from __future__ import annotations

import re

import pytest
import torch
from transformers import AutoModelForCausalLM

from omnistage.core.sched_output import CachedRequestData, NewRequestData, SchedulerOutput
from omnistage.engine.arg_utils import EngineArgs
from omnistage.models.loader import load_model
from omnistage.testing.tiny_checkpoints import write_tiny_checkpoint
from omnistage.sampling_params import SamplingParams
from omnistage.attention.kv_cache import kv_cache_bytes_per_block
from omnistage.worker.model_runner import ModelRunner

BS = 4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    path = write_tiny_checkpoint("qwen3", tmp_path_factory.mktemp("ckpt") / "qwen3")
    loaded = load_model(str(path))
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    yield loaded, hf
    torch.set_num_threads(threads)


def _runner(loaded, **kw) -> ModelRunner:
    return ModelRunner(loaded, block_size=BS, num_kv_blocks=32, max_num_seqs=4, max_model_len=64, **kw)


def _out(new=(), cached=(), sched=None, finished=(), preempted=()) -> SchedulerOutput:
    sched = sched or {}
    return SchedulerOutput(
        scheduled_new_reqs=list(new),
        scheduled_cached_reqs=list(cached),
        num_scheduled_tokens=sched,
        total_num_scheduled_tokens=sum(sched.values()),
        finished_req_ids=set(finished),
        preempted_req_ids=set(preempted),
    )


def _hf_next(hf, ids: list[int]) -> int:
    with torch.no_grad():
        return int(hf(torch.tensor([ids])).logits[0, -1].argmax())


def test_chunked_prefill_then_decode_matches_hf(tiny):
    loaded, hf = tiny
    runner = _runner(loaded)
    greedy = SamplingParams(temperature=0.0)
    a, b = list(range(3, 13)), list(range(20, 26))  # 10 and 6 tokens
    # Step 1: all of b, first 8 tokens of a (a samples nothing yet).
    out = runner.execute_model(
        _out(
            new=[NewRequestData("a", a, 10, greedy, [0, 1, 2], 0), NewRequestData("b", b, 6, greedy, [4, 5], 0)],
            sched={"a": 8, "b": 6},
        )
    )
    assert out.req_ids == ["b"] and out.sampled_token_ids["b"] == _hf_next(hf, b)
    b.append(out.sampled_token_ids["b"])
    # Step 2: the rest of a, one decode of b.
    out = runner.execute_model(
        _out(cached=[CachedRequestData("a", [], 8), CachedRequestData("b", [], 6)], sched={"a": 2, "b": 1})
    )
    assert out.sampled_token_ids == {"a": _hf_next(hf, a), "b": _hf_next(hf, b)}
    # Step 3: b finished; a decodes alone, needing a new block.
    a.append(out.sampled_token_ids["a"])
    out = runner.execute_model(_out(cached=[CachedRequestData("a", [3], 10)], sched={"a": 1}, finished=["b"]))
    assert out.sampled_token_ids == {"a": _hf_next(hf, a)}
    assert runner.input_batch.req_ids == ["a"]


def test_sampling_state_follows_moved_rows(tiny):
    loaded, _ = tiny
    runner = _runner(loaded)
    p = [SamplingParams(temperature=t, top_k=k) for t, k in ((0.0, 0), (0.5, 3), (0.7, 5))]
    new = [NewRequestData(r, [1, 2, 3], 3, sp, [i], 0) for i, (r, sp) in enumerate(zip("xyz", p))]
    runner.execute_model(_out(new=new, sched={"x": 3, "y": 3, "z": 3}))
    runner.execute_model(_out(finished=["x"]))  # z moves into x's row 0
    assert runner.input_batch.req_ids == ["z", "y"]
    state = runner.sampling_state
    assert state.temperature[0] == pytest.approx(0.7) and state.top_k[0] == 5
    assert state.temperature[1] == pytest.approx(0.5) and state.top_k[1] == 3


def test_preempted_seeded_request_resumes_its_random_stream(tiny):
    loaded, _ = tiny
    seeded = SamplingParams(temperature=1.0, seed=42)
    prompt = [5, 6, 7]

    def run(preempt: bool) -> list[int]:
        runner = _runner(loaded)
        ids = list(prompt)
        out = runner.execute_model(_out(new=[NewRequestData("s", ids, 3, seeded, [0, 1], 0)], sched={"s": 3}))
        ids.append(out.sampled_token_ids["s"])
        for _ in range(4):
            n = len(ids)
            if preempt:  # leave, then come back with every known token recomputed
                runner.execute_model(_out(preempted=["s"]))
                so = _out(new=[NewRequestData("s", list(ids), 3, seeded, [0, 1], 0)], sched={"s": n})
            else:
                so = _out(cached=[CachedRequestData("s", [], n - 1)], sched={"s": 1})
            ids.append(runner.execute_model(so).sampled_token_ids["s"])
        return ids

    assert run(preempt=True) == run(preempt=False)


def test_logprobs_in_runner_output(tiny):
    loaded, hf = tiny
    runner = _runner(loaded)
    ids = [9, 8, 7, 6]
    out = runner.execute_model(
        _out(new=[NewRequestData("l", ids, 4, SamplingParams(temperature=0.0, logprobs=2), [0], 0)], sched={"l": 4})
    )
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0, -1], -1)
    lp = out.logprobs["l"]
    token = out.sampled_token_ids["l"]
    assert token in lp and len(lp) == 2  # the sampled (greedy) token is also the top-1
    assert lp[token] == pytest.approx(ref[token].item(), abs=1e-5)


def test_kv_pool_sizing_from_a_byte_budget(tiny):
    loaded, _ = tiny
    m = loaded.model
    per_block = kv_cache_bytes_per_block(m.num_layers, 16, m.num_kv_heads, m.head_dim, m.dtype)
    assert per_block == 2 * m.num_layers * 16 * m.num_kv_heads * m.head_dim * 4
    args = EngineArgs(kv_cache_memory_bytes=10 * per_block + 5, max_num_seqs=8)
    assert args.resolve_num_kv_blocks(per_block, max_model_len=512) == 10
    # Never more than max_num_seqs full-length requests need.
    roomy = EngineArgs(kv_cache_memory_bytes=10**6 * per_block, max_num_seqs=2)
    assert roomy.resolve_num_kv_blocks(per_block, max_model_len=64) == 2 * 4
    assert EngineArgs(num_kv_blocks=7).resolve_num_kv_blocks(per_block, 64) == 7


def test_forget_drops_the_parked_generator_of_a_preempted_request(tiny):
    loaded, _ = tiny
    runner = _runner(loaded)
    seeded = SamplingParams(temperature=1.0, seed=1)
    runner.execute_model(_out(new=[NewRequestData("s", [5, 6, 7], 3, seeded, [0], 0)], sched={"s": 3}))
    runner.execute_model(_out(preempted=["s"]))
    assert "s" in runner._parked_generators and runner.input_batch.num_reqs == 0
    runner.forget(["s"])  # aborted while waiting: the scheduler never reports it to the worker
    assert not runner._parked_generators


def test_a_sampling_value_past_the_state_is_refused_before_the_batch_changes(tiny):
    """Issue 13, defect 1: top_k past int64 raised OverflowError writing the
    sampler's arrays after the request took a batch row, which it kept."""
    loaded, _ = tiny
    runner = _runner(loaded)
    bad = SamplingParams(temperature=1.0)
    bad.top_k = 10**20  # past validation at construction; the runner checks again
    # It fails alone: reported in the step's output, with no batch row left behind.
    failed = runner.execute_model(_out(new=[NewRequestData("x", [5, 6, 7], 3, bad, [0], 0)], sched={"x": 3}))
    assert list(failed.failed_req_ids) == ["x"] and not failed.req_ids
    assert re.search(r"'x'.*SamplingParams\.top_k must be", failed.failed_req_ids["x"])
    assert runner.input_batch.num_reqs == 0 and not runner.input_batch.req_id_to_index
    greedy = SamplingParams(temperature=0.0)
    out = runner.execute_model(_out(new=[NewRequestData("y", [5, 6, 7], 3, greedy, [0], 0)], sched={"y": 3}))
    assert out.req_ids == ["y"]
