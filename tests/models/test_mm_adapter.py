"""The model adapters against transformers' own forward: HF on (input_ids,
pixel values, audio features) must equal the language model run on our
inputs_embeds (token embeddings + embed_multimodal rows) at our M-RoPE
positions, in fp32."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from omnistage.models.mm_adapter import MRopePositions
from omnistage.models.qwen2_5_omni_thinker import Qwen2_5OmniThinkerAdapter
from omnistage.models.qwen2_5_vl import Qwen2_5_VLAdapter
from omnistage.multimodal.processing import MultiModalProcessor
from omnistage.testing.hf_reference import hf_reference_inputs
from omnistage.testing.tiny_mm_checkpoints import write_tiny_qwen2_5_omni_thinker, write_tiny_qwen2_5_vl


@pytest.fixture(scope="module")
def vl(tmp_path_factory):
    from transformers import Qwen2_5_VLForConditionalGeneration

    path = write_tiny_qwen2_5_vl(tmp_path_factory.mktemp("vl"))
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(path).eval()
    return MultiModalProcessor.from_pretrained(path), model, Qwen2_5_VLAdapter(model)


@pytest.fixture(scope="module")
def omni(tmp_path_factory):
    from transformers import Qwen2_5OmniThinkerForConditionalGeneration

    path = write_tiny_qwen2_5_omni_thinker(tmp_path_factory.mktemp("omni"))
    model = Qwen2_5OmniThinkerForConditionalGeneration.from_pretrained(path).eval()
    return MultiModalProcessor.from_pretrained(path), model, Qwen2_5OmniThinkerAdapter(model)


def image(seed: int, h: int = 60, w: int = 90) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))


def video(seed: int, t: int = 3, h: int = 56, w: int = 84) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (t, h, w, 3), dtype=np.uint8)


def clip(seed: int, seconds: float) -> tuple[np.ndarray, int]:
    return (np.random.default_rng(seed).standard_normal(int(16000 * seconds)) * 0.1).astype(np.float32), 16000


def process(proc: MultiModalProcessor, parts: list[str], data: dict):
    content = [{"type": p} if p != "text" else {"type": "text", "text": "what is this?"} for p in parts]
    prompt = proc.apply_chat_template([{"role": "user", "content": content}])
    return proc.process({"prompt": prompt, "multi_modal_data": data})


def hf_logits(model, out, extra_ids: list[int] = ()) -> torch.Tensor:
    """transformers' own forward on the processed prompt (+ extra tokens)."""
    kwargs = hf_reference_inputs(model, out, torch.tensor([out.prompt_token_ids + list(extra_ids)]))
    with torch.no_grad():
        return model(**kwargs).logits[0]


def our_inputs(adapter, out, extra_ids: list[int] = ()) -> tuple[torch.Tensor, MRopePositions]:
    """inputs_embeds from token embeddings + one embed_multimodal call per
    modality (items batched), scattered over the placeholder spans."""
    ids = torch.tensor(out.prompt_token_ids + list(extra_ids))
    embeds = adapter.embed_input_ids(ids).clone()
    for modality in adapter.modalities:
        features = [f for f in out.mm_features if f.modality == modality]
        rows = adapter.embed_multimodal(modality, [f.data for f in features])
        assert len(rows) == len(features)
        for f, r in zip(features, rows):
            p = f.mm_position
            assert r.shape == (p.get_num_embeds(), adapter.hidden_size)
            embeds[p.offset : p.offset + p.length] = r
    return embeds, adapter.get_mrope_positions(out.prompt_token_ids, out.mm_features)


def our_logits(adapter, out, extra_ids: list[int] = ()) -> torch.Tensor:
    embeds, positions = our_inputs(adapter, out, extra_ids)
    return adapter.compute_logits(adapter.forward(embeds, positions.get(0, embeds.shape[0])))


VL_CASES = {
    "one image": (["image", "text"], lambda: {"image": image(0)}),
    "several images": (
        ["image", "text", "image", "image"],
        lambda: {"image": [image(0), image(1, 300, 50), image(2, 140, 140)]},
    ),
    "video": (["video", "text"], lambda: {"video": video(0)}),
    "video with fps and an image": (
        ["video", "image", "text"],
        lambda: {"video": (video(1, 4), {"fps": 1.0}), "image": image(3)},
    ),
}
OMNI_CASES = {
    "one image": (["image", "text"], lambda: {"image": image(0)}),
    "audio clip": (["audio", "text"], lambda: {"audio": clip(0, 1.3)}),
    "image and audio": (["image", "audio", "text"], lambda: {"image": image(1), "audio": clip(1, 2.0)}),
    "two audio clips": (["audio", "text", "audio"], lambda: {"audio": [clip(2, 0.7), clip(3, 4.5)]}),
    "video": (["video", "text"], lambda: {"video": video(2)}),
    "everything": (
        ["audio", "video", "image", "text"],
        lambda: {"audio": clip(4, 3.0), "video": video(3), "image": image(4)},
    ),
}


@pytest.mark.parametrize("case", list(VL_CASES))
def test_qwen2_5_vl_matches_transformers(vl, case):
    proc, model, adapter = vl
    parts, data = VL_CASES[case]
    out = process(proc, parts, data())
    torch.testing.assert_close(our_logits(adapter, out), hf_logits(model, out), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", list(OMNI_CASES))
def test_qwen2_5_omni_thinker_matches_transformers(omni, case):
    proc, model, adapter = omni
    parts, data = OMNI_CASES[case]
    out = process(proc, parts, data())
    torch.testing.assert_close(our_logits(adapter, out), hf_logits(model, out), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fixture", ["vl", "omni"])
def test_decode_positions_follow_the_delta(request, fixture):
    """Generated tokens sit at ``index + delta``: HF recomputing positions
    over prompt + generated tokens agrees with our prompt-only result."""
    proc, model, adapter = request.getfixturevalue(fixture)
    out = process(proc, ["video", "image", "text"], {"video": video(5), "image": image(5)})
    extra = proc.tokenizer("ok then")["input_ids"]
    positions = adapter.get_mrope_positions(out.prompt_token_ids, out.mm_features)
    assert positions.delta != 0
    torch.testing.assert_close(our_logits(adapter, out, extra), hf_logits(model, out, extra), rtol=1e-5, atol=1e-5)


def test_batched_encoding_equals_one_item_at_a_time(vl, omni):
    _, _, vl_adapter = vl
    out = process(vl[0], ["image", "image", "video"], {"image": [image(0), image(1, 300, 50)], "video": video(0)})
    images = [f.data for f in out.mm_features if f.modality == "image"]
    batched = vl_adapter.embed_multimodal("image", images)
    for item, rows in zip(images, batched):
        torch.testing.assert_close(vl_adapter.embed_multimodal("image", [item])[0], rows, rtol=1e-5, atol=1e-6)
    _, _, omni_adapter = omni
    out = process(omni[0], ["audio", "audio"], {"audio": [clip(0, 0.4), clip(1, 5.0)]})
    clips = [f.data for f in out.mm_features]
    batched = omni_adapter.embed_multimodal("audio", clips)
    for item, rows in zip(clips, batched):
        torch.testing.assert_close(omni_adapter.embed_multimodal("audio", [item])[0], rows, rtol=1e-5, atol=1e-6)
    assert omni_adapter.embed_multimodal("audio", []) == []
    with pytest.raises(ValueError, match="modality 'audio' is not supported"):
        vl_adapter.embed_multimodal("audio", clips)


def test_packed_requests_equal_separate_runs(vl):
    proc, _, adapter = vl
    outs = [
        process(proc, ["image", "text"], {"image": image(0)}),
        process(proc, ["text", "video"], {"video": video(1)}),
        process(proc, ["image", "image"], {"image": [image(2), image(3, 112, 56)]}),
    ]
    inputs = [our_inputs(adapter, out) for out in outs]
    separate = torch.cat([adapter.forward(e, p.prompt) for e, p in inputs])
    embeds = torch.cat([e for e, _ in inputs])
    positions = torch.cat([p.prompt for _, p in inputs], dim=1)
    packed = adapter.forward(embeds, positions, [e.shape[0] for e, _ in inputs])
    torch.testing.assert_close(packed, separate, rtol=1e-5, atol=1e-5)


def test_mrope_positions_windows():
    prompt = torch.tensor([[0, 1, 2, 2, 2, 5], [0, 1, 2, 3, 3, 5], [0, 1, 2, 3, 4, 5]])
    pos = MRopePositions(prompt, delta=0)
    assert torch.equal(pos.get(1, 4), prompt[:, 1:4])
    pos = MRopePositions(prompt, delta=-2)
    # tokens 6.. are generated: index + delta on every axis
    assert pos.get(6, 8).tolist() == [[4, 5]] * 3
    assert torch.equal(pos.get(4, 8), torch.cat([prompt[:, 4:], torch.tensor([[4, 5]] * 3)], dim=1))
    assert pos.get(3, 3).shape == (3, 0)
    with pytest.raises(ValueError):
        pos.get(5, 2)


def test_text_only_positions_are_plain(vl, omni):
    for proc, _, adapter in (vl, omni):
        out = proc.process("hello there")
        pos = adapter.get_mrope_positions(out.prompt_token_ids, [])
        n = len(out.prompt_token_ids)
        assert pos.delta == 0 and torch.equal(pos.prompt, torch.arange(n).expand(3, n))


def test_positions_need_item_data(vl):
    proc, _, adapter = vl
    out = process(proc, ["image"], {"image": image(0)})
    out.mm_features[0].data = None
    with pytest.raises(ValueError, match="have no data"):
        adapter.get_mrope_positions(out.prompt_token_ids, out.mm_features)


def test_adapter_drives_the_worker_encoder_runner(omni):
    """The adapter is what the worker's EncoderRunner expects: encode the
    scheduled items, then gather a chunked-prefill window and merge it."""
    from omnistage.worker.mm.encoder_cache import EncoderCache
    from omnistage.worker.mm.encoder_runner import EncoderRunner, MultiModalEmbedder

    proc, model, adapter = omni
    assert isinstance(adapter, MultiModalEmbedder)
    out = process(proc, ["image", "audio", "text", "image"], {"image": [image(0), image(0)], "audio": clip(0, 1.0)})
    expected, _ = our_inputs(adapter, out)
    cache = EncoderCache()
    runner = EncoderRunner(adapter, 512, adapter.hidden_size, cache, torch.float32, torch.device("cpu"))
    cache.add_request("r", out.mm_features)
    # the two equal images share one identifier: the scheduler encodes it once
    assert out.mm_features[0].identifier == out.mm_features[2].identifier
    hashes, kwargs = runner.prepare_mm_inputs({"r": [0, 1]})
    cache.encoder_outputs.update(zip(hashes, runner.execute_mm_encoder(kwargs)))
    ids = torch.tensor(out.prompt_token_ids)
    start, end = out.mm_features[0].mm_position.offset + 3, out.mm_features[2].mm_position.offset + 5
    rows, mask = runner.gather_mm_embeddings(
        ["r"], end - start, np.array([end - start]), np.array([0, end - start]), np.array([len(ids)]), np.array([start])
    )
    merged = runner.get_inputs_embeds(ids[start:end], rows, mask)
    torch.testing.assert_close(merged, expected[start:end], rtol=1e-5, atol=1e-6)
