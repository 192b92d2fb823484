"""The part of an engine that runs before the scheduler, detached from the weights.

A replica exports it (``EngineFront.of``); the data-parallel facade runs it in
the driver: prompts are tokenized, their media processed and checked, and
chat templates rendered once, there, so a bad prompt is refused before any
replica sees it and the router can hash the prompt's blocks. It holds the
tokenizer and the media processor, never a model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from omnistage.engine.input_processor import ProcessedInputs, PromptType

__all__ = ["EngineFront"]


@dataclass
class EngineFront:
    input_processor: Any  # the prompt stage's InputProcessor
    encoder_check: Any  # its scheduler's EncoderScheduler (None: the model takes no media)
    model_name: str
    block_size: int
    num_kv_blocks: int  # per replica
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    input_modalities: frozenset[str]
    output_modalities: frozenset[str]
    voices: tuple[str, ...]

    @classmethod
    def of(cls, engine: Any) -> EngineFront:
        """The front of a stage engine or, for a pipeline, of its prompt stage."""
        stage = getattr(engine, "thinker", engine)
        return cls(
            input_processor=stage.input_processor,
            encoder_check=getattr(stage.scheduler, "encoder", None),
            model_name=str(getattr(stage.loaded_model, "name", None) or stage.args.model or "default"),
            block_size=stage.args.block_size,
            num_kv_blocks=stage.num_kv_blocks,
            max_model_len=stage.max_model_len,
            vocab_size=stage.vocab_size,
            eos_token_ids=tuple(stage.eos_token_ids),
            input_modalities=frozenset(engine.input_modalities),
            output_modalities=frozenset(engine.output_modalities),
            voices=tuple(engine.voices),
        )

    @property
    def tokenizer(self) -> Any:
        return self.input_processor.tokenizer

    def process_inputs(
        self, request_id: str, prompt: PromptType | ProcessedInputs, truncate_prompt_tokens: int | None = None
    ) -> ProcessedInputs:
        """``StageEngine.process_inputs``, here: the same processor and the same item check."""
        if isinstance(prompt, ProcessedInputs):
            return prompt
        inputs = self.input_processor.process(request_id, prompt, truncate_prompt_tokens)
        if inputs.mm_features:
            if self.encoder_check is None:
                modality = inputs.mm_features[0].modality
                raise ValueError(f"request {request_id!r}: {modality} item 0: this model takes no multimodal input")
            self.encoder_check.validate(request_id, inputs.mm_features)
        return inputs

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        self._need_template()
        return self.input_processor.render_chat(messages, add_generation_prompt, **kwargs)

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        mm_processor_kwargs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> dict[str, Any]:
        self._need_template()
        return self.input_processor.chat_prompt(messages, add_generation_prompt, mm_processor_kwargs, **kwargs)

    def _need_template(self) -> None:
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise ValueError(f"the tokenizer of {self.model_name!r} has no chat template")
