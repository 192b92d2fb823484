"""``data_parallel_size`` replicas of one engine, on Ray, behind a stage engine's interface.

``DataParallelEngine`` is what ``build_engine`` returns for
``EngineArgs.data_parallel_size > 1``; ``LLM`` and the server drive it with the
calls they drive a stage engine with (``add_request``, ``abort_request``,
``step``, ``has_unfinished_requests``, ``get_stats``, ``held``). It is
thread-confined like a stage engine.

- Prompts are processed here (``EngineFront``), then each request goes to one
  replica (``PrefixRouter``: the longest cached prefix, else the least
  loaded) and stays there; replicas never share a request.
- ``step`` keeps one step in flight on every replica with work and returns
  the outputs of the replicas that finished theirs (at least one), so
  replicas run concurrently while outputs still stream step by step.
- A replica that dies (its actor is gone) fails only the requests it held:
  those that had streamed no token yet are sent once to another live replica,
  the others finish with reason "error" and ``RequestOutput.error`` naming
  the replica. The facade serves on with the replicas left.

Ray is reached through ``omnistage.ray_cluster.connect_ray`` (the cluster
``RAY_ADDRESS`` names, else a local instance; a caller's own ``ray.init``
is used as it is). Replicas load the checkpoint from ``args.model``, which must be a
path every node can read.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from omnistage.core.kv_cache_utils import hash_prompt_blocks
from omnistage.engine.arg_utils import EngineArgs
from omnistage.engine.distributed.front import EngineFront
from omnistage.engine.distributed.replica import EngineReplica, ReplicaStep, failed_output
from omnistage.engine.distributed.router import PrefixRouter
from omnistage.engine.input_processor import ProcessedInputs, PromptType
from omnistage.engine.stage import StageHeld
from omnistage.engine.stage_engine import EngineStats
from omnistage.outputs import RequestOutput
from omnistage.ray_cluster import actor_resources, connect_ray
from omnistage.sampling_params import SamplingParams

__all__ = ["DataParallelEngine", "DataParallelStats", "ReplicaLoad"]

logger = logging.getLogger(__name__)

_WAIT_S = 0.05  # the longest ``step`` waits for a replica's step before returning nothing
# The longest ``held`` / ``get_stats`` wait for a replica (its answer queues behind its step in flight):
# one that has not answered by then, busy with a long step or hung, is left out of that answer, so a
# stuck replica never stalls the caller (the server's engine thread, and every stream with it).
_STATE_TIMEOUT_S = 2.0


@dataclass
class ReplicaLoad:
    """One replica's load, for ``/metrics`` (label ``replica``)."""

    replica: int
    alive: bool
    num_requests: int  # routed to it and not finished
    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_hit_tokens: int = 0
    prefix_cache_query_tokens: int = 0
    cached_blocks: int = 0  # blocks the router believes it caches


@dataclass
class DataParallelStats(EngineStats):
    """The replicas' stats summed, and each replica's load. Gauges (requests, KV blocks) sum
    the replicas that answered; counters add what a replica that did not (stalled, or dead)
    last reported, so a total never goes back (a scraper would read a counter reset)."""

    replicas: list[ReplicaLoad] = field(default_factory=list)


@dataclass
class _Routed:
    replica: int
    inputs: ProcessedInputs  # whole until the first token (for a retry elsewhere), then without media
    params: SamplingParams
    options: dict[str, Any]
    streamed: bool = False
    retried: bool = False


@dataclass
class _Replica:
    index: int
    actor: Any
    alive: bool = True
    stepping: Any = None  # the ObjectRef of the step in flight
    # The requests that step was started for: an id aborted and added again meanwhile is a new
    # request, and the step's outputs under that id are the old one's.
    stepped: dict[str, Any] = field(default_factory=dict)
    owes_step: bool = False
    requests: set[str] = field(default_factory=set)
    error: str | None = None


def _warn_if_unplaceable(resources: dict[str, Any], n: int) -> None:
    """Say so when the cluster cannot hold ``n`` replicas right now: Ray would
    leave them pending (and this constructor waiting) until resources free up
    or a node joins, which an autoscaling cluster may still do."""
    import ray

    free = ray.available_resources()
    names = {"num_cpus": "CPU", "num_gpus": "GPU"}
    for key, amount in resources.items():
        name = names.get(key, key)
        if free.get(name, 0.0) < amount * n:
            logger.warning(
                "data_parallel_size=%d needs %s %s (%s each) but the Ray cluster has %s free: replicas wait "
                "until that much is free", n, amount * n, name, amount, free.get(name, 0.0),
            )  # fmt: skip


class DataParallelEngine:
    """N engine replicas as Ray actors, one facade (module docstring)."""

    def __init__(
        self, args: EngineArgs, options: Any = None, *, routing: str = "prefix", actor_options: dict | None = None
    ) -> None:
        import ray

        connect_ray()
        self.args = args
        self._requests: dict[str, _Routed] = {}
        self._failed: list[RequestOutput] = []  # outputs of requests a dead replica took with it
        self._last_stats: dict[int, EngineStats] = {}  # each replica's last answer to get_stats
        n = args.data_parallel_size
        resources = actor_options or actor_resources(args.device)
        _warn_if_unplaceable(resources, n)
        actor_cls = ray.remote(EngineReplica).options(**resources, max_restarts=0, max_concurrency=1)
        self._replicas = [_Replica(i, actor_cls.remote(args, options)) for i in range(n)]
        try:
            self._front: EngineFront = ray.get(self._replicas[0].actor.front.remote())
            ray.get([r.actor.pid.remote() for r in self._replicas[1:]])  # every replica built, or raise here
        except ray.exceptions.RayError as exc:
            self.shutdown()
            why = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__  # the cause's line
            raise RuntimeError(f"an engine replica of {args.model!r} failed to start: {why}") from exc
        self.router = PrefixRouter(n, routing, max_imbalance=args.max_num_seqs)

    # -- what a stage engine also answers ---------------------------------------------

    @property
    def tokenizer(self) -> Any:
        return self._front.tokenizer

    @property
    def loaded_model(self) -> Any:
        return SimpleNamespace(name=self._front.model_name)

    max_model_len = property(lambda self: self._front.max_model_len)
    num_kv_blocks = property(lambda self: self._front.num_kv_blocks)  # per replica
    vocab_size = property(lambda self: self._front.vocab_size)
    input_modalities = property(lambda self: self._front.input_modalities)
    output_modalities = property(lambda self: self._front.output_modalities)
    voices = property(lambda self: self._front.voices)

    def process_inputs(
        self, request_id: str, prompt: PromptType | ProcessedInputs, truncate_prompt_tokens: int | None = None
    ) -> ProcessedInputs:
        return self._front.process_inputs(request_id, prompt, truncate_prompt_tokens)

    def encode_chat(self, messages: list[dict[str, Any]], *args: Any, **kwargs: Any) -> dict[str, Any]:
        return self._front.encode_chat(messages, *args, **kwargs)

    def apply_chat_template(self, messages: list[dict[str, Any]], *args: Any, **kwargs: Any) -> str:
        return self._front.apply_chat_template(messages, *args, **kwargs)

    @property
    def num_live_replicas(self) -> int:
        return sum(r.alive for r in self._replicas)

    def replica_of(self, request_id: str) -> int | None:
        """The replica a request in flight runs on."""
        routed = self._requests.get(request_id)
        return None if routed is None else routed.replica

    # -- requests ------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: PromptType | ProcessedInputs,
        sampling_params: SamplingParams | None = None,
        arrival_time: float | None = None,
        **options: Any,
    ) -> None:
        """Process the prompt here and send it to one replica. Raises ValueError
        (nothing queued) for a bad prompt or parameters, RuntimeError when no
        replica is alive; a refusal only the replica finds comes back as a
        failed output."""
        if request_id in self._requests:
            raise ValueError(f"request {request_id!r}: a request with this id is already running")
        params = SamplingParams() if sampling_params is None else sampling_params
        if not isinstance(params, SamplingParams):
            kind = type(params).__name__
            raise ValueError(f"request {request_id!r}: sampling_params must be SamplingParams, got {kind}")
        try:
            params.check_vocab(self.vocab_size, self._front.eos_token_ids)
        except ValueError as exc:
            raise ValueError(f"request {request_id!r}: {exc}") from None
        inputs = self.process_inputs(request_id, prompt, params.truncate_prompt_tokens)
        if arrival_time is not None:
            options = {**options, "arrival_time": arrival_time}
        routed = _Routed(-1, inputs, params, options)
        self._route(request_id, routed)

    def _route(self, request_id: str, routed: _Routed) -> None:
        hashes = hash_prompt_blocks(
            routed.inputs.prompt_token_ids, self._front.block_size, routed.inputs.mm_features, routed.inputs.cache_salt
        )
        loads = [len(r.requests) if r.alive else None for r in self._replicas]
        index, _ = self.router.choose(hashes, loads)
        replica = self._replicas[index]
        replica.actor.add_request.remote(request_id, routed.inputs, routed.params, routed.options)
        routed.replica = index
        replica.requests.add(request_id)
        self._requests[request_id] = routed

    def abort_request(self, request_ids: str | list[str]) -> None:
        """Stop requests; unknown ids are ignored."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        by_replica: dict[int, list[str]] = {}
        for rid in ids:
            routed = self._requests.pop(rid, None)
            if routed is not None:
                self._replicas[routed.replica].requests.discard(rid)
                by_replica.setdefault(routed.replica, []).append(rid)
        for index, rids in by_replica.items():
            replica = self._replicas[index]
            if replica.alive:
                replica.actor.abort_request.remote(rids)
                replica.owes_step = True  # the abort's clean-up may leave rows for one more step
        failed = {o.request_id for o in self._failed}
        if failed & set(ids):
            self._failed = [o for o in self._failed if o.request_id not in ids]

    # -- the loop --------------------------------------------------------------------------

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests or self._failed) or any(
            r.alive and (r.owes_step or r.stepping is not None) for r in self._replicas
        )

    def get_num_unfinished_requests(self) -> int:
        return len(self._requests)

    def step(self) -> list[RequestOutput]:
        """Start a step on every replica with work and none in flight; return the
        outputs of the steps that ended (waiting at most ``_WAIT_S`` for one)."""
        import ray

        for r in self._replicas:
            if r.alive and r.stepping is None and (r.requests or r.owes_step):
                r.stepping = r.actor.step.remote()
                r.stepped = {rid: self._requests.get(rid) for rid in r.requests}
        outputs, self._failed = self._failed, []
        in_flight = {r.stepping: r for r in self._replicas if r.stepping is not None}
        if not in_flight:
            return outputs
        refs = list(in_flight)
        # Bounded: the caller gets back to its queue (new requests for an idle
        # replica) while a long step runs elsewhere; an empty list then.
        ready, rest = ray.wait(refs, num_returns=1, timeout=_WAIT_S)
        if rest:
            more, _ = ray.wait(rest, num_returns=len(rest), timeout=0)
            ready += more
        for ref in ready:
            replica = in_flight[ref]
            replica.stepping = None
            try:
                result: ReplicaStep = ray.get(ref)
            except ray.exceptions.RayActorError as exc:
                self._replica_died(replica, exc)
                continue
            except ray.exceptions.RayTaskError as exc:  # the replica lives, its step raised past the engine
                self._step_failed(replica, exc)
                continue
            outputs += self._take(replica, result)
        outputs += self._failed  # requests a replica that died in this call took with it
        self._failed = []
        return outputs

    def _take(self, replica: _Replica, result: ReplicaStep) -> list[RequestOutput]:
        self.router.apply_events(replica.index, result.kv_events)
        replica.owes_step = result.has_unfinished
        outputs = []
        for out in result.outputs:
            routed = self._requests.get(out.request_id)
            if routed is None or routed is not replica.stepped.get(out.request_id):
                continue  # aborted meanwhile (perhaps added again under its id since)
            if not routed.streamed and any(c.token_ids for c in out.outputs):
                routed.streamed = True  # never retried now: its media need not stay in this process
                routed.inputs = dataclasses.replace(routed.inputs, mm_features=[], payload=None)
            if out.finished:
                del self._requests[out.request_id]
                replica.requests.discard(out.request_id)
            outputs.append(out)
        return outputs

    def _step_failed(self, replica: _Replica, exc: BaseException) -> None:
        """Fail (and abort there) the requests of a replica whose step raised; it serves on."""
        first = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
        logger.error("engine replica %d: a step raised: %s", replica.index, exc)
        lost = sorted(replica.requests)
        replica.actor.abort_request.remote(lost)
        replica.owes_step = True
        for rid in lost:
            routed = self._requests.pop(rid)
            replica.requests.discard(rid)
            error = f"request {rid!r}: engine replica {replica.index}'s step failed ({first})"
            self._failed.append(failed_output(rid, routed.inputs, routed.params.n, error))

    def _replica_died(self, replica: _Replica, exc: BaseException) -> None:
        """Route around a dead replica: retry its requests that streamed nothing, fail the rest."""
        replica.alive, replica.stepping, replica.owes_step = False, None, False
        replica.error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        self.router.forget_replica(replica.index)
        lost = sorted(replica.requests)
        replica.requests.clear()
        logger.error("engine replica %d died (%s); %d request(s) were on it", replica.index, replica.error, len(lost))
        for rid in lost:
            routed = self._requests.pop(rid)
            if not routed.streamed and not routed.retried and self.num_live_replicas:
                routed.retried = True
                self._route(rid, routed)
                continue
            if routed.streamed:
                why = "after it streamed tokens"
            elif routed.retried:
                why = "as the second replica to run it (a request moves to another once)"
            else:
                why = "and no replica is left to retry it on"
            error = f"request {rid!r}: engine replica {replica.index} died {why} ({replica.error})"
            self._failed.append(failed_output(rid, routed.inputs, routed.params.n, error))

    # -- state ---------------------------------------------------------------------------------

    def _live_calls(self, method: str) -> list[tuple[_Replica, Any]]:
        """``method`` on every live replica; replicas found dead are handled as in ``step``."""
        import ray

        live = [r for r in self._replicas if r.alive]
        refs = [getattr(r.actor, method).remote() for r in live]
        results = []
        for r, ref in zip(live, refs, strict=True):
            try:
                results.append((r, ray.get(ref, timeout=_STATE_TIMEOUT_S)))
            except ray.exceptions.GetTimeoutError:
                logger.warning("engine replica %d: no answer to %s in %.0f s; left out", r.index, method,
                               _STATE_TIMEOUT_S)  # fmt: skip
            except ray.exceptions.RayActorError as exc:
                self._replica_died(r, exc)
        return results

    def held(self) -> dict[str, StageHeld]:
        """What every live replica's stages hold, plus the requests the facade routes."""
        held = {
            f"replica{r.index}.{name}": h for r, stages in self._live_calls("held") for name, h in stages.items()
        }
        held["router"] = StageHeld(requests=len(self._requests) + len(self._failed))
        return held

    def get_stats(self) -> DataParallelStats:
        per = {r.index: s for r, s in self._live_calls("get_stats")}
        self._last_stats.update(per)
        summed = {
            f.name: _sum_stat([getattr(s, f.name) for s in (per if f.name in _GAUGES else self._last_stats).values()])
            for f in dataclasses.fields(EngineStats)
        }
        loads = []
        for r in self._replicas:
            s = per.get(r.index)
            load = ReplicaLoad(r.index, r.alive and s is not None, len(r.requests))
            load.cached_blocks = self.router.num_cached_blocks(r.index)
            if s is not None:
                load.num_running_reqs, load.num_waiting_reqs = s.num_running_reqs, s.num_waiting_reqs
                load.kv_cache_usage = s.kv_cache_usage
            last = self._last_stats.get(r.index)
            if last is not None:  # counters: as last reported
                load.prefix_cache_hit_tokens = last.prefix_cache_hit_tokens
                load.prefix_cache_query_tokens = last.prefix_cache_query_tokens
            loads.append(load)
        return DataParallelStats(**summed, replicas=loads)

    def actor(self, index: int) -> Any:
        """Replica ``index``'s Ray actor handle (tests kill it with ``ray.kill``)."""
        return self._replicas[index].actor

    def shutdown(self) -> None:
        """Kill every replica's actor; the facade is unusable afterwards."""
        import ray

        for r in self._replicas:
            if r.alive:
                ray.kill(r.actor, no_restart=True)
                r.alive = False
        self._requests.clear()


_GAUGES = frozenset({"num_running_reqs", "num_waiting_reqs", "kv_blocks_used", "kv_blocks_total"})


def _sum_stat(values: list) -> Any:
    """Replicas' values of one stat added up; per-position tuples (accepted drafts) position by position."""
    if values and isinstance(values[0], tuple):
        width = max(len(v) for v in values)
        return tuple(sum(v[i] for v in values if i < len(v)) for i in range(width))
    return sum(values)
