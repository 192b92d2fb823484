"""The thinker's per-token rows through the side-stream copy path, on CPU.

A CUDA thinker copies its rows to the host with ``HostCopier`` (side stream,
reused pinned buffers). Here the thinker runner gets the same copier over
``DeferredCopyDevice``, whose copies run only when waited for and whose fresh
buffers hold NaN: answers (text, codec tokens, waveform) must equal those of
the plain blocking copy, with prefix hits and misses in one step, and the
host buffers must be reused across steps.
"""

from __future__ import annotations

from typing import Any

from omni_utils import assert_nothing_held, assert_same_answer

from omnistage.sampling_params import SamplingParams
from omnistage.worker.host_copy import DeferredCopyDevice, HostCopier

SP = SamplingParams(temperature=0.0, max_tokens=5)
SYSTEM = "system: you are a helpful voice assistant. user: tell me about a fox."


def _conversation(llm: Any) -> list[Any]:
    tok = llm.get_tokenizer()
    base = tok(SYSTEM).input_ids
    first = llm.generate([base], SP)[0]
    turn2 = base + list(first.outputs[0].token_ids) + tok(" user: and then?").input_ids
    other = tok("an unrelated prompt").input_ids
    return [first, *llm.generate([turn2, other], SP)]


def test_side_stream_copy_path_gives_the_blocking_copy_answers(make_llm: Any) -> None:
    reference = _conversation(make_llm())
    llm = make_llm()
    runner = llm.llm_engine.stages["thinker"].runner
    assert runner.host_copier is None  # CPU thinker: rows are already on the host
    device = DeferredCopyDevice()
    runner.host_copier = HostCopier(device)
    outs = _conversation(llm)
    assert outs[1].num_cached_tokens > 0  # the second turn hit the prefix cache
    for ours, ref in zip(outs, reference):
        assert_same_answer(ours, ref)
    assert device.copies_run > 0 and runner.host_copier.buffers.reused > 0
    assert_nothing_held(llm)
