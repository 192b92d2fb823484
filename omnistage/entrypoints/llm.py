"""Offline inference: ``LLM(...).generate(prompts)`` and ``.chat(messages)``, for every kind of model."""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator, Sequence
from typing import Any

from omnistage.engine.arg_utils import EngineArgs
from omnistage.engine.factory import Engine, build_engine
from omnistage.engine.omni.qwen2_5_omni import OmniOptions
from omnistage.engine.stage_engine import EngineStats, PromptType
from omnistage.entrypoints.progress import ProgressBar
from omnistage.outputs import RequestOutput, StreamOutput
from omnistage.sampling_params import SamplingParams

Conversation = list[dict[str, Any]]


class LLM:
    """A model and its engine, for batch generation in this process.

    ``model`` is a checkpoint folder or GGUF file (None: the embedded default,
    SmolLM2-135M-Instruct), or a model already loaded (``OmniModel``,
    ``LoadedModel``) whose weights the engine shares. Other keyword arguments
    are :class:`EngineArgs` fields (``max_num_seqs``, ``enable_prefix_caching``,
    ``num_kv_blocks``, ...) and, for an omni checkpoint (thinker + talker +
    token2wav), the :class:`OmniOptions` fields (``talker_params``,
    ``enable_tensor_prefix_cache``, ``talker_max_num_seqs``, ...).

    Every kind of model has the same methods, arguments and defaults; an omni
    checkpoint also speaks: ``generate`` and ``chat`` take ``return_audio``
    (None: speak when the model can), ``speaker`` and ``talker_params``, and
    fill ``RequestOutput.audio`` (1-D float32) and ``.sample_rate``.
    """

    def __init__(self, model: Any = None, **kwargs: Any) -> None:
        options, engine_kwargs = OmniOptions.split(kwargs)
        loaded = None
        if isinstance(model, os.PathLike):
            model = os.fspath(model)
        elif model is not None and not isinstance(model, str):  # a model already loaded
            loaded = model
            model = getattr(getattr(model, "thinker", model), "model_path", None)
        args = EngineArgs(model=model, **engine_kwargs)
        self.llm_engine: Engine = build_engine(args, options, loaded)
        self._ids = itertools.count()

    def get_tokenizer(self) -> Any:
        return self.llm_engine.tokenizer

    def get_stats(self) -> EngineStats:
        return self.llm_engine.get_stats()

    @property
    def output_modalities(self) -> frozenset[str]:
        return self.llm_engine.output_modalities

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        *,
        return_audio: bool | None = None,
        speaker: str | None = None,
        talker_params: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Complete each prompt; outputs come back in input order.

        A prompt is a string, a list of token ids, or a dict with ``prompt``
        or ``prompt_token_ids``; pass one or a list of them. For a multimodal
        model the dict may hold ``multi_modal_data`` (``{"image": PIL image or
        list, "video": frames or list, "audio": (waveform, rate) or list}``)
        and ``mm_processor_kwargs``; the prompt text holds one placeholder per
        item (e.g. ``<|vision_start|><|image_pad|><|vision_end|>``).
        Every prompt is processed before any is queued, so a bad item raises
        ``ValueError`` (naming the prompt's request id and the item) with the
        engine untouched.

        Omni checkpoints: ``sampling_params`` apply to the thinker, whose
        answer is ``outputs[0].text``; with ``return_audio`` (default: when
        the model can speak) ``audio`` is the spoken answer, in ``speaker``'s
        voice (None: the checkpoint's default), with ``talker_params``
        overriding the talker's sampling for this call.
        """
        return self._run(_as_prompt_list(prompts), sampling_params, use_tqdm, return_audio, speaker, talker_params)

    def generate_stream(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        return_audio: bool | None = None,
        speaker: str | None = None,
        talker_params: dict[str, Any] | None = None,
    ) -> Iterator[StreamOutput]:
        """``generate``, as it happens: a ``StreamOutput`` each time a request's
        text grows or a chunk of its audio is made, then its finished output.

        Audio is decoded in the vocoder's streaming chunks while the talker
        speaks (``new_audio_chunks``; concatenated, they are the finished
        output's ``audio``). For Qwen2.5-Omni that chunked decode is its
        authors' streaming schedule, close to but not equal to ``generate``'s
        whole decode (see docs/omni_pipeline.md). Leaving the loop early (or
        an error) aborts the requests still running, freeing every stage.
        """
        prompt_list = _as_prompt_list(prompts)
        return self._stream(prompt_list, sampling_params, return_audio, speaker, talker_params, stream_audio=True)

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
        mm_processor_kwargs: dict[str, Any] | None = None,
        *,
        return_audio: bool | None = None,
        speaker: str | None = None,
        talker_params: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Answer one conversation (a list of ``{"role", "content"}``) or a list
        of conversations, rendered with the checkpoint's chat template.

        ``content`` is a string or a list of OpenAI-style parts: ``text``,
        ``image_url`` (data URL or local path), ``input_audio`` (base64 WAV),
        and for convenience ``image`` / ``audio`` / ``video`` parts holding the
        decoded item (see ``omnistage.multimodal.chat``). The audio options
        are ``generate``'s."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        engine = self.llm_engine
        kwargs = chat_template_kwargs or {}
        prompts = [engine.encode_chat(c, add_generation_prompt, mm_processor_kwargs, **kwargs) for c in conversations]
        return self._run(prompts, sampling_params, use_tqdm, return_audio, speaker, talker_params)

    def _run(
        self,
        prompts: list[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
        use_tqdm: bool,
        return_audio: bool | None,
        speaker: str | None,
        talker_params: dict[str, Any] | None,
    ) -> list[RequestOutput]:
        results: list[RequestOutput | None] = [None] * len(prompts)
        bar = ProgressBar(len(prompts)) if use_tqdm else None
        try:
            for event in self._stream(prompts, sampling_params, return_audio, speaker, talker_params):
                if bar is not None:
                    bar.update(event.output)
                if event.finished:
                    results[event.index] = event.output
        finally:
            if bar is not None:
                bar.close()
        return [r for r in results if r is not None]

    def _stream(
        self,
        prompts: list[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
        return_audio: bool | None,
        speaker: str | None,
        talker_params: dict[str, Any] | None,
        stream_audio: bool = False,
    ) -> Iterator[StreamOutput]:
        """Queue every prompt (all or none), then step the engine, yielding what changed."""
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"got {len(params)} sampling_params for {len(prompts)} prompts; pass one or one each")
        engine = self.llm_engine
        speaks = "audio" in self.output_modalities
        if not speaks and (return_audio or speaker is not None or talker_params):
            raise ValueError("this model cannot return audio: return_audio, speaker and talker_params need an omni checkpoint with a talker")
        audio: dict[str, Any] = {}
        if speaks:
            audio = {"return_audio": return_audio, "speaker": speaker, "talker_params": talker_params,
                     "stream_audio": stream_audio}  # fmt: skip
        request_ids = [str(next(self._ids)) for _ in prompts]
        # Tokenize and process media first: a bad prompt raises before anything is queued.
        processed = [
            engine.process_inputs(rid, prompt, sp.truncate_prompt_tokens)
            for rid, prompt, sp in zip(request_ids, prompts, params)
        ]
        order: dict[str, int] = {}
        try:
            for i, (request_id, inputs, sp) in enumerate(zip(request_ids, processed, params)):
                engine.add_request(request_id, inputs, sp, **audio)
                order[request_id] = i
        except ValueError:
            engine.abort_request(list(order))  # leave the engine as it was
            raise
        chunks_seen: dict[str, int] = {}
        unfinished = set(order)
        try:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.request_id not in order:
                        continue
                    if out.error is not None:
                        raise RuntimeError(out.error)
                    seen = chunks_seen.get(out.request_id, 0)
                    new_chunks = list(out.audio_chunks[seen:]) if out.audio_chunks else []
                    chunks_seen[out.request_id] = seen + len(new_chunks)
                    if out.finished:
                        unfinished.discard(out.request_id)
                    yield StreamOutput(order[out.request_id], out, new_chunks)
        finally:  # an error, or a caller that left the loop (GeneratorExit): free what is still running
            if unfinished:
                engine.abort_request(list(unfinished))


def _as_prompt_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # one prompt given as token ids
    return prompts

