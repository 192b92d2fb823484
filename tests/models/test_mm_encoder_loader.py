"""The encoder-only load of a multimodal checkpoint (what an encoder worker
holds): the towers with the checkpoint's weights, the language model never
materialized, and outputs bit-identical to the whole model's adapter."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from omnistage.models.loader import load_model
from omnistage.models.mm_loader import load_mm_encoder
from omnistage.multimodal.processing import MultiModalProcessor
from omnistage.testing.tiny_mm_checkpoints import write_tiny_qwen2_5_omni_thinker, write_tiny_qwen2_5_vl
from omnistage.worker.mm.encoder_worker import encoder_namespace, towers_fingerprint

WRITERS = {"vl": write_tiny_qwen2_5_vl, "omni": write_tiny_qwen2_5_omni_thinker}


def _prompt(proc: MultiModalProcessor, kind: str) -> dict:
    rng = np.random.default_rng(0)
    content = [{"type": "image"}, {"type": "video"}, {"type": "text", "text": "what is this?"}]
    data = {
        "image": Image.fromarray(rng.integers(0, 256, (140, 140, 3), dtype=np.uint8)),
        "video": rng.integers(0, 256, (3, 56, 84, 3), dtype=np.uint8),
    }
    if kind == "omni":
        content.append({"type": "audio"})
        data["audio"] = ((rng.standard_normal(20800) * 0.1).astype(np.float32), 16000)
    return {"prompt": proc.apply_chat_template([{"role": "user", "content": content}]), "multi_modal_data": data}


@pytest.mark.parametrize("kind", ["vl", "omni"])
def test_towers_only_and_bit_identical(kind, tmp_path):
    path = WRITERS[kind](tmp_path / kind)
    full = load_model(path).mm_adapter
    encoder = load_mm_encoder(Path(path), torch.float32, "cpu")
    lm = list(encoder.language_model.parameters()) + list(encoder.lm_head.parameters())
    assert lm and all(p.is_meta for p in lm)  # the language model was never loaded
    towers = [m for m in (encoder.inner.visual, getattr(encoder.inner, "audio_tower", None)) if m is not None]
    assert all(not p.is_meta for t in towers for p in t.parameters())
    assert towers_fingerprint(encoder) == towers_fingerprint(full)
    proc = MultiModalProcessor.from_pretrained(path)
    for feature in proc.process(_prompt(proc, kind)).mm_features:
        (a,) = full.embed_multimodal(feature.modality, [feature.data])
        (b,) = encoder.embed_multimodal(feature.modality, [feature.data])
        assert torch.equal(a, b), feature.modality
    # the namespace follows the processor settings: other pixel bounds, other keys
    settings = proc.encoder_settings()
    fingerprint = towers_fingerprint(full)
    changed = {**settings, "image": {**settings["image"], "size": {"shortest_edge": 3136, "longest_edge": 3136}}}
    assert encoder_namespace(fingerprint, settings) == encoder_namespace(fingerprint, proc.encoder_settings())
    assert encoder_namespace(fingerprint, settings) != encoder_namespace(fingerprint, changed)


def test_whole_omni_checkpoint_thinker_towers(tmp_path):
    """A whole Qwen2.5-Omni checkpoint keeps the towers under ``thinker.``; the
    worker's load must fingerprint like the pipeline's thinker (a config saved
    differently, e.g. without ``dtype``, must not make them differ)."""
    from omnistage.models.qwen2_5_omni import load_qwen2_5_omni
    from omnistage.testing.tiny_omni_checkpoint import write_tiny_qwen2_5_omni

    path = write_tiny_qwen2_5_omni(tmp_path / "omni")
    thinker = load_qwen2_5_omni(path).thinker.mm_adapter
    encoder = load_mm_encoder(Path(path), torch.float32, "cpu")
    assert towers_fingerprint(encoder) == towers_fingerprint(thinker)
    assert all(p.is_meta for p in encoder.language_model.parameters())
