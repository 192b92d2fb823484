"""What the engine hands back to callers, with vLLM's names."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None  # the stop token id or stop string that matched
    logprobs: list[dict[int, float]] | None = None  # per generated token: {token_id: logprob}
    cumulative_logprob: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_cached_tokens: int = 0  # prompt tokens served by the KV prefix cache
    # Speculative decoding, over the request's completions (0 when it is off).
    num_draft_tokens: int = 0  # drafts verified
    num_accepted_tokens: int = 0  # of which accepted
    num_drafts: int = 0  # verify runs (steps that verified drafts)

    @property
    def draft_acceptance_rate(self) -> float | None:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def mean_acceptance_length(self) -> float | None:
        """Tokens emitted per verify run (accepted drafts + the target's token), vLLM's definition."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else None

    @property
    def time_to_first_token(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0
    # SamplingParams.prompt_logprobs: per prompt token, {token_id: logprob} for it and the top-N at the
    # position before it; None for the first token (nothing precedes it). Whole from the first output on.
    prompt_logprobs: list[dict[int, float] | None] | None = None
    # Omni checkpoints: the spoken answer (1-D float32), once complete.
    audio: object | None = None
    sample_rate: int | None = None
    # The spoken answer so far, in the chunks the vocoder made (cumulative like
    # the text: each output holds every chunk so far; ``audio`` is their
    # concatenation once the request is finished). One chunk unless streamed.
    audio_chunks: list | None = None
    extra: dict = field(default_factory=dict)
    # Set when the request failed inside the engine (its step raised); finish_reason is "error".
    error: str | None = None
    # What a pipeline stage hands to the next (vllm-omni's name): per-token
    # rows ("hidden_states"), a vocoder stage's outputs ("audio").
    multimodal_output: dict = field(default_factory=dict)


@dataclass
class StreamOutput:
    """What ``LLM.generate_stream`` yields each time a request's answer grows.

    ``output`` is the request's cumulative output so far (its text, and
    ``audio_chunks`` for an omni checkpoint); ``new_audio_chunks`` are the
    chunks that arrived with it, ready to play in order (1-D float32 at
    ``output.sample_rate``); ``index`` is the prompt's position in the call."""

    index: int
    output: RequestOutput
    new_audio_chunks: list = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.output.finished
