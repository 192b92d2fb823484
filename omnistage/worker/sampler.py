"""Token sampling for one step, batched over every request that samples.

Logit biases, penalties, suppressed tokens, min_tokens masking, greedy,
temperature, top-k, top-p and min-p run as one vectorized pass over the
``[S, V]`` logits, with no full sort of the vocabulary (a 49k-token sort
per row cost more than a decode step). A draw is one uniform number per
row, mapped through the row's cumulative weights (:func:`draw_rows`), so a
seeded request draws from its own generator and gets the same tokens
whatever else is in the batch; that per-row uniform is the only loop over
requests.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from omnistage.kernels.argmax import first_argmax
from omnistage.sampling_params import SamplingParams
from omnistage.worker.penalties import PenaltyMetadata, TokenHistory, TokenMask

if TYPE_CHECKING:
    from omnistage.worker.input_batch import InputBatch

_NEG_INF = float("-inf")


@dataclass
class SamplingMetadata:
    """Sampling settings of the ``S`` rows that sample this step, as tensors.

    Optional tensors are ``None`` when no row in the step uses that filter,
    so the common all-greedy step is one argmax.
    """

    temperature: torch.Tensor | None  # [S] fp32; None when every row is greedy
    greedy: torch.Tensor | None  # [S] bool; None when all greedy or none greedy
    all_greedy: bool
    top_k: torch.Tensor | None  # [S] int64, 0 = off
    top_p: torch.Tensor | None  # [S] fp32, 1.0 = off
    min_p: torch.Tensor | None  # [S] fp32, 0.0 = off
    generators: dict[int, torch.Generator] = field(default_factory=dict)  # row -> per-request RNG
    num_logprobs: list[int] | None = None  # per row, -1 = not asked; None when no row asks
    # (row, token) pairs whose logits are forced to -inf (min_tokens holds back EOS / stop ids).
    banned_rows: torch.Tensor | None = None
    banned_tokens: torch.Tensor | None = None
    penalties: PenaltyMetadata | None = None  # repetition / presence / frequency, rows that have any
    token_mask: TokenMask | None = None  # suppressed / not-allowed tokens, rows that have any
    # (row, token, bias) triples added to the logits (logit_bias), rows that have any.
    bias_rows: torch.Tensor | None = None
    bias_tokens: torch.Tensor | None = None
    bias_values: torch.Tensor | None = None

    @property
    def plain_greedy(self) -> bool:
        """Every row takes the argmax of its raw logits: greedy, no logprobs, no logit rule."""
        return (
            self.all_greedy
            and self.num_logprobs is None
            and self.banned_rows is None
            and self.penalties is None
            and self.token_mask is None
            and self.bias_rows is None
        )


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [S] int64
    sampled_logprobs: torch.Tensor | None = None  # [S] fp32, raw-logit log-softmax
    topk_token_ids: torch.Tensor | None = None  # [S, N]
    topk_logprobs: torch.Tensor | None = None  # [S, N]


class Sampler:
    """Turns ``[S, V]`` logits into one token per row.

    Logprobs are those of the model's raw distribution (log-softmax of the
    logits before penalties, masking, temperature or filtering), as vLLM and
    ``transformers`` report them.
    """

    def __call__(
        self, logits: torch.Tensor, md: SamplingMetadata, default_generator: torch.Generator | None = None
    ) -> SamplerOutput:
        logits = logits.float()
        raw_logprobs = torch.log_softmax(logits, dim=-1) if md.num_logprobs is not None else None
        logits = self.apply_logit_rules(logits, md)
        if md.all_greedy:
            sampled = first_argmax(logits)
        else:
            sampled = self._sample_random(logits, md, default_generator)
            if md.greedy is not None:
                sampled = torch.where(md.greedy, first_argmax(logits), sampled)
        out = SamplerOutput(sampled_token_ids=sampled)
        if raw_logprobs is not None:
            out.sampled_logprobs = raw_logprobs.gather(1, sampled.unsqueeze(1)).squeeze(1)
            n = max(md.num_logprobs)
            if n > 0:
                out.topk_logprobs, out.topk_token_ids = raw_logprobs.topk(n, dim=-1)
        return out

    @staticmethod
    def apply_logit_rules(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        """Logit biases, penalties, suppressed / allowed tokens and min_tokens bans on fp32 ``logits``."""
        # transformers' order (SequenceBias, RepetitionPenalty, SuppressTokens, MinNewTokens),
        # vLLM's too, with its frequency and presence penalties right after the repetition penalty.
        if md.bias_rows is not None:
            logits = logits.index_put((md.bias_rows, md.bias_tokens), md.bias_values, accumulate=True)
        if md.penalties is not None:
            logits = md.penalties.apply(logits)
        if md.token_mask is not None:
            logits = md.token_mask.apply(logits)
        if md.banned_rows is not None:
            neg_inf = torch.full((), _NEG_INF, device=logits.device)
            logits = logits.index_put((md.banned_rows, md.banned_tokens), neg_inf)
        return logits

    @staticmethod
    def target_probs(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        """The distribution a random row samples from: temperature, top-k/top-p,
        softmax, min-p (zeroed, not renormalized: draws only need weights)."""
        assert md.temperature is not None
        # Greedy rows get temperature 1 here; their argmax replaces the draw.
        temp = torch.where(md.temperature > 0, md.temperature, torch.ones_like(md.temperature))
        logits = logits / temp.unsqueeze(1)
        logits = apply_top_k_top_p(logits, md.top_k, md.top_p)
        probs = torch.softmax(logits, dim=-1)
        if md.min_p is not None:
            cutoff = md.min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
            probs = probs.masked_fill(probs < cutoff, 0.0)
        return probs

    @staticmethod
    def _sample_random(
        logits: torch.Tensor, md: SamplingMetadata, default_generator: torch.Generator | None
    ) -> torch.Tensor:
        probs = Sampler.target_probs(logits, md)
        u = torch.empty(probs.shape[0], dtype=torch.float64, device=probs.device)
        if len(md.generators) < u.shape[0]:
            u.uniform_(generator=default_generator)
        for row, gen in md.generators.items():
            u[row] = uniform(gen, probs.device)
        return draw_rows(probs, u)


def uniform(generator: torch.Generator | None, device: torch.device) -> torch.Tensor:
    """One float64 number in [0, 1) from ``generator``: a row's whole draw."""
    return torch.rand((), dtype=torch.float64, generator=generator, device=device)


def draw_rows(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Each row's token from unnormalized non-negative ``[S, V]`` weights and its uniform
    ``u`` (``[S]``, float64 in [0, 1)): the first token whose cumulative weight exceeds
    ``u`` times the row's total (inverse-CDF sampling, in float64), never a zero weight."""
    cum = weights.double().cumsum(dim=-1)
    total = cum[:, -1:].contiguous()
    ids = torch.searchsorted(cum, u.unsqueeze(1) * total, right=True)
    # u * total rounds up to the total once in about 2^53 draws: then the last token with weight,
    # the first whose cumulative weight reaches the total (a binary search, not another pass).
    # A row with no weight at all (NaN logits from the model) would get the id past the
    # vocabulary, which fails the whole batch's next step: its last token instead.
    return torch.minimum(ids, torch.searchsorted(cum, total)).clamp_(max=weights.shape[-1] - 1).squeeze(1)


# The first top-p window: most rows' nucleus (p <= 0.95, temperature <= 1) lies in their few hundred
# likeliest tokens; a row it does not cover widens the window fourfold.
_TOP_P_WINDOW = 256


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """Mask logits outside each row's top-k and top-p sets to -inf, without sorting the vocabulary.

    Top-k masks below the row's k-th largest logit. Top-p keeps the likeliest tokens while
    the mass of those before each is below ``p`` (the likeliest always): found in the row's
    largest probabilities, a partial top-k widened until it holds mass ``p``. Tokens tied
    with the last one kept stay too.
    """
    vocab = logits.shape[-1]
    if top_k is not None:
        on = top_k > 0
        k = torch.where(on, top_k.clamp(max=vocab), torch.ones_like(top_k))
        values = logits.topk(int(k.max()), dim=-1).values
        kth = values.gather(1, (k - 1).unsqueeze(1))
        kth = torch.where(on.unsqueeze(1), kth, torch.full_like(kth, _NEG_INF))
        logits = logits.masked_fill(logits < kth, _NEG_INF)
    if top_p is None:
        return logits
    probs = logits.softmax(dim=-1)
    off = top_p >= 1.0
    width = min(vocab, _TOP_P_WINDOW)
    while True:
        top = probs.topk(width, dim=-1).values  # descending
        mass = top.cumsum(dim=-1)
        if width == vocab or bool(((mass[:, -1] >= top_p) | off).all()):
            break
        width = min(vocab, width * 4)
    kept = 1 + (mass[:, :-1] < top_p.unsqueeze(1)).sum(dim=-1)
    cutoff = top.gather(1, (kept - 1).unsqueeze(1))
    cutoff = torch.where(off.unsqueeze(1), torch.zeros_like(cutoff), cutoff)
    return logits.masked_fill(probs < cutoff, _NEG_INF)


class SamplingState:
    """Per-row sampling settings, mirrored from the persistent batch's rows.

    Kept as numpy arrays indexed by row so a step's metadata is a handful of
    fancy-indexing operations rather than a loop over SamplingParams. The
    owner calls :meth:`set_row` whenever a row gets a (new) request, including
    when the batch moves its last row into a freed hole.

    Penalties read the row's tokens from the batch itself when it samples
    (``TokenHistory``); suppressed / allowed tokens are a ``[rows, V]`` mask
    written by :meth:`set_row`. Both tensors exist only once a request uses
    them, and a step whose rows use neither builds none of their metadata.
    """

    def __init__(self, max_num_reqs: int, vocab_size: int, eos_token_ids: list[int], device: torch.device) -> None:
        self.device = device
        self.max_num_reqs = max_num_reqs
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.temperature = np.zeros(max_num_reqs, dtype=np.float32)
        self.top_k = np.zeros(max_num_reqs, dtype=np.int64)
        self.top_p = np.ones(max_num_reqs, dtype=np.float32)
        self.min_p = np.zeros(max_num_reqs, dtype=np.float32)
        self.min_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_logprobs = np.full(max_num_reqs, -1, dtype=np.int64)
        self.num_prompt_logprobs = np.full(max_num_reqs, -1, dtype=np.int64)  # -1: not asked (read by the runner)
        self.seeded = np.zeros(max_num_reqs, dtype=bool)
        self.banned: list[list[int]] = [[] for _ in range(max_num_reqs)]
        self.repetition_penalty = np.ones(max_num_reqs, dtype=np.float32)
        self.presence_penalty = np.zeros(max_num_reqs, dtype=np.float32)
        self.frequency_penalty = np.zeros(max_num_reqs, dtype=np.float32)
        self.penalized = np.zeros(max_num_reqs, dtype=bool)
        self.history = TokenHistory(max_num_reqs, vocab_size, device)
        self.masked = np.zeros(max_num_reqs, dtype=bool)  # row has suppressed / allowed tokens
        self.token_mask: torch.Tensor | None = None  # [max_num_reqs, V] bool, True = never sampled
        self.bias: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # row -> its logit_bias (ids, values)

    def set_row(self, row: int, params: SamplingParams) -> None:
        """Mirror ``params`` into ``row``. Raises ``ValueError`` naming the
        field, with nothing written, when a value does not fit."""
        params.validate()
        never = self._never_sampled(params)
        self.temperature[row] = 0.0 if params.greedy else params.temperature
        self.top_k[row] = max(params.top_k, 0)
        self.top_p[row] = params.top_p
        self.min_p[row] = params.min_p
        self.min_tokens[row] = params.min_tokens
        self.num_logprobs[row] = -1 if params.logprobs is None else params.logprobs
        self.num_prompt_logprobs[row] = -1 if params.prompt_logprobs is None else params.prompt_logprobs
        self.seeded[row] = params.seed is not None
        if params.min_tokens > 0:
            eos = [] if params.ignore_eos else self.eos_token_ids
            self.banned[row] = sorted(t for t in set(eos) | set(params.stop_token_ids) if 0 <= t < self.vocab_size)
        else:
            self.banned[row] = []
        self.repetition_penalty[row] = params.repetition_penalty
        self.presence_penalty[row] = params.presence_penalty
        self.frequency_penalty[row] = params.frequency_penalty
        self.penalized[row] = params.has_penalties
        if params.has_penalties:
            self.history.reset_row(row)
        bias = {t: b for t, b in (params.logit_bias or {}).items() if t < self.vocab_size}
        if bias:
            self.bias[row] = (np.fromiter(bias, np.int64, len(bias)), np.fromiter(bias.values(), np.float32, len(bias)))
        else:
            self.bias.pop(row, None)
        self.masked[row] = never is not None
        if never is not None:
            if self.token_mask is None:
                self.token_mask = torch.zeros(self.max_num_reqs, self.vocab_size, dtype=torch.bool, device=self.device)
            self.token_mask[row] = never.to(self.device)

    def _never_sampled(self, params: SamplingParams) -> torch.Tensor | None:
        """``[V]`` bool (CPU), True at the tokens the request may never sample;
        None when it masks nothing. Out-of-vocabulary ids never match a logit
        and are dropped."""
        v = self.vocab_size
        if params.allowed_token_ids is not None:
            allowed = [t for t in set(params.allowed_token_ids) - set(params.suppress_token_ids) if t < v]
            if not allowed:  # refused at admission (SamplingParams.check_vocab); a state built directly
                raise ValueError(
                    f"SamplingParams.allowed_token_ids leaves no token below the vocabulary size {v} "
                    "that is not also suppressed"
                )
            mask = torch.ones(v, dtype=torch.bool)
            mask[allowed] = False
            return mask
        suppressed = [t for t in set(params.suppress_token_ids) if t < v]
        if not suppressed:
            return None
        mask = torch.zeros(v, dtype=torch.bool)
        mask[suppressed] = True
        return mask

    def metadata(
        self, batch: InputBatch, rows: np.ndarray, req_ids: list[str], drafted: list[list[int]] | None = None
    ) -> SamplingMetadata:
        """Metadata for the sampling rows ``rows`` of ``batch`` (batch rows,
        in logits order; ``req_ids`` are their requests).

        ``drafted[i]`` (speculative verification, where a request's row
        repeats once per draft position) are the tokens taken as emitted
        before logits row ``i``: its draft tokens before that position. The
        row's rules then read them as if decoded one by one: min_tokens
        counts them, penalties count them as output."""
        dev = self.device
        temp = self.temperature[rows]
        greedy = temp == 0.0
        all_greedy = bool(greedy.all())
        md = SamplingMetadata(
            temperature=None if all_greedy else torch.from_numpy(temp).to(dev),
            greedy=None if all_greedy or not greedy.any() else torch.from_numpy(greedy).to(dev),
            all_greedy=all_greedy,
            top_k=None,
            top_p=None,
            min_p=None,
        )
        if not all_greedy:
            top_k, top_p, min_p = self.top_k[rows], self.top_p[rows], self.min_p[rows]
            if top_k.any():
                md.top_k = torch.from_numpy(top_k).to(dev)
            if (top_p < 1.0).any():
                md.top_p = torch.from_numpy(top_p).to(dev)
            if min_p.any():
                md.min_p = torch.from_numpy(min_p).to(dev)
            for i in np.flatnonzero(self.seeded[rows] & ~greedy):
                md.generators[int(i)] = batch.generators[req_ids[i]]
        num_logprobs = self.num_logprobs[rows]
        if (num_logprobs >= 0).any():
            md.num_logprobs = num_logprobs.tolist()
        num_output_tokens = batch.num_tokens[rows] - batch.num_prompt_tokens[rows]
        if drafted is not None:
            num_output_tokens = num_output_tokens + np.fromiter(map(len, drafted), dtype=np.int64, count=len(rows))
        held = np.flatnonzero(self.min_tokens[rows] > num_output_tokens)
        pairs = [(int(i), t) for i in held for t in self.banned[rows[i]]]
        if pairs:
            r, t = zip(*pairs)
            md.banned_rows = torch.tensor(r, dtype=torch.int64, device=dev)
            md.banned_tokens = torch.tensor(t, dtype=torch.int64, device=dev)
        pen = self.penalized[rows]
        if pen.any():
            md.penalties = self._penalties(batch, rows, pen, drafted)
        biased = [i for i, row in enumerate(rows.tolist()) if row in self.bias] if self.bias else []
        if biased:
            ids, values = zip(*(self.bias[rows[i]] for i in biased))
            md.bias_rows = torch.from_numpy(np.repeat(biased, [len(t) for t in ids])).to(dev)
            md.bias_tokens = torch.from_numpy(np.concatenate(ids)).to(dev)
            md.bias_values = torch.from_numpy(np.concatenate(values)).to(dev)
        masked = self.masked[rows]
        if masked.any():
            assert self.token_mask is not None
            index, row_t = self._subset(rows, masked)
            md.token_mask = TokenMask(index, self.token_mask.index_select(0, row_t))
        return md

    def _subset(self, rows: np.ndarray, on: np.ndarray) -> tuple[torch.Tensor | None, torch.Tensor]:
        """(positions among the step's rows, or None for all; their batch rows), on the device."""
        index = None if on.all() else torch.from_numpy(np.flatnonzero(on)).to(self.device)
        return index, torch.from_numpy(rows[on]).to(self.device)

    def _penalties(
        self, batch: InputBatch, rows: np.ndarray, pen: np.ndarray, drafted: list[list[int]] | None
    ) -> PenaltyMetadata:
        h = self.history
        # Unique: a verifying request's row repeats, and each of its tokens is counted once.
        h.sync(np.unique(rows[pen]), batch.token_ids_cpu, batch.num_tokens, batch.num_prompt_tokens)
        assert h.output_counts is not None and h.prompt_mask is not None
        index, row_t = self._subset(rows, pen)
        prows = rows[pen]
        output_counts = h.output_counts.index_select(0, row_t)
        if drafted is not None:
            # Each position also counts the drafts before it (its own copy of the row's counts).
            pairs = [(p, t) for p, i in enumerate(np.flatnonzero(pen).tolist()) for t in drafted[i]]
            if pairs:
                at, tokens = zip(*pairs)
                index_t = (torch.tensor(at, device=self.device), torch.tensor(tokens, device=self.device))
                ones = torch.ones(len(at), dtype=output_counts.dtype, device=self.device)
                output_counts.index_put_(index_t, ones, accumulate=True)

        def per_row(values: np.ndarray, neutral: float) -> torch.Tensor | None:
            v = values[prows]
            return torch.from_numpy(v).to(self.device) if (v != neutral).any() else None

        return PenaltyMetadata(
            index=index,
            output_counts=output_counts,
            prompt_mask=h.prompt_mask.index_select(0, row_t),
            repetition=per_row(self.repetition_penalty, 1.0),
            presence=per_row(self.presence_penalty, 0.0),
            frequency=per_row(self.frequency_penalty, 0.0),
        )
