"""Scheduler-side bookkeeping of the encoder cache, and the encoder budgets."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping

from omnistage.core.request import Request

__all__ = ["EncoderCacheManager", "compute_mm_encoder_budget"]


class EncoderCacheManager:
    """Which encoder outputs the worker holds, who uses them, and what to drop.

    Policy:

    - **Units.** Capacity is ``cache_size`` encoder embeddings (output rows),
      counted with ``mm_position.get_num_embeds()``, not placeholder tokens.
    - **Key.** An entry is keyed by the item's ``identifier`` (its content
      hash), so requests that carry equal content share one entry and one
      encoder run; a request holds at most one reference to an entry, however
      many of its items (e.g. the same image in several turns) carry that
      identifier, and keeps it until the last of those items is freed.
    - **Lifetime.** An entry is *referenced* while a request holds it, and
      *freeable* once the last reference is released: its rows stay on the
      worker and a later request can revive it as a hit. Freeable entries are
      evicted oldest-released first, and only when ``can_allocate`` needs the
      space; eviction is bookkeeping here, the worker drops the tensors when it
      receives ``get_freed_mm_hashes()`` with the next step.
    - **Retention off.** With ``retain_unreferenced=False`` (the engine's
      ``enable_encoder_cache=False``) an entry is evicted the moment its last
      reference goes: equal items of concurrent requests still share one
      encoder run, but nothing outlives its last user.
    - **Same-pass re-allocation.** An identifier evicted and allocated again
      within one scheduling pass is not reported as freed, so the worker never
      drops an output a scheduled request is about to read.
    - **What a hit guarantees.** ``check_and_update_cache`` returning True
      means the worker holds (or, for an item allocated earlier in this pass,
      will hold after this step's encoder run) the output for that identifier
      until the reference is released.

    Invariant: ``0 <= num_free_slots <= num_freeable_slots <= cache_size`` and
    ``num_freeable_slots - num_free_slots`` equals the rows of freeable entries.
    """

    def __init__(self, cache_size: int, retain_unreferenced: bool = True) -> None:
        if isinstance(cache_size, bool) or not isinstance(cache_size, int) or cache_size < 0:
            raise ValueError(f"EncoderCacheManager: cache_size must be an int >= 0, got {cache_size!r}")
        self.cache_size = cache_size
        self.retain_unreferenced = retain_unreferenced
        self.num_free_slots = cache_size  # rows not allocated to any entry
        self.num_freeable_slots = cache_size  # free rows plus rows of freeable entries
        # identifier -> ids of the requests referencing it (empty: freeable)
        self.cached: dict[str, set[str]] = {}
        # identifier -> its number of encoder rows
        self.entry_size: dict[str, int] = {}
        # unreferenced entries in the order they were released (oldest first)
        self.freeable: OrderedDict[str, int] = OrderedDict()
        # evicted since the last get_freed_mm_hashes()
        self.freed: list[str] = []
        # request id -> identifier -> the request's input indices holding it
        self._holders: dict[str, dict[str, set[int]]] = {}

    # ------------------------------------------------------------------ queries

    @staticmethod
    def _item(request: Request, input_id: int) -> tuple[str, int]:
        features = request.mm_features
        if not 0 <= input_id < len(features):
            raise ValueError(
                f"request {request.request_id}: encoder input index {input_id} out of "
                f"range, expected 0 <= index < {len(features)}"
            )
        feature = features[input_id]
        return feature.identifier, feature.mm_position.get_num_embeds()

    def item_fits(self, num_embeds: int, compute_budget: int | None = None) -> bool:
        """Whether an item of ``num_embeds`` rows can ever be scheduled: it
        must fit in the whole cache (and in a whole step's compute budget).
        The scheduler rejects a request with an item that does not fit at
        admission, since waiting would never make room for it."""
        if num_embeds > self.cache_size:
            return False
        return compute_budget is None or num_embeds <= compute_budget

    def get_cached_input_ids(self, request: Request) -> set[int]:
        """Input indices of ``request`` currently holding a reference."""
        holders = self._holders.get(request.request_id, {})
        return {i for inputs in holders.values() for i in inputs}

    @property
    def num_referenced_entries(self) -> int:
        """Entries some request still holds (0 once every request ended)."""
        return sum(1 for users in self.cached.values() if users)

    def __contains__(self, identifier: str) -> bool:
        return identifier in self.cached

    def __len__(self) -> int:
        return len(self.cached)

    # -------------------------------------------------------------- operations

    def check_and_update_cache(self, request: Request, input_id: int) -> bool:
        """If item ``input_id``'s output is cached, take a reference to it for
        ``request`` (reviving it if it was freeable) and return True."""
        identifier, _ = self._item(request, input_id)
        users = self.cached.get(identifier)
        if users is None:
            return False
        if not users:  # freeable: it is in use again
            self.num_freeable_slots -= self.freeable.pop(identifier)
        self._add_reference(request.request_id, identifier, input_id)
        return True

    def can_allocate(
        self,
        request: Request,
        input_id: int,
        encoder_compute_budget: int,
        num_embeds_to_schedule: int,
    ) -> bool:
        """Whether item ``input_id`` can be encoded this step.

        ``encoder_compute_budget`` is what remains of this step's encoder
        budget and ``num_embeds_to_schedule`` the rows already chosen for this
        request in this pass (not yet allocated). Evicts the oldest freeable
        entries if that makes room; evictions stand even if the caller ends
        up not scheduling the item.
        """
        _, num_embeds = self._item(request, input_id)
        if num_embeds > encoder_compute_budget:
            return False
        needed = num_embeds + num_embeds_to_schedule
        if needed <= self.num_free_slots:
            return True
        if needed > self.num_freeable_slots:
            return False
        while self.num_free_slots < needed:
            identifier, size = self.freeable.popitem(last=False)
            del self.cached[identifier]
            del self.entry_size[identifier]
            self.freed.append(identifier)
            self.num_free_slots += size
        return True

    def allocate(self, request: Request, input_id: int) -> None:
        """Create the entry for item ``input_id`` (to be encoded this step),
        referenced by ``request``. Call ``can_allocate`` first."""
        identifier, num_embeds = self._item(request, input_id)
        if identifier in self.cached:
            raise ValueError(
                f"request {request.request_id}: encoder input {input_id} ({identifier}) is "
                "already cached; take a reference with check_and_update_cache instead"
            )
        if num_embeds > self.num_free_slots:
            raise ValueError(
                f"request {request.request_id}: encoder input {input_id} needs {num_embeds} "
                f"rows but only {self.num_free_slots} are free; call can_allocate first"
            )
        self.cached[identifier] = set()
        self.entry_size[identifier] = num_embeds
        self.num_free_slots -= num_embeds
        self.num_freeable_slots -= num_embeds
        self._add_reference(request.request_id, identifier, input_id)

    def free_encoder_input(self, request: Request, input_id: int) -> None:
        """Release item ``input_id``'s hold. The request's reference to the
        entry goes when none of its items with that identifier holds it; the
        entry becomes freeable when no request references it."""
        identifier, _ = self._item(request, input_id)
        holders = self._holders.get(request.request_id)
        inputs = holders.get(identifier) if holders else None
        if not inputs or input_id not in inputs:
            return
        inputs.discard(input_id)
        if inputs:
            return
        del holders[identifier]
        if not holders:
            del self._holders[request.request_id]
        users = self.cached[identifier]
        users.discard(request.request_id)
        if not users:
            size = self.entry_size[identifier]
            self.num_freeable_slots += size
            if self.retain_unreferenced:
                self.freeable[identifier] = size
            else:  # evict now; the worker drops the tensor at the next step
                del self.cached[identifier]
                del self.entry_size[identifier]
                self.freed.append(identifier)
                self.num_free_slots += size

    def free(self, request: Request) -> None:
        """Release every hold of ``request`` (on finish, abort or preemption)."""
        for input_id in sorted(self.get_cached_input_ids(request)):
            self.free_encoder_input(request, input_id)

    def invalidate(self, identifiers: Iterable[str]) -> None:
        """Forget entries whose outputs the worker does not hold after all (their
        encoder run failed, or was skipped with the request that owned it): their
        rows are free again and the requests holding them lose the hold, so the next
        window that needs such an item encodes it, instead of a hit on nothing."""
        for identifier in identifiers:
            users = self.cached.pop(identifier, None)
            if users is None:
                continue
            size = self.entry_size.pop(identifier)
            if users:
                self.num_freeable_slots += size
            else:
                del self.freeable[identifier]
            self.num_free_slots += size
            for request_id in users:
                holders = self._holders[request_id]
                del holders[identifier]
                if not holders:
                    del self._holders[request_id]

    def get_freed_mm_hashes(self) -> list[str]:
        """Identifiers evicted since the last call, for the worker to drop;
        identifiers allocated again since their eviction are left out."""
        freed = [identifier for identifier in self.freed if identifier not in self.cached]
        self.freed = []
        return list(dict.fromkeys(freed))

    def reset(self) -> None:
        """Forget every entry (after a weight update: cached outputs are
        stale). The worker must clear its encoder cache too."""
        self.num_free_slots = self.cache_size
        self.num_freeable_slots = self.cache_size
        self.cached.clear()
        self.entry_size.clear()
        self.freeable.clear()
        self.freed.clear()
        self._holders.clear()

    def _add_reference(self, request_id: str, identifier: str, input_id: int) -> None:
        self.cached[identifier].add(request_id)
        self._holders.setdefault(request_id, {}).setdefault(identifier, set()).add(input_id)


def compute_mm_encoder_budget(
    max_num_batched_tokens: int,
    max_tokens_per_item: Mapping[str, int] | int,
    max_num_batched_encoder_embeds: int | None = None,
    encoder_cache_size: int | None = None,
) -> tuple[int, int]:
    """Return ``(encoder_compute_budget, encoder_cache_size)`` in embeddings.

    ``max_tokens_per_item`` is the largest item the model accepts, per
    modality (``{"image": 1280, "audio": 750}``) or overall. The compute
    budget (rows encoded per step) defaults to the step's token budget and the
    cache size to the compute budget; both are raised to the largest item, so
    that an item larger than a step's token budget can still be encoded (in
    one step) and cached (its placeholders then span several chunked-prefill
    steps). A text-only model gets ``(0, 0)``.
    """
    if isinstance(max_tokens_per_item, Mapping):
        sizes = [int(v) for v in max_tokens_per_item.values()]
    else:
        sizes = [int(max_tokens_per_item)]
    if any(size < 0 for size in sizes):
        raise ValueError(f"compute_mm_encoder_budget: item sizes must be >= 0, got {max_tokens_per_item!r}")
    max_item = max(sizes, default=0)
    if max_item == 0:
        return 0, 0
    if max_num_batched_tokens <= 0:
        raise ValueError(
            f"compute_mm_encoder_budget: max_num_batched_tokens must be > 0, got {max_num_batched_tokens}"
        )
    compute = max(max_num_batched_encoder_embeds or max_num_batched_tokens, max_item)
    cache = max(encoder_cache_size or compute, max_item)
    return compute, cache
