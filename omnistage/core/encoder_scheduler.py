"""Which multimodal items to encode in a step: the scheduler's encoder half."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from omnistage.core.encoder_cache_manager import EncoderCacheManager
from omnistage.core.request import Request
from omnistage.multimodal.inputs import MultiModalFeatureSpec, get_mm_features_in_window

__all__ = ["EncoderPlan", "EncoderScheduler"]


@dataclass
class EncoderPlan:
    """One request's encoder decisions for one step, before they are committed.

    ``to_encode``: items to allocate in the encoder cache and encode this step.
    ``same_content``: later items of the same request whose identifier equals
    one in ``to_encode``; they take a reference once it is allocated.
    ``pinned``: items whose output is already cached; their references were
    taken while planning (so that a later ``can_allocate`` in the same plan
    cannot evict them) and are released again if the plan is not committed.
    ``to_load``: items an encoder worker published; allocated like
    ``to_encode`` and loaded by the runner instead of encoded
    (``num_load_embeds`` rows of cache space, no compute budget).
    """

    to_encode: list[int] = field(default_factory=list)
    same_content: list[int] = field(default_factory=list)
    pinned: list[int] = field(default_factory=list)
    num_embeds: int = 0
    to_load: list[int] = field(default_factory=list)
    num_load_embeds: int = 0

    def __bool__(self) -> bool:
        return bool(self.to_encode or self.same_content or self.pinned or self.to_load)


class EncoderScheduler:
    """Encoder inputs for each step, under a compute budget and the cache size.

    Policy:

    - **Admission.** An item with more encoder embeddings than the whole cache
      (or a whole step's compute budget) can never run: the request is refused
      in ``validate`` rather than left waiting forever.
    - **Which items.** For a step window ``[start, start + n)`` of a request,
      every item whose embedding positions intersect the window must have its
      encoder output available before the forward: held already by this
      request, cached (a hit: a reference is taken, nothing runs), or encoded
      this step. Items are encoded whole (the towers attend bidirectionally),
      so a chunked prefill that splits an item encodes it in its first window
      and reads the cached rows in the later ones.
    - **Budgets.** Encoding an item costs its embeddings from the step's
      ``compute_budget`` and needs room in the cache (``can_allocate`` may
      evict unreferenced entries, oldest first). When an item does not fit,
      the window stops just before it (possibly at 0 tokens: the request waits
      a step); items earlier in the window are unaffected.
    - **A drafter's look-ahead** (``lookahead=1``, an EAGLE head reading the
      input embedding of the *next* position): the item whose embeddings
      start at the window's end is the drafter's boundary item. It is taken
      early when it is cached (a reference) or fits this step's budget and the
      cache (encoded now); otherwise nothing happens: the window is never
      shrunk for it and the drafter falls back to the token embedding there,
      so an item whose look-ahead cannot be served never stalls a request.
      An entry needs no longer life for the drafter: it reads its positions
      in the same step as the target, one ahead, and is done when the target is.
    - **Lifetime.** A request's reference to an item is released once the
      item's whole span has been computed (``free_computed``, after the step
      ran), or when the request finishes, is aborted or preempted (``free``).
    - **Encoder workers** (EPD; the engine refreshes ``remote_pending`` and
      ``remote_ready``, plain identifiers, before each pass). An item a worker
      is still encoding stops the window before it, as a budget miss does; an
      item a worker published is planned as a load (``to_load``): it needs
      cache space like any entry but costs none of the step's compute budget.
      Any other item (the worker failed, was late, or there is none) is
      encoded here.
    """

    def __init__(self, manager: EncoderCacheManager, compute_budget: int) -> None:
        self.manager = manager
        self.compute_budget = compute_budget
        self.budget_left = compute_budget
        self.remote_pending: set[str] = set()
        self.remote_ready: set[str] = set()
        self._loads: dict[str, list[int]] = {}  # this pass: request id -> items to load
        self.allocated: list[str] = []  # this pass: identifiers the worker is to encode or load
        # Items a window needed that its request did not hold yet, and of those the ones the
        # cache already had (the encoder cache's hit rate; a drafter's look-ahead is not counted).
        self.num_queries = 0
        self.num_hits = 0

    # -- admission -----------------------------------------------------------

    def validate(self, request_id: str, features: Sequence[MultiModalFeatureSpec]) -> None:
        """Raise ValueError naming the request and item if an item can never be encoded."""
        counts: dict[str, int] = {}
        for i, feature in enumerate(features):
            k = counts.get(feature.modality, 0)
            counts[feature.modality] = k + 1
            n = feature.mm_position.get_num_embeds()
            if not self.manager.item_fits(n, self.compute_budget):
                limit = min(self.manager.cache_size, self.compute_budget)
                raise ValueError(
                    f"request {request_id!r}: {feature.modality} item {k} (mm_features[{i}]) has {n} "
                    f"encoder embeddings, more than the encoder cache and budget hold ({limit}); "
                    "use a smaller item (e.g. lower max_pixels or fewer frames) or raise encoder_cache_size"
                )

    # -- one scheduling pass -------------------------------------------------

    def begin_pass(self) -> None:
        self.budget_left = self.compute_budget
        self._loads, self.allocated = {}, []

    def take_loads(self) -> dict[str, list[int]]:
        """The items committed as loads in this pass, by request."""
        loads, self._loads = self._loads, {}
        return loads

    def plan(
        self, request: Request, start: int, num_new_tokens: int, lookahead: int = 0
    ) -> tuple[int, EncoderPlan | None]:
        """Items to encode for the window ``[start, start + num_new_tokens)``
        and the window shrunk to what the budgets allow; with ``lookahead``,
        also the drafter's boundary item when it can be had (see the class policy)."""
        features = request.mm_features
        if not features or num_new_tokens <= 0:
            return num_new_tokens, None
        end = start + num_new_tokens
        lo, hi = get_mm_features_in_window(features, start, end)
        if lo >= hi and not (lookahead and self._boundary_items(features, end, lookahead)):
            return num_new_tokens, None  # decodes and text-only windows: the common case, nothing to do
        manager = self.manager
        held = manager.get_cached_input_ids(request)
        plan = EncoderPlan()
        chosen: set[str] = set()
        shrunk = False
        for k in range(lo, hi):
            feature = features[k]
            pos = feature.mm_position
            lo_rel, hi_rel = max(start, pos.offset) - pos.offset, min(end, pos.offset + pos.length) - pos.offset
            a, b = pos.get_embeds_indices_in_range(lo_rel, hi_rel)
            if a == b or k in held:  # no embeddings in the window, or already held
                continue
            if feature.identifier in chosen:
                plan.same_content.append(k)
                continue
            self.num_queries += 1
            if manager.check_and_update_cache(request, k):
                self.num_hits += 1
                plan.pinned.append(k)
                continue
            if self._take(request, k, plan, chosen):
                continue
            # Not this step: compute only the tokens before the item. Every item
            # planned so far lies before it (spans are sorted and disjoint).
            num_new_tokens = max(pos.offset - start, 0)
            shrunk = True
            break
        if lookahead and not shrunk and num_new_tokens > 0:
            # The boundary item is optional: it is skipped when it cannot be had.
            for k in self._boundary_items(features, end, lookahead):
                feature = features[k]
                if k in held or k in plan.pinned or k in plan.to_encode or k in plan.to_load or k in plan.same_content:
                    continue
                if feature.identifier in chosen:
                    plan.same_content.append(k)
                elif manager.check_and_update_cache(request, k):
                    plan.pinned.append(k)
                else:
                    self._take(request, k, plan, chosen)
        if num_new_tokens == 0:
            self.release(request, plan)
            return 0, None
        return num_new_tokens, plan if plan else None

    def _take(self, request: Request, k: int, plan: EncoderPlan, chosen: set[str]) -> bool:
        """Plan item ``k``, which no cache holds, if the step can have it: loaded when a worker
        published it (never encoded again), else encoded here unless a worker is still on it,
        within the encoder cache's room and the step's encoder budget. Whether it was."""
        feature = request.mm_features[k]
        n, chosen_rows = feature.mm_position.get_num_embeds(), plan.num_embeds + plan.num_load_embeds
        if feature.identifier in self.remote_ready:
            if not self.manager.can_allocate(request, k, n, chosen_rows):
                return False
            plan.to_load.append(k)
            plan.num_load_embeds += n
        elif feature.identifier in self.remote_pending or not self.manager.can_allocate(
            request, k, self.budget_left - plan.num_embeds, chosen_rows
        ):
            return False
        else:
            plan.to_encode.append(k)
            plan.num_embeds += n
        chosen.add(feature.identifier)
        return True

    def waits_on_worker(self, request: Request, start: int) -> bool:
        """Whether the request's next item from position ``start`` is one an
        encoder worker is still encoding (what stopped a window at 0 tokens)."""
        for feature in request.mm_features:
            pos = feature.mm_position
            if pos.offset + pos.length > start:
                return feature.identifier in self.remote_pending
        return False

    @staticmethod
    def _boundary_items(features: Sequence[MultiModalFeatureSpec], end: int, lookahead: int) -> list[int]:
        """Items with embeddings in ``[end, end + lookahead)``: what a drafter reads past the window."""
        lo, hi = get_mm_features_in_window(features, end, end + lookahead)
        out = []
        for k in range(lo, hi):
            pos = features[k].mm_position
            a, b = pos.get_embeds_indices_in_range(
                max(end, pos.offset) - pos.offset, min(end + lookahead, pos.offset + pos.length) - pos.offset
            )
            if a < b:
                out.append(k)
        return out

    def commit(self, request: Request, plan: EncoderPlan | None) -> list[int]:
        """Take the plan's cache entries; return the input ids to encode this step."""
        if plan is None:
            return []
        manager = self.manager
        for k in plan.to_encode + plan.to_load:
            manager.allocate(request, k)
            self.allocated.append(request.mm_features[k].identifier)
        if plan.to_load:
            self._loads[request.request_id] = list(plan.to_load)
        for k in plan.same_content:
            if not manager.check_and_update_cache(request, k):  # allocated just above
                raise RuntimeError(f"request {request.request_id!r}: item {k} lost its freshly allocated entry")
        self.budget_left -= plan.num_embeds
        return list(plan.to_encode)

    def release(self, request: Request, plan: EncoderPlan | None) -> None:
        """Undo a plan that will not be committed (its request got no blocks)."""
        if plan is None:
            return
        for k in plan.pinned:
            self.manager.free_encoder_input(request, k)

    # -- after a step, and when requests leave ---------------------------------

    def free_computed(self, request: Request) -> None:
        """Release the items whose whole span is computed: their rows were
        read by the forward that just ran, and no later window needs them."""
        if not request.mm_features:
            return
        done = request.num_computed_tokens
        features = request.mm_features
        for k in self.manager.get_cached_input_ids(request):
            pos = features[k].mm_position
            if pos.offset + pos.length <= done:
                self.manager.free_encoder_input(request, k)

    def free(self, request: Request) -> None:
        if request.mm_features:
            self.manager.free(request)

    def forget_unencoded(self, held: Callable[[str], bool]) -> None:
        """After a step: entries this pass allocated whose outputs the worker does not
        hold (``held``) are forgotten (``EncoderCacheManager.invalidate``): a step that
        failed, or a request that failed to join the batch, encoded nothing for them."""
        self.manager.invalidate([i for i in self.allocated if not held(i)])
        self.allocated = []

    def freed_hashes(self) -> list[str]:
        return self.manager.get_freed_mm_hashes()
