"""A decode or verify step through every layer in one native call (``kernels/decode_layers.py``)
gives bit for bit the hidden states of the layer-by-layer native sequence it replaces."""

from __future__ import annotations

import pytest
import torch

from omnistage.core import spec_policy
from omnistage.engine.arg_utils import EngineArgs
from omnistage.engine.stage_engine import LLMEngine
from omnistage.kernels.native import native_kernels
from omnistage.models.fast_forward import LeanDecoder
from omnistage.models.loader import load_model
from omnistage.sampling_params import SamplingParams
from omnistage.testing.tiny_checkpoints import write_tiny_checkpoint

pytestmark = pytest.mark.skipif(native_kernels() is None, reason="native kernels need x86-64 AVX2 and g++")

PROMPTS = ["hello world!", "the quick brown fox jumps over the lazy dog.", "one two three four five six"]


NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2, "prompt_lookup_min": 1}


def _decode_outputs(
    loaded, monkeypatch, batch: int, spec: dict | None = None, lengths: tuple[int, ...] | None = None
) -> tuple[list[torch.Tensor], list[list[int]], list[torch.Tensor]]:
    """The lean decoder's output at every step, the generated tokens and the KV caches after
    (``lengths``: each request's number of new tokens)."""
    seen: list[torch.Tensor] = []
    forward = LeanDecoder.forward

    def recording(self, *args, **kwargs):
        out = forward(self, *args, **kwargs)
        seen.append(out.clone())
        return out

    monkeypatch.setattr(LeanDecoder, "forward", recording)
    engine = LLMEngine(EngineArgs(model=loaded.model_path, block_size=4, speculative_config=spec), loaded_model=loaded)
    # Speculating: long enough for the random model's output to repeat a token, which the
    # n-gram proposer drafts from.
    lengths = lengths or (40 if spec else 12,) * batch
    for i, prompt in enumerate((PROMPTS * 3)[:batch]):
        engine.add_request(str(i), prompt, SamplingParams(temperature=0.0, max_tokens=lengths[i], ignore_eos=True))
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
    monkeypatch.setattr(LeanDecoder, "forward", forward)
    return seen, [done[str(i)] for i in range(batch)], engine.runner.kv_caches


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: q/k/v biases
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("spec", [None, NGRAM], ids=["decode", "verify"])
def test_one_call_equals_the_layer_by_layer_sequence(arch, batch, spec, tmp_path, monkeypatch):
    if spec:  # every proposal verified at full length, so verify steps of several tokens per row run
        monkeypatch.setattr(spec_policy, "DEFAULT_VERIFY_COSTS", {1: ((1, 1.0), (2, 1.0))})
        monkeypatch.setattr(spec_policy, "DEFAULT_DECODE_COSTS", ((1, 1.0), (2, 1.0)))
        monkeypatch.setattr(spec_policy, "DEFAULT_MIN_GAIN", 0.0)
    loaded = load_model(str(write_tiny_checkpoint(arch, tmp_path, gguf_weights=True, head_dim=32)))
    lean = loaded.model.lean
    native = lean.native_layers
    assert native is not None
    calls = []
    run = native.run
    monkeypatch.setattr(native, "run", lambda h, *a: calls.append(h.shape[0]) or run(h, *a))
    fused, fused_tokens, fused_kv = _decode_outputs(loaded, monkeypatch, batch, spec)
    assert len(calls) >= (4 if spec else 8)  # the steps after the dense views are built
    if spec:
        assert max(calls) > batch  # verify steps: several tokens of a row in one call
    lean.native_layers = None
    plain, plain_tokens, plain_kv = _decode_outputs(loaded, monkeypatch, batch, spec)
    assert fused_tokens == plain_tokens
    assert len(fused) == len(plain)
    assert all(torch.equal(a, b) for a, b in zip(fused, plain))
    # The paged cache too (a later step that leaves the dense view, or a prefix hit, reads it).
    assert all(torch.equal(a, b) for a, b in zip(fused_kv, plain_kv))


def test_requests_that_leave_do_not_stop_the_one_call_path(tmp_path, monkeypatch):
    """Requests finishing at different steps: the others go on in their dense-view rows, so no
    step after one leaves gathers the whole context again; bit for bit the layer-by-layer path."""
    loaded = load_model(str(write_tiny_checkpoint("llama", tmp_path, gguf_weights=True, head_dim=32)))
    lean = loaded.model.lean
    native = lean.native_layers
    calls = []
    run = native.run
    monkeypatch.setattr(native, "run", lambda h, *a: calls.append(h.shape[0]) or run(h, *a))
    lengths = (4, 8, 12)  # decode steps 1-3, 1-7 and 1-11 (the prefill step samples the first token)
    fused, fused_tokens, fused_kv = _decode_outputs(loaded, monkeypatch, 3, lengths=lengths)
    # Steps 1 and 2 gather and build the views; every later one is a single call, after each leave too.
    assert calls == [3] + [2] * 4 + [1] * 4
    lean.native_layers = None
    plain, plain_tokens, plain_kv = _decode_outputs(loaded, monkeypatch, 3, lengths=lengths)
    assert fused_tokens == plain_tokens and [len(t) for t in plain_tokens] == list(lengths)
    assert len(fused) == len(plain) and all(torch.equal(a, b) for a, b in zip(fused, plain))
    assert all(torch.equal(a, b) for a, b in zip(fused_kv, plain_kv))


def test_not_built_where_a_layer_has_what_the_call_does_not_run(tmp_path):
    qwen3 = load_model(str(write_tiny_checkpoint("qwen3", tmp_path / "q3", gguf_weights=True)))
    assert qwen3.model.lean.native_layers is None  # per-head q/k norms
    plain = load_model(str(write_tiny_checkpoint("llama", tmp_path / "fp32", head_dim=32)))
    assert plain.model.lean.native_layers is None  # fp32 weights without a group-int8 form
