"""Prompts -> token ids and multimodal items, before a request reaches the scheduler.

Everything that can be wrong with a prompt (unknown keys, bad token ids, an
undecodable image, a clip of the wrong shape, more items than placeholders)
is found here and raised as a ``ValueError`` naming the request and the item,
before any engine state changes.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import jinja2

from omnistage.multimodal.chat import split_chat_media
from omnistage.multimodal.hashing import salt_identifier
from omnistage.multimodal.inputs import MultiModalFeatureSpec

PromptType = str | list[int] | dict[str, Any]
_PROMPT_KEYS = {"prompt", "prompt_token_ids", "cache_salt", "multi_modal_data", "mm_processor_kwargs"}


@dataclass
class ProcessedInputs:
    """A prompt ready for ``LLMEngine.add_request``: expanded token ids and
    the items' feature specs (sorted by placeholder offset)."""

    prompt_text: str | None
    prompt_token_ids: list[int]
    mm_features: list[MultiModalFeatureSpec] = field(default_factory=list)
    cache_salt: str | None = None
    payload: Any = None  # model inputs beyond token ids (a stage's hand-off), see ``Request.payload``


class InputProcessor:
    """Tokenizes prompts and, for a multimodal model, runs its
    ``MultiModalProcessor`` (which expands each placeholder to the item's
    number of encoder embeddings)."""

    def __init__(self, tokenizer: Any, vocab_size: int, max_model_len: int, mm_processor: Any = None) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.mm_processor = mm_processor

    @property
    def input_modalities(self) -> frozenset[str]:
        extra = self.mm_processor.modalities if self.mm_processor is not None else ()
        return frozenset({"text", *extra})

    def process(
        self, request_id: str, prompt: PromptType | ProcessedInputs, truncate_prompt_tokens: int | None = None
    ) -> ProcessedInputs:
        """Tokenize ``prompt`` and expand its media; ``truncate_prompt_tokens`` (``SamplingParams``'s)
        keeps the expanded prompt's last tokens. ``ValueError`` names the request and the problem."""
        if isinstance(prompt, ProcessedInputs):
            return prompt
        where = f"request {request_id!r}"
        text: str | None = None
        token_ids: list[int] | None = None
        cache_salt = mm_data = mm_kwargs = None
        if isinstance(prompt, dict):
            unknown = set(prompt) - _PROMPT_KEYS
            if unknown:
                raise ValueError(f"{where}: unsupported prompt keys {sorted(unknown)}")
            cache_salt = prompt.get("cache_salt")
            if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
                raise ValueError(f"{where}: cache_salt must be a non-empty string, got {cache_salt!r}")
            mm_data, mm_kwargs = prompt.get("multi_modal_data"), prompt.get("mm_processor_kwargs")
            if "prompt_token_ids" in prompt:
                text, token_ids = prompt.get("prompt"), self._check_ids(where, prompt["prompt_token_ids"])
            elif "prompt" in prompt:
                text = prompt["prompt"]
            else:
                raise ValueError(f"{where}: a prompt dict needs 'prompt' or 'prompt_token_ids'")
        elif isinstance(prompt, (list, tuple)):
            token_ids = self._check_ids(where, prompt)
        else:
            text = prompt
        if token_ids is None:
            if not isinstance(text, str):
                raise ValueError(
                    f"{where}: a prompt must be a string, token ids or a dict, got {type(text).__name__}"
                )
            if not text:
                raise ValueError(f"{where}: the prompt is empty")
        features: list[MultiModalFeatureSpec] = []
        if self.mm_processor is not None:
            token_ids, features = self._process_mm(where, text, token_ids, mm_data, mm_kwargs)
        else:
            if mm_data or mm_kwargs:
                kinds = sorted(mm_data) if isinstance(mm_data, Mapping) else "mm_processor_kwargs"
                raise ValueError(f"{where}: this model takes text only; got multimodal input {kinds}")
            if token_ids is None:
                token_ids = self.tokenizer.encode(text)
        if not token_ids:
            raise ValueError(f"{where}: the prompt is empty")
        if cache_salt is not None:
            features = [replace(f, identifier=salt_identifier(f.identifier, cache_salt)) for f in features]
        if truncate_prompt_tokens is not None:
            token_ids, features = self._truncate(where, token_ids, features, truncate_prompt_tokens)
        if len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"{where}: the prompt has {len(token_ids)} tokens; the context holds "
                f"{self.max_model_len} (max_model_len), which leaves no room to generate"
            )
        return ProcessedInputs(text, token_ids, features, cache_salt)

    def _truncate(
        self, where: str, token_ids: list[int], features: list[MultiModalFeatureSpec], truncate: int
    ) -> tuple[list[int], list[MultiModalFeatureSpec]]:
        """The last ``kept_prompt_tokens`` of the prompt, its items' offsets moved with them. A cut
        that drops any part of an item is refused: an item is encoded whole, and dropping one would
        change what the prompt refers to."""
        cut = len(token_ids) - kept_prompt_tokens(len(token_ids), truncate, self.max_model_len)
        if cut <= 0:
            return token_ids, features
        for i, f in enumerate(features):
            if f.mm_position.offset < cut:
                start, end = f.mm_position.offset, f.mm_position.offset + f.mm_position.length
                raise ValueError(
                    f"{where}: truncate_prompt_tokens={truncate} keeps the last {len(token_ids) - cut} of "
                    f"{len(token_ids)} prompt tokens, which cuts {f.modality} item {i} (prompt positions "
                    f"{start}..{end - 1}); multimodal items must be kept whole"
                )
        moved = [replace(f, mm_position=replace(f.mm_position, offset=f.mm_position.offset - cut)) for f in features]
        return token_ids[cut:], moved

    def _check_ids(self, where: str, ids: Any) -> list[int]:
        if not isinstance(ids, (list, tuple)):
            raise ValueError(f"{where}: prompt_token_ids must be a list of ints, got {type(ids).__name__}")
        bad = [t for t in ids if not _is_token_id(t, self.vocab_size)]
        if bad:
            raise ValueError(f"{where}: prompt token ids must be integers in [0, {self.vocab_size}), got {bad[:5]}")
        return [int(t) for t in ids]

    def _process_mm(
        self, where: str, text: str | None, token_ids: list[int] | None, mm_data: Any, mm_kwargs: Any
    ) -> tuple[list[int], list[MultiModalFeatureSpec]]:
        if mm_data is not None and not isinstance(mm_data, Mapping):
            raise ValueError(f"{where}: multi_modal_data must be a dict of modality -> item(s)")
        inputs: dict[str, Any] = {"multi_modal_data": mm_data, "mm_processor_kwargs": mm_kwargs}
        if token_ids is not None:
            inputs["prompt_token_ids"] = token_ids
        else:
            inputs["prompt"] = text
        try:
            out = self.mm_processor.process(inputs)
        except (ValueError, TypeError, OSError) as exc:  # the processor's errors name the item
            raise ValueError(f"{where}: {exc}") from None
        return out.prompt_token_ids, out.mm_features

    # -- chat ------------------------------------------------------------------

    def chat_prompt(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        mm_processor_kwargs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> dict[str, Any]:
        """A prompt dict for a conversation: the rendered text, its token ids
        (the template holds any BOS, so none is added) and the media of its
        content parts as ``multi_modal_data``."""
        # Parts of a modality the model does not take are refused there, before they are read.
        template_messages, mm_data = split_chat_media(messages, self.input_modalities)
        text = self.render_chat(template_messages, add_generation_prompt, **kwargs)
        token_ids = self.tokenizer.encode(text, add_special_tokens=False)
        prompt: dict[str, Any] = {"prompt": text, "prompt_token_ids": token_ids}
        if mm_data:
            prompt["multi_modal_data"] = mm_data
        if mm_processor_kwargs:
            prompt["mm_processor_kwargs"] = mm_processor_kwargs
        return prompt

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any) -> str:
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise ValueError("the tokenizer has no chat template")
        try:
            return self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
            )
        except jinja2.TemplateError as exc:  # the template refused the conversation (raise_exception, a missing key)
            raise ValueError(f"the chat template cannot render these messages: {exc}") from None


def kept_prompt_tokens(num_tokens: int, truncate: int | None, max_model_len: int) -> int:
    """How many of a prompt's ``num_tokens`` ``SamplingParams.truncate_prompt_tokens`` keeps
    (-1: what the context holds with room for one generated token)."""
    if truncate is None:
        return num_tokens
    return min(num_tokens, max_model_len - 1 if truncate == -1 else truncate)


def _is_token_id(t: object, vocab_size: int) -> bool:
    # Any integer type (NumPy's too, as a tokenizer's arrays hold them), never a bool.
    return isinstance(t, numbers.Integral) and not isinstance(t, bool) and 0 <= t < vocab_size
