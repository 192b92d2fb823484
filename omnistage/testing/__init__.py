"""Test fixtures that ship with omnistage: tiny real checkpoints and transformers references.

omnistage's own tests run against checkpoints written here, and so can
yours: each writer saves, offline and in about a second, a folder that loads
exactly like the published model (``config.json``, ``model.safetensors``,
tokenizer, chat template, processor settings in the layout transformers 5
writes), with fixed-seed random weights small enough for a CPU. Point
``omnistage.LLM`` (or ``transformers``) at the folder and compare.

- :mod:`~omnistage.testing.tiny_checkpoints`: text models (Llama, Qwen2,
  Qwen3), ``write_tiny_checkpoint(arch, path, seed)``.
- :mod:`~omnistage.testing.tiny_mm_checkpoints`: Qwen2.5-VL and the
  Qwen2.5-Omni thinker, ``write_tiny_qwen2_5_vl`` /
  ``write_tiny_qwen2_5_omni_thinker``.
- :mod:`~omnistage.testing.tiny_omni_checkpoint`: the whole Qwen2.5-Omni
  model (thinker, talker, token2wav, speakers), ``write_tiny_qwen2_5_omni``.
- :mod:`~omnistage.testing.tiny_qwen3_omni_checkpoint`: the whole Qwen3-Omni
  model (MoE thinker, talker + code predictor, code2wav, speakers in its
  config), ``write_tiny_qwen3_omni``.
- :mod:`~omnistage.testing.tiny_eagle`: an EAGLE-1 draft head for any of
  those targets, in the layout vLLM loads, ``write_tiny_eagle_head(target,
  path)`` (random, or ``mimic_target_layer=True`` for one that copies the
  target's first layer).
- :mod:`~omnistage.testing.hf_reference`: run ``transformers`` as the
  reference: the keyword arguments of its forward / ``generate`` for a
  prompt omnistage processed, and what its Qwen2.5-Omni ``generate`` passes
  between the stages.
- :mod:`~omnistage.testing.hf_processors`: transformers' Qwen2.5-VL /
  Qwen2.5-Omni processors, video included, without torchvision; rewrite a
  folder's processor files with transformers' own ``save_pretrained`` in the
  transformers 5 or the legacy layout.

Nothing in the engine imports this package; it needs ``transformers`` and
``tokenizers`` (already omnistage dependencies) and, for
``gguf_weights=True``, ``gguf``.

Example::

    from omnistage import LLM, SamplingParams
    from omnistage.testing import write_tiny_checkpoint

    path = write_tiny_checkpoint("qwen2", tmp_path / "tiny")
    out = LLM(str(path)).generate(["hello"], SamplingParams(max_tokens=4, temperature=0.0))
"""

from omnistage.testing.tiny_checkpoints import TINY_ARCHS, build_tiny_tokenizer, write_tiny_checkpoint
from omnistage.testing.tiny_mm_checkpoints import (
    PROCESSOR_LAYOUTS,
    write_tiny_qwen2_5_omni_thinker,
    write_tiny_qwen2_5_vl,
)
from omnistage.testing.tiny_eagle import write_tiny_eagle_head
from omnistage.testing.tiny_omni_checkpoint import write_tiny_qwen2_5_omni
from omnistage.testing.tiny_qwen3_omni_checkpoint import write_tiny_qwen3_omni

__all__ = [
    "PROCESSOR_LAYOUTS",
    "TINY_ARCHS",
    "build_tiny_tokenizer",
    "write_tiny_checkpoint",
    "write_tiny_eagle_head",
    "write_tiny_qwen2_5_omni",
    "write_tiny_qwen2_5_omni_thinker",
    "write_tiny_qwen2_5_vl",
    "write_tiny_qwen3_omni",
]
