"""Greedy Qwen2.5-VL video answers equal transformers' whichever layout holds
the processor settings (issue 12).

The tiny checkpoint's processor files are rewritten by transformers' own
``save_pretrained`` in the transformers 5 layout (one nested
``processor_config.json``) and in the legacy one. transformers' processor,
loaded from the folder by transformers' loaders, prepares the reference
inputs for ``generate``; the engine reads the same folder on its own. With
video bounds of at most 16 merged tokens per frame pair, settings read from
the wrong place give another token count and another answer from the first
token.
"""

from __future__ import annotations

import pytest
from utils_engine import assert_pool_clean, make_engine, run_all
from utils_mm import chat_prompt, video, write_sensitive_checkpoint

from omnistage.models.loader import load_model
from omnistage.multimodal.processing import MultiModalProcessor
from omnistage.sampling_params import SamplingParams
from omnistage.testing.hf_processors import (
    hf_processor_from_pretrained,
    hf_qwen2_vl_video_processor,
    resave_processor_with_transformers,
)
from omnistage.testing.tiny_mm_checkpoints import PROCESSOR_LAYOUTS

N = 6
GREEDY = SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True)


@pytest.mark.parametrize("layout", PROCESSOR_LAYOUTS)
def test_video_greedy_equals_transformers(tmp_path, layout):
    import torch
    from transformers import Qwen2_5_VLForConditionalGeneration

    path = write_sensitive_checkpoint("vl", tmp_path / "vl")
    frames = video(0, t=4)  # 4 frames of 56x84: 2 frame pairs of 2x3 merged tokens
    with hf_qwen2_vl_video_processor() as video_cls:
        resave_processor_with_transformers(path, layout, video_cls)
        hf_processor = hf_processor_from_pretrained(path, video_cls)
        prompt = chat_prompt(MultiModalProcessor.from_pretrained(path), ["video", "text"], {"video": frames})
        inputs = hf_processor(text=[prompt["prompt"]], videos=[frames], return_tensors="pt")
    num_video_tokens = int((inputs["input_ids"] == hf_processor.video_token_id).sum())
    assert num_video_tokens == 12  # the checkpoint's bounds, not the class defaults (280)

    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(path).eval()
    with torch.no_grad():
        sequences = model.generate(
            **inputs, max_new_tokens=N, min_new_tokens=N, do_sample=False, eos_token_id=None, pad_token_id=0
        )
    expected = sequences[0, inputs["input_ids"].shape[1] :].tolist()

    loaded = load_model(path)
    for options in ({}, {"enable_prefix_caching": False, "enable_encoder_cache": False}):
        engine = make_engine(loaded, block_size=4, **options)
        outputs = run_all(engine, [prompt, prompt], GREEDY)  # the second one hits the caches that are on
        assert [out.outputs[0].token_ids for out in outputs] == [expected, expected]
        assert len(outputs[0].prompt_token_ids) == inputs["input_ids"].shape[1]
        assert_pool_clean(engine)
