"""Sampling parameters, with vLLM's field names."""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

# Bounds the engine can represent and honour. Counts and token ids are held in
# int32/int64 tensors and numpy arrays, floats in float32; a Python int past
# them would raise OverflowError inside a step instead of at admission.
INT32_MAX = 2**31 - 1
FLOAT32_MAX = 3.4028234663852886e38
FLOAT32_TINY = 1.1754943508222875e-38  # smallest positive normal float32
MAX_N = 128  # OpenAI's limit for n
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1  # what torch.Generator.manual_seed accepts
# Below this temperature a request is greedy, as in vLLM: dividing logits by a
# smaller value overflows float32.
GREEDY_TEMPERATURE_EPS = 1e-5


def _is_int(v: Any) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _is_real(v: Any) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


def _int_in(v: Any, lo: int, hi: int) -> bool:
    return _is_int(v) and lo <= v <= hi


def _float_in(v: Any, lo: float, hi: float, lo_open: bool = False) -> bool:
    """``v`` is a real number in ``[lo, hi]`` (``(lo, hi]`` with ``lo_open``); NaN never is."""
    if not _is_real(v) or not math.isfinite(v):
        return False
    return (lo < v if lo_open else lo <= v) and v <= hi


def _token_ids_ok(ids: Any, non_empty: bool = False) -> bool:
    return isinstance(ids, list) and (bool(ids) or not non_empty) and all(_int_in(t, 0, INT32_MAX) for t in ids)


def _token_key(k: Any) -> Any:
    """A logit_bias key as a token id: decimal strings (JSON object keys) become ints; anything else
    is left for validation to refuse."""
    if isinstance(k, str) and k.strip().lstrip("+-").isdecimal():
        return int(k)
    return k


def _bad_bias_entry(logit_bias: Any) -> str | None:
    """The first entry of ``logit_bias`` that is no token id -> bias in OpenAI's range (the whole
    of it when it is no dict); None when every entry is."""
    if not isinstance(logit_bias, dict):
        return repr(logit_bias)
    for token, bias in logit_bias.items():
        if not _int_in(token, 0, INT32_MAX) or not _float_in(bias, -100.0, 100.0):
            return f"{token!r}: {bias!r}"
    return None


def _listed(v: Any) -> Any:
    """A list of ``v``'s items (``[]`` for None); anything else is left for validation to refuse."""
    if v is None:
        return []
    return list(v) if isinstance(v, Iterable) and not isinstance(v, (str, bytes)) else v


@dataclass
class SamplingParams:
    """How to pick tokens for one request and when to stop.

    Validation runs at construction (and again when a request joins the
    worker's batch, see :meth:`validate`): a bad value raises ``ValueError``
    naming the field, what was expected and what came, before the request
    reaches the engine. Every numeric field is bounded to what the engine's
    tensors hold; limits that depend on the model (``top_k`` or ``logprobs``
    against the vocabulary, ``max_tokens`` against the context) are the
    engine's to check.

    Penalties follow vLLM: ``repetition_penalty`` (as in ``transformers``:
    a seen token's logit is divided by it when positive, multiplied when
    negative) counts the prompt and the output; ``presence_penalty`` and
    ``frequency_penalty`` (OpenAI's definitions, subtracted from the logit
    once, or once per occurrence) count the output only.
    ``suppress_token_ids`` are never sampled; with ``allowed_token_ids`` set,
    only those are. ``logit_bias`` adds its value to each listed token's logit
    before the penalties (as vLLM, and ``transformers``' ``sequence_bias``);
    token ids may come as decimal strings, as in OpenAI's JSON. Penalties,
    biases and token rules shape what is sampled; the reported logprobs stay
    those of the model's raw distribution. ``prompt_logprobs`` asks for each
    prompt token's logprob at the position before it (none for the first)
    with the top-N there; such a request reads no prefix from the KV cache,
    whose hits skip those positions (as in vLLM). ``truncate_prompt_tokens``
    keeps only the prompt's last ``k`` tokens (-1: as many as the context
    holds with room for one more), so a prompt longer than the context is
    served from its end; no part of a multimodal item may be cut off.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k filtering
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to the model's context length
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)  # extra stop tokens besides EOS
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs besides the sampled token's
    prompt_logprobs: int | None = None  # per prompt token after the first: its logprob and the top-N
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    repetition_penalty: float = 1.0  # 1: off
    presence_penalty: float = 0.0  # 0: off
    frequency_penalty: float = 0.0  # 0: off
    suppress_token_ids: list[int] = field(default_factory=list)  # never sampled
    allowed_token_ids: list[int] | None = None  # None: every token may be sampled
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit (OpenAI's range, -100..100)
    truncate_prompt_tokens: int | None = None  # keep the prompt's last k tokens (-1: what the context holds)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = _listed(self.stop)
        self.stop_token_ids = _listed(self.stop_token_ids)
        self.suppress_token_ids = _listed(self.suppress_token_ids)
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = _listed(self.allowed_token_ids)
        if isinstance(self.logit_bias, Mapping):
            self.logit_bias = {_token_key(k): v for k, v in self.logit_bias.items()}
        if self.top_k == -1:
            self.top_k = 0
        self.validate()

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first field out of range.

        Safe to call again on an instance that was changed after
        construction; the worker does so before a request gets a batch row.
        """
        seed_max = SEED_MAX - (int(self.n) - 1 if _int_in(self.n, 1, MAX_N) else 0)
        checks = [
            ("n", _int_in(self.n, 1, MAX_N), f"an integer in [1, {MAX_N}]"),
            ("temperature", _float_in(self.temperature, 0.0, FLOAT32_MAX), "a finite float >= 0"),
            ("top_p", _float_in(self.top_p, 0.0, 1.0, lo_open=True), "a float in (0, 1]"),
            ("top_k", _int_in(self.top_k, -1, INT32_MAX), f"0, -1 (disabled) or an integer in [1, {INT32_MAX}]"),
            ("min_p", _float_in(self.min_p, 0.0, 1.0), "a float in [0, 1]"),
            (
                "seed",
                self.seed is None or _int_in(self.seed, SEED_MIN, seed_max),
                f"None or an integer in [{SEED_MIN}, {seed_max}] (completion i of n uses seed + i)",
            ),
            (
                "max_tokens",
                self.max_tokens is None or _int_in(self.max_tokens, 1, INT32_MAX),
                f"None or an integer in [1, {INT32_MAX}]",
            ),
            ("min_tokens", _int_in(self.min_tokens, 0, INT32_MAX), f"an integer in [0, {INT32_MAX}]"),
            ("ignore_eos", isinstance(self.ignore_eos, bool), "a bool"),
            ("include_stop_str_in_output", isinstance(self.include_stop_str_in_output, bool), "a bool"),
            ("skip_special_tokens", isinstance(self.skip_special_tokens, bool), "a bool"),
            (
                "logprobs",
                self.logprobs is None or _int_in(self.logprobs, 0, INT32_MAX),
                f"None or an integer in [0, {INT32_MAX}]",
            ),
            (
                "prompt_logprobs",
                self.prompt_logprobs is None or _int_in(self.prompt_logprobs, 0, INT32_MAX),
                f"None or an integer in [0, {INT32_MAX}]",
            ),
            (
                "truncate_prompt_tokens",
                self.truncate_prompt_tokens is None
                or (_int_in(self.truncate_prompt_tokens, -1, INT32_MAX) and self.truncate_prompt_tokens != 0),
                f"None, -1 (as many as the context holds) or an integer in [1, {INT32_MAX}]",
            ),
            (
                "repetition_penalty",
                _float_in(self.repetition_penalty, FLOAT32_TINY, FLOAT32_MAX),
                "a float > 0 that float32 holds (about 1.2e-38 to 3.4e38); 1 is off",
            ),
            ("presence_penalty", _float_in(self.presence_penalty, -2.0, 2.0), "a float in [-2, 2]"),
            ("frequency_penalty", _float_in(self.frequency_penalty, -2.0, 2.0), "a float in [-2, 2]"),
            (
                "stop",
                isinstance(self.stop, list) and all(isinstance(s, str) and s for s in self.stop),
                "a string or a list of non-empty strings",
            ),
            ("stop_token_ids", _token_ids_ok(self.stop_token_ids), f"a list of integers in [0, {INT32_MAX}]"),
            ("suppress_token_ids", _token_ids_ok(self.suppress_token_ids), f"a list of integers in [0, {INT32_MAX}]"),
            (
                "allowed_token_ids",
                self.allowed_token_ids is None or _token_ids_ok(self.allowed_token_ids, non_empty=True),
                f"None or a non-empty list of integers in [0, {INT32_MAX}]",
            ),
        ]
        for name, ok, expected in checks:
            if not ok:
                raise ValueError(f"SamplingParams.{name} must be {expected}, got {getattr(self, name)!r}")
        bad = None if self.logit_bias is None else _bad_bias_entry(self.logit_bias)
        if bad is not None:
            raise ValueError(
                f"SamplingParams.logit_bias must be None or a dict of token ids in [0, {INT32_MAX}] to floats "
                f"in [-100, 100], got {bad}"
            )
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"SamplingParams.min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})"
            )

    def check_vocab(self, vocab_size: int, eos_token_ids: Sequence[int] = ()) -> None:
        """Raise ``ValueError`` for the limits that depend on the model's vocabulary.

        ``top_k`` past the vocabulary keeps every token and out-of-vocabulary
        stop or suppressed ids never match, so only these are refused: logprobs
        past the vocabulary, and token rules that leave no token to sample (the
        allowed ids all suppressed; with ``min_tokens``, which keeps the model's
        ``eos_token_ids`` and the stop ids from its first tokens, those too).
        """
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and value > vocab_size:
                raise ValueError(f"SamplingParams.{name} ({value}) exceeds the vocabulary size {vocab_size}")
        if self.logit_bias:
            bad = sorted(t for t in self.logit_bias if t >= vocab_size)
            if bad:
                raise ValueError(
                    f"SamplingParams.logit_bias must name ids below the vocabulary size {vocab_size}, got {bad[:8]}"
                )
        if self.allowed_token_ids is not None:
            bad = [t for t in self.allowed_token_ids if t >= vocab_size]
            if bad:
                raise ValueError(
                    f"SamplingParams.allowed_token_ids must be ids below the vocabulary size {vocab_size}, "
                    f"got {bad[:8]}"
                )
            if not set(self.allowed_token_ids) - set(self.suppress_token_ids):
                raise ValueError(
                    "SamplingParams.allowed_token_ids are all in suppress_token_ids: no token could be sampled"
                )
        if self.min_tokens > 0:
            banned = set(self.suppress_token_ids) | set(self.stop_token_ids)
            if not self.ignore_eos:
                banned |= set(eos_token_ids)
            if self.allowed_token_ids is not None:
                left = bool(set(self.allowed_token_ids) - banned)
            else:
                left = len({t for t in banned if t < vocab_size}) < vocab_size
            if not left:
                raise ValueError(
                    f"SamplingParams.min_tokens ({self.min_tokens}) keeps the end-of-sequence and stop tokens from "
                    "the first tokens, and the token rules (allowed_token_ids / suppress_token_ids) allow no other"
                )

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE_EPS

    @property
    def has_penalties(self) -> bool:
        """Any of the penalties that read the request's token history is on."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
