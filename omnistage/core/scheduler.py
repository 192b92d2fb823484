"""Continuous batching: which tokens of which requests run in the next step."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from omnistage.core.config import SchedulerConfig
from omnistage.core.encoder_cache_manager import EncoderCacheManager
from omnistage.core.encoder_scheduler import EncoderPlan, EncoderScheduler
from omnistage.core.kv_cache_manager import KVCacheManager
from omnistage.core.kv_cache_utils import update_block_hashes
from omnistage.core.request import Request, RequestStatus
from omnistage.core.sched_output import CachedRequestData, NewRequestData, SchedulerOutput
from omnistage.core.spec_decode import propose_ngram, take_worker_drafts
from omnistage.core.spec_policy import DraftPolicy
from omnistage.multimodal.inputs import MultiModalFeatureSpec
from omnistage.core.runner_output import ModelRunnerOutput


@dataclass
class SchedulerStats:
    num_running: int
    num_waiting: int
    kv_blocks_used: int
    kv_blocks_total: int
    prefix_cache_query_tokens: int
    prefix_cache_hit_tokens: int
    num_preemptions: int
    num_output_tokens: int = 0  # tokens appended to requests' outputs (none past a stop)
    num_draft_tokens: int = 0  # speculative decoding: drafts verified
    num_accepted_tokens: int = 0  # of which accepted
    num_drafts: int = 0  # verify runs (a request's drafts in one step)
    # Accepted drafts by position in their run (index 0 = first draft); vLLM's per-position counter.
    num_accepted_tokens_per_pos: tuple[int, ...] = ()
    encoder_cache_queries: int = 0  # items a window needed that the request did not hold yet
    encoder_cache_hits: int = 0  # of which cached already (no encoder run)

    @property
    def kv_usage(self) -> float:
        return self.kv_blocks_used / self.kv_blocks_total

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hit_tokens / self.prefix_cache_query_tokens if self.prefix_cache_query_tokens else 0.0


class Scheduler:
    """FCFS continuous batching with chunked prefill and preemption by recompute.

    Each ``schedule()`` spends a budget of ``max_num_batched_tokens`` tokens:
    first on running requests in arrival order (a decode takes one token, an
    unfinished prefill its next chunk), then on waiting requests in arrival
    order, at most ``max_num_seqs`` running. Any prompt may be chunked. A
    waiting request that does not fit blocks the ones behind it, so a long
    prompt is never starved by short ones. The one exception: a request that
    cannot start because its next item is still being encoded on an encoder
    worker is passed over (no head-of-line blocking on a remote encode); it
    keeps its place and is admitted first once the item is published.

    ``num_computed_tokens`` is advanced when a request is *scheduled*, not
    when the step's output comes back: after ``schedule()`` it counts the
    tokens whose KV will exist once the step ran. The ``num_computed_tokens``
    sent to the worker (``NewRequestData``/``CachedRequestData``) is the value
    *before* this step's tokens, where the worker's positions start.

    A request samples a token in the step that computes its last known token
    (``num_computed + scheduled == num_tokens``); partial prefill chunks
    sample nothing.

    When the pool runs out of blocks for a running request, the latest-arrived
    running request is preempted: its blocks are freed (full ones stay cached)
    and it goes back to the front of the waiting queue, to be resumed first
    and recomputed from its prompt plus the tokens generated so far.

    Speculative decoding (``config.speculative_config``): a decode request
    whose parameters the verifier supports (``can_speculate``) gets up to
    ``k`` draft tokens from prompt lookup, scheduled after its last token
    (``1 + drafts`` tokens, KV slots included, within the context length and
    ``max_tokens``). Drafts come last in the step: from the budget and the free
    blocks left once every running request has its tokens and waiting ones
    were admitted, so they never cost another request its token, a preemption
    or a prefill; drafts that do not fit are cut or dropped. The drafts never enter
    ``all_token_ids`` or the block hashes; after the step the accepted ones
    are appended like sampled tokens, one by one through the stop checks, and
    ``num_computed_tokens`` is rolled back past the rejected ones, so the next
    step overwrites their KV slots and only verified blocks are ever cached.
    With a worker-side drafter (``eagle``) the drafts are the ones the worker
    proposed after the request's last step (``draft_token_requests`` asks for
    them, for the requests that sample), and the request's allocation also
    covers, when the pool has it free, the ``k - 1`` slots the drafter writes
    past the last verified token; its encoder plan looks one position ahead
    (see ``EncoderScheduler``).
    How many drafts a request gets is ``DraftPolicy``'s call (its measured
    acceptance against the step's verify cost, see ``core/spec_policy.py``):
    open-ended text stops drafting. Every n-gram proposal is scored in the
    shadow, so a request that stopped drafts again once it copies; a worker
    drafter is asked for the policy's allocation (computed when the request
    samples, for its next step), fed each verified run, and probes a request
    that stopped with back-off (a probe's proposal is scored in the shadow,
    never verified).

    Multimodal items are planned by ``EncoderScheduler`` (see its policy): a
    window may shrink to stop before an item that cannot be encoded this
    step, and encoder-cache entries are taken only once the KV blocks are
    secured, so a request that gets no blocks holds nothing.
    """

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.block_size = config.block_size
        self.kv_cache_manager = KVCacheManager(config.num_kv_blocks, config.block_size, config.enable_prefix_caching)
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        # ``waiting`` is in arrival order; ``running`` in admission order.
        # Admission takes the first admissible waiting request (the head, unless
        # requests ahead wait on an encoder worker) to the tail of ``running``;
        # preemption moves the tail of ``running`` (the latest admitted) back
        # into ``waiting`` at its arrival place. Without encoder workers nothing
        # is ever skipped, so both are in arrival order and that place is the head.
        self.running: list[Request] = []
        self._arrival: dict[str, int] = {}  # request id -> arrival rank, for reinsertion
        self._num_arrived = 0
        self._finished_ids: set[str] = set()  # left since the last schedule(), the worker held them
        self._aborted_ids: set[str] = set()
        self.num_preemptions = 0
        self.num_output_tokens = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.num_drafts = 0
        self._worth_drafting: dict[str, int] = {}  # this step's drafts per request, the policy's allocation
        spec = config.speculative_config
        self.draft_policy: DraftPolicy | None = None
        if spec is not None:  # a drafter's proposals come after the allocation: no word pieces to price
            pieces = frozenset() if spec.uses_drafter else spec.word_piece_ids
            self.draft_policy = DraftPolicy(spec.num_speculative_tokens, word_pieces=pieces)
        self._drafter_ks: dict[str, int] = {}  # this step's worker-drafter asks, decided once per request
        self._lookups: dict[str, list[int]] = {}  # this step's prompt-lookup proposals
        self.accepted_per_pos = [0] * (spec.num_speculative_tokens if spec is not None else 0)
        self.encoder: EncoderScheduler | None = None
        if config.encoder_cache_size > 0:
            manager = EncoderCacheManager(config.encoder_cache_size, config.retain_encoder_outputs)
            self.encoder = EncoderScheduler(manager, config.encoder_compute_budget)

    @property
    def encoder_cache_manager(self) -> EncoderCacheManager | None:
        return self.encoder.manager if self.encoder is not None else None

    # -- requests in and out -------------------------------------------------

    def max_len(self, request: Request) -> int:
        if request.max_model_len is None:
            return self.config.max_model_len
        return min(self.config.max_model_len, request.max_model_len)

    def add_request(self, request: Request) -> None:
        """Queue a request. Raises ValueError, adding nothing, if it can never run."""
        self._validate(request)
        if self.config.enable_prefix_caching:
            update_block_hashes(request, self.block_size)
        self.requests[request.request_id] = request
        self._arrival[request.request_id] = self._num_arrived
        self._num_arrived += 1
        self.waiting.append(request)

    def _validate(self, request: Request) -> None:
        rid = request.request_id
        where = f"request {rid!r}"
        if rid in self.requests:
            raise ValueError(f"{where}: a request with this id is already scheduled; ids must be unique")
        if request.status is not RequestStatus.WAITING or request.num_computed_tokens or request.output_token_ids:
            raise ValueError(
                f"{where}: expected a fresh request (WAITING, nothing computed), got {request.status.name}"
            )
        num_prompt = request.num_prompt_tokens
        if num_prompt == 0:
            raise ValueError(f"{where}: the prompt is empty; expected at least one token")
        max_len = self.max_len(request)
        if num_prompt > max_len:
            raise ValueError(f"{where}: the prompt has {num_prompt} tokens, expected at most max_model_len={max_len}")
        # KV is written for every token but the final sampled one.
        max_tokens = request.sampling_params.max_tokens
        last = max_len if max_tokens is None else min(num_prompt + max_tokens, max_len)
        need = self.kv_cache_manager.num_blocks_for(max(num_prompt, last - 1))
        if need > self.config.num_kv_blocks:
            raise ValueError(
                f"{where}: needs up to {need} KV blocks of {self.block_size} tokens "
                f"({num_prompt} prompt tokens, up to {last} in all), expected at most the pool's "
                f"{self.config.num_kv_blocks}; lower max_tokens or raise num_kv_blocks"
            )
        prev_end = 0
        for i, f in enumerate(request.mm_features):
            off, length = f.mm_position.offset, f.mm_position.length
            if off < prev_end or off + length > num_prompt:
                raise ValueError(
                    f"{where}: mm_features[{i}] spans [{off}, {off + length}); expected spans sorted by "
                    f"offset, not overlapping, within the {num_prompt}-token prompt"
                )
            prev_end = off + length
        self.check_mm_items(rid, request.mm_features)

    def check_mm_items(self, request_id: str, features: list[MultiModalFeatureSpec]) -> None:
        """Raise ValueError naming the request and item if an item can never be encoded here."""
        if not features:
            return
        if self.encoder is None:
            modality = features[0].modality
            raise ValueError(f"request {request_id!r}: {modality} item 0: this model takes no multimodal input")
        self.encoder.validate(request_id, features)

    def finish_requests(self, req_ids: str | Iterable[str], status: RequestStatus) -> None:
        """End requests from outside the step loop (stop strings, aborts).
        Unknown or already finished ids are ignored."""
        if not status.finished:
            raise ValueError(f"finish_requests: expected a finished status, got {status.name}")
        for rid in [req_ids] if isinstance(req_ids, str) else req_ids:
            request = self.requests.get(rid)
            if request is None:
                continue
            if request.status is RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            self._finish(request, status)

    def finish_stopped(self, past_stop: Mapping[str, int]) -> None:
        """End the requests a stop string finished; ``past_stop[rid]``: how many of the
        tokens its last step appended came after the stop string (a verified run can
        carry past it). They were never reported, so they leave the output count."""
        self.finish_requests(past_stop, RequestStatus.FINISHED_STOPPED)
        self.num_output_tokens -= sum(past_stop.values())

    def abort_requests(self, req_ids: str | Iterable[str]) -> None:
        self.finish_requests(req_ids, RequestStatus.FINISHED_ABORTED)

    def _finish(self, request: Request, status: RequestStatus) -> None:
        """Free a request already removed from ``running``/``waiting``."""
        if request.status is RequestStatus.RUNNING:  # only then does the worker hold a row
            aborted = status is RequestStatus.FINISHED_ABORTED
            (self._aborted_ids if aborted else self._finished_ids).add(request.request_id)
        request.status = status
        self.kv_cache_manager.free(request)
        if self.encoder is not None:
            self.encoder.free(request)
        del self.requests[request.request_id]
        del self._arrival[request.request_id]

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def get_num_unfinished_requests(self) -> int:
        return len(self.waiting) + len(self.running)

    # -- one step ------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        cfg = self.config
        kv = self.kv_cache_manager
        budget = cfg.max_num_batched_tokens
        new_reqs: list[NewRequestData] = []
        cached_reqs: list[CachedRequestData] = []
        num_scheduled: dict[str, int] = {}
        encoder_inputs: dict[str, list[int]] = {}
        preempted: set[str] = set()
        spec_tokens: dict[str, list[int]] = {}
        draft_requests: dict[str, int] = {}
        if self.encoder is not None:
            self.encoder.begin_pass()

        # 1. Running requests: decodes and the next chunk of unfinished prefills.
        # Their own tokens first, for every one of them: drafts come in pass 3,
        # from what the step has left, so they never cost another request its
        # token, its blocks (a preemption) or a waiting request its prefill.
        self._worth_drafting = self._allocate_drafts()
        self._drafter_ks = {}
        # Pass 1's requests, for pass 3: (request, its proposal, whether it samples, its output entry).
        scheduled: list[tuple[Request, list[int], bool, CachedRequestData]] = []
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            n, enc = self._schedule_encoder_inputs(
                request, request.num_computed_tokens, self._num_new_tokens(request, budget)
            )
            if n == 0:
                i += 1
                continue
            drafts = self._propose(request, n)
            samples = request.num_computed_tokens + n == request.num_tokens
            new_blocks = self._allocate_or_preempt(request, n, preempted)
            if new_blocks is None:  # preempted itself (which released its encoder plan too)
                break
            cached = CachedRequestData(request.request_id, new_blocks, request.num_computed_tokens)
            cached_reqs.append(cached)
            self._commit(request, n, enc, num_scheduled, encoder_inputs)
            budget -= n
            scheduled.append((request, drafts, samples, cached))
            i += 1

        # 2. Waiting requests, unless blocks already ran out this step. One that
        # cannot start because its next item is still on an encoder worker is
        # passed over (it keeps its place, so it goes first once the item is
        # published); any other that cannot start blocks the ones behind it.
        w = 0
        while not preempted and w < len(self.waiting) and budget > 0 and len(self.running) < cfg.max_num_seqs:
            request = self.waiting[w]
            hit_blocks, num_hit = kv.get_computed_blocks(request)
            n, enc = self._schedule_encoder_inputs(request, num_hit, self._num_new_tokens(request, budget, num_hit))
            if n == 0:
                if self.encoder is not None and self.encoder.waits_on_worker(request, num_hit):
                    w += 1
                    continue
                break
            new_blocks = kv.allocate_slots(request, n, hit_blocks, num_hit)
            if new_blocks is None:
                self._release_encoder_plan(request, enc)
                if not self.running:  # nothing else holds blocks: it can never fit
                    raise self._pool_too_small(request, num_hit + n)
                break
            del self.waiting[w]
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_hit
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.monotonic()
            self.running.append(request)
            # A resumed request is new to the worker too: send all its known tokens.
            new_reqs.append(NewRequestData(
                request.request_id, list(request.all_token_ids), request.num_prompt_tokens,
                request.sampling_params, list(kv.get_block_ids(request.request_id)), num_hit,
                list(request.mm_features), request.payload, request.return_hidden_states,
            ))  # fmt: skip
            self._commit(request, n, enc, num_scheduled, encoder_inputs)
            self._request_drafts(request, 0, draft_requests)
            budget -= n

        # 3. Drafts, and the slots a drafter writes ahead, from the budget and the free
        # blocks left: without slots for them, the request decodes its one token.
        for request, drafts, samples, cached in scheduled:
            drafts = drafts[:budget]
            for extra in self._speculative_slots(request, samples, len(drafts)):
                new_blocks = kv.allocate_slots(request, extra)
                if new_blocks is not None:
                    cached.new_block_ids.extend(new_blocks)
                    break
            else:
                drafts = []
            if drafts:
                request.spec_token_ids = drafts
                spec_tokens[request.request_id] = drafts
                num_scheduled[request.request_id] += len(drafts)
                request.num_computed_tokens += len(drafts)
                budget -= len(drafts)
            self._request_drafts(request, len(drafts), draft_requests)

        out = SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached_reqs,
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=cfg.max_num_batched_tokens - budget,
            scheduled_encoder_inputs=encoder_inputs,
            finished_req_ids=self._finished_ids,
            aborted_req_ids=self._aborted_ids,
            preempted_req_ids=preempted,
            free_encoder_mm_hashes=self.encoder.freed_hashes() if self.encoder is not None else [],
            scheduled_spec_decode_tokens=spec_tokens,
            draft_token_requests=draft_requests,
            remote_encoder_inputs=self.encoder.take_loads() if self.encoder is not None else {},
        )
        self._finished_ids, self._aborted_ids = set(), set()
        return out

    def _num_new_tokens(self, request: Request, budget: int, num_computed: int | None = None) -> int:
        computed = request.num_computed_tokens if num_computed is None else num_computed
        n = min(request.num_tokens - computed, budget)
        if self.config.long_prefill_token_threshold:
            n = min(n, self.config.long_prefill_token_threshold)
        return n

    def can_speculate(self, request: Request) -> bool:
        """Whether the verifier handles this request's parameters exactly.

        Penalties and ``min_tokens`` are verified exactly (each draft
        position's rules read the drafts before it, as if decoded one by
        one), and per-token outputs for a later stage are fine (the worker
        returns and caches the verified tokens' rows only), and so are logprobs
        (one entry per emitted token, from the logits at its position). Not
        yet: model inputs beyond token ids (payloads); those decode one token
        a step as without speculation.
        """
        return request.payload is None

    def _allocate_drafts(self) -> dict[str, int]:
        """The draft policy's split of this step's drafts over the running requests that decode.

        Prompt lookup proposes first, so the split prices each request's actual
        proposal: a short one or none leaves its share to the others, and drafts
        inside split words are priced apart (``DraftPolicy.allocate``)."""
        policy = self.draft_policy
        if policy is None:
            return {}
        decoding = [r for r in self.running if r.num_computed_tokens == r.num_tokens - 1]
        caps = [self._max_drafts(r) if self.can_speculate(r) else 0 for r in decoding]
        proposals = None
        if not self.config.speculative_config.uses_drafter:
            proposals = [self._lookup(r, cap) if cap > 0 else [] for r, cap in zip(decoding, caps)]
            self._lookups = {r.request_id: p for r, p in zip(decoding, proposals)}
            caps = [len(p) for p in proposals]
        ks = policy.allocate([r.draft_state for r in decoding], caps, proposals)
        return {r.request_id: k for r, k in zip(decoding, ks)}

    def _lookup(self, request: Request, k: int) -> list[int]:
        """``request``'s prompt-lookup proposal of up to ``k`` drafts, through its first stop
        token, set as its shadow: every step's proposal, whole, is scored against the tokens
        the step emits, verified or not (a lookup costs microseconds; the token after the
        verified ones counts too)."""
        cfg = self.config.speculative_config
        ids = request.all_token_ids
        drafts, source = propose_ngram(ids, k, cfg.prompt_lookup_min, cfg.prompt_lookup_max, cfg.banned_token_ids)
        proposal = _through_stop(drafts, request)
        assert self.draft_policy is not None
        self.draft_policy.shadow(request.draft_state, proposal, from_prompt=0 <= source < request.num_prompt_tokens)
        return proposal

    def _max_drafts(self, request: Request) -> int:
        """Drafts that fit ``request``'s next step with their bonus token: the configured
        ``k``, the context length and ``max_tokens`` (the step's budget cuts them in pass 3)."""
        k = min(self.config.speculative_config.num_speculative_tokens, self.max_len(request) - request.num_tokens - 1)
        max_tokens = request.sampling_params.max_tokens
        if max_tokens is not None:
            k = min(k, max_tokens - request.num_output_tokens - 1)
        return max(k, 0)

    def _propose(self, request: Request, n: int) -> list[int]:
        """Draft tokens for a decode step (``n == 1``, the last known token
        unprocessed), capped so that the accepted ones plus the bonus token fit
        the context length and ``max_tokens`` (the step's budget cuts them later)."""
        cfg = self.config.speculative_config
        if cfg is None or n != 1 or request.num_computed_tokens != request.num_tokens - 1:
            return []
        if not self.can_speculate(request):
            return []
        k = self._max_drafts(request)
        if k < 1:
            return []
        if not cfg.uses_drafter:  # this step's lookup, cut to the policy's allocation
            proposal = self._lookups.get(request.request_id, [])
            return proposal[: min(k, self._worth_drafting.get(request.request_id, 0))]
        policy, state = self.draft_policy, request.draft_state
        proposal, request.draft_token_ids = request.draft_token_ids, []  # what the drafter proposed last step
        drafts = _through_stop(take_worker_drafts(proposal, k, cfg.banned_token_ids), request)
        if policy is not None and state.probing:  # a probe: scored in the shadow, not verified
            policy.shadow(state, drafts)
            return []
        return drafts

    def _num_drafts(self, request: Request) -> int:
        """How many tokens a worker drafter proposes for ``request`` after this step
        (it samples this step): the policy's allocation for the step's decoding
        batch, or a probe (``DraftPolicy.drafter_drafts``); decided once per
        step. ``_propose`` cuts them to what fits."""
        policy = self.draft_policy
        if policy is None:
            return 0
        rid = request.request_id
        if rid not in self._drafter_ks:
            allocated = self._worth_drafting.get(rid)
            if allocated is None:  # its prefill ends this step: priced as one more of the batch
                allocated = policy.num_drafts(request.draft_state, len(self._worth_drafting) + 1)
            self._drafter_ks[rid] = policy.drafter_drafts(request.draft_state, allocated)
        return self._drafter_ks[rid]

    def _request_drafts(self, request: Request, num_drafts: int, draft_requests: dict[str, int]) -> None:
        """Ask the worker's drafter for ``request``'s next drafts when it samples this step."""
        cfg = self.config.speculative_config
        if cfg is None or not cfg.uses_drafter:
            return
        if request.num_computed_tokens - num_drafts == request.num_tokens and self.can_speculate(request):
            k = self._num_drafts(request)
            if k > 0:
                draft_requests[request.request_id] = k

    def _speculative_slots(self, request: Request, samples: bool, num_drafts: int) -> list[int]:
        """Slot counts past the step's scheduled tokens to try allocating, most
        first: the drafts, plus the ``k - 1`` positions a worker drafter writes
        its KV at after the last verified token (``samples``: the request samples
        this step)."""
        cfg = self.config.speculative_config
        lookahead = 0
        if cfg is not None and cfg.uses_drafter and samples and self.can_speculate(request):
            room = self.max_len(request) - (request.num_tokens + num_drafts)
            lookahead = max(0, min(self._num_drafts(request) - 1, room))
        return [x for x in dict.fromkeys((num_drafts + lookahead, num_drafts)) if x > 0]

    def _schedule_encoder_inputs(
        self, request: Request, start: int, num_new_tokens: int
    ) -> tuple[int, EncoderPlan | None]:
        """Which of the request's multimodal items to encode for the window
        ``[start, start + num_new_tokens)``, and that window shrunk to what the
        encoder budget allows. Cache hits are pinned while planning; new
        entries are allocated in ``_commit``, once the KV blocks are secured."""
        if self.encoder is None:
            return num_new_tokens, None
        cfg = self.config.speculative_config
        lookahead = 1 if cfg is not None and cfg.uses_drafter else 0
        return self.encoder.plan(request, start, num_new_tokens, lookahead)

    def _release_encoder_plan(self, request: Request, plan: EncoderPlan | None) -> None:
        if self.encoder is not None:
            self.encoder.release(request, plan)

    def _commit(
        self, request: Request, n: int, plan: EncoderPlan | None, num_scheduled: dict, encoder_inputs: dict
    ) -> None:
        num_scheduled[request.request_id] = n
        if plan is not None and self.encoder is not None:
            to_encode = self.encoder.commit(request, plan)
            if to_encode:
                encoder_inputs[request.request_id] = to_encode
        request.num_computed_tokens += n  # advanced at schedule time (see the class docstring)

    def _allocate_or_preempt(self, request: Request, n: int, preempted: set[str]) -> list[int] | None:
        """Blocks for ``n`` more tokens of a running request, preempting the
        latest-arrived running requests until they fit. None if ``request``
        itself had to go."""
        while True:
            new_blocks = self.kv_cache_manager.allocate_slots(request, n)
            if new_blocks is not None:
                return new_blocks
            if len(self.running) == 1:  # it alone holds blocks and the whole pool is not enough
                raise self._pool_too_small(request, request.num_computed_tokens + n)
            victim = self.running.pop()
            self._preempt(victim)
            preempted.add(victim.request_id)
            if victim is request:
                return None

    def _preempt(self, request: Request) -> None:
        request.spec_token_ids = []
        request.draft_token_ids = []
        self.kv_cache_manager.free(request)
        if self.encoder is not None:  # a resumed request takes (or re-encodes) its items again
            self.encoder.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        # Back at its arrival place: before every waiting request but those passed
        # over for an encoder worker that arrived earlier (the head without workers).
        rank = self._arrival[request.request_id]
        place = 0
        while place < len(self.waiting) and self._arrival[self.waiting[place].request_id] < rank:
            place += 1
        self.waiting.insert(place, request)

    def _pool_too_small(self, request: Request, num_tokens: int) -> RuntimeError:
        return RuntimeError(
            f"KV cache too small: request {request.request_id!r} alone needs "
            f"{self.kv_cache_manager.num_blocks_for(num_tokens)} blocks for {num_tokens} tokens, "
            f"the pool has {self.config.num_kv_blocks} blocks of {self.block_size} tokens; "
            f"raise num_kv_blocks or lower max_model_len"
        )

    # -- step results --------------------------------------------------------

    def update_from_output(self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput) -> list[Request]:
        """Apply one step's sampled tokens; return the requests that got a new
        token (finished ones included, with their status set)."""
        kv = self.kv_cache_manager
        sampled = runner_output.sampled_token_ids
        updated: list[Request] = []
        any_finished = False
        for rid in scheduler_output.num_scheduled_tokens:
            request = self.requests.get(rid)
            if request is None or request.status is not RequestStatus.RUNNING:
                continue  # aborted or finished since it was scheduled
            drafts, request.spec_token_ids = request.spec_token_ids, []
            tokens = runner_output.spec_sampled_token_ids.get(rid) if drafts else None
            if drafts:
                if not tokens or len(tokens) > len(drafts) + 1 or tokens[:-1] != drafts[: len(tokens) - 1]:
                    raise RuntimeError(
                        f"request {rid!r} verified drafts {drafts} this step, expected 1 to {len(drafts) + 1} "
                        f"tokens starting with accepted drafts in spec_sampled_token_ids, got {tokens}"
                    )
                # The rejected drafts' KV is garbage: the next step recomputes from there.
                request.num_computed_tokens -= len(drafts) + 1 - len(tokens)
                self._count_drafts(request, len(drafts), len(tokens) - 1)
                if self.config.speculative_config.uses_drafter:  # no shadow: the verified run is the evidence
                    self.draft_policy.observe(request.draft_state, len(drafts), len(tokens) - 1)
            if self.encoder is not None:
                self.encoder.free_computed(request)
            if request.num_computed_tokens < request.num_tokens:
                kv.cache_blocks(request, request.num_computed_tokens)  # the chunk's KV exists now
                continue  # partial prefill chunk: a token sampled for it would be discarded
            if tokens is None:
                token = sampled.get(rid)
                if token is None:
                    # Without a token the request would wait forever for one.
                    raise RuntimeError(
                        f"request {rid!r} computed all its {request.num_tokens} tokens this step, "
                        f"expected a sampled token in ModelRunnerOutput.sampled_token_ids, got none"
                    )
                tokens = [token]
            # Token by token: nothing after a stop token or a length limit is kept.
            status = None
            for token in tokens:
                request.append_output_token(int(token))
                self.num_output_tokens += 1
                status = request.check_stop(self.max_len(request))
                if status is not None:
                    break
            if self.draft_policy is not None:  # scores a pending shadow proposal (a drafter's: a probe)
                self.draft_policy.observe_tokens(request.draft_state, tokens)
            if self.config.enable_prefix_caching:
                update_block_hashes(request, self.block_size)
            # The step's KV exists now, the accepted drafts' too: their blocks, hashed just above, are
            # cached before a finish frees them (cached before hashing, the last would never be).
            kv.cache_blocks(request, request.num_computed_tokens)
            if status is not None:
                self._finish(request, status)
                any_finished = True
            else:
                request.draft_token_ids = runner_output.draft_token_ids.get(rid, [])
            updated.append(request)
        if any_finished:
            self.running = [r for r in self.running if not r.finished]
        return updated

    def _count_drafts(self, request: Request, num_drafts: int, num_accepted: int) -> None:
        """One verified run's counts: the request's and the totals (the metrics)."""
        request.num_drafts += 1
        request.num_draft_tokens += num_drafts
        request.num_accepted_tokens += num_accepted
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        for pos in range(num_accepted):
            self.accepted_per_pos[pos] += 1

    # -- introspection -------------------------------------------------------

    def get_stats(self) -> SchedulerStats:
        kv = self.kv_cache_manager
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            kv_blocks_used=kv.num_used_blocks,
            kv_blocks_total=kv.num_blocks,
            prefix_cache_query_tokens=kv.stats.query_tokens,
            prefix_cache_hit_tokens=kv.stats.hit_tokens,
            num_preemptions=self.num_preemptions,
            num_output_tokens=self.num_output_tokens,
            num_draft_tokens=self.num_draft_tokens,
            num_accepted_tokens=self.num_accepted_tokens,
            num_drafts=self.num_drafts,
            num_accepted_tokens_per_pos=tuple(self.accepted_per_pos),
            encoder_cache_queries=self.encoder.num_queries if self.encoder is not None else 0,
            encoder_cache_hits=self.encoder.num_hits if self.encoder is not None else 0,
        )

    def reset_prefix_cache(self) -> None:
        self.kv_cache_manager.reset_prefix_cache()


def _through_stop(drafts: list[int], request: Request) -> list[int]:
    """``drafts`` up to and including the first token that would stop ``request``
    (EOS unless ignored, a stop token id): none after it can be emitted. Kept,
    it ends the request; rejected (also when ``min_tokens`` holds it back), so
    are the drafts after it. A copy ending in the prompt's end-of-turn token
    would otherwise draft the chat template after it."""
    for i, token in enumerate(drafts):
        if request.is_stop_token(token):
            return drafts[: i + 1]
    return drafts
