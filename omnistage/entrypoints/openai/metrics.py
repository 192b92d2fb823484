"""Server metrics in the Prometheus text exposition format (version 0.0.4).

Counters and the latency histograms are updated by the serving code on the
event loop thread (one writer, so no locks). Gauges that describe the engine
(KV-cache usage, running/waiting requests, cache hit rates) are read from
``engine.get_stats()`` at scrape time; a scrape that cannot read them (the
engine busy past the timeout, or down) shows the last ones read, and the
engine's counters never go back, not even across a rebuilt engine
(``EngineCounters``).

Names follow vLLM's where vLLM has the metric (``vllm:e2e_request_latency_seconds``
is ``omnistage:e2e_request_latency_seconds`` here), so its dashboards port by
changing the prefix.

Written by hand rather than with ``prometheus_client``: the format is a few
lines of text and the dependency would be the only one for it.
"""

from __future__ import annotations

import bisect
import math
from collections import defaultdict
from dataclasses import dataclass, field
from itertools import zip_longest
from typing import Any

from omnistage.outputs import RequestOutput

PREFIX = "omnistage:"

# Seconds; spans a tiny CPU model (ms) to a long queue on a large one (tens of s).
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
E2E_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
# Per request: its decode time over its tokens after the first.
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(pairs: tuple[tuple[str, str], ...]) -> str:
    if not pairs:
        return ""
    return "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in pairs) + "}"


def _num(v: float) -> str:
    v = float(v)
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    if v.is_integer() and abs(v) < 2**53:
        return str(int(v))
    return repr(v)


@dataclass
class Histogram:
    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    n: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * len(self.buckets)

    def samples(self) -> list[tuple[str, tuple, float]]:
        """Cumulative ``_bucket`` samples, then ``_sum`` and ``_count``."""
        out: list[tuple[str, tuple, float]] = []
        cumulative = 0
        for bound, count in zip(self.buckets, self.counts):
            cumulative += count
            out.append(("_bucket", (("le", _num(bound)),), cumulative))
        out.append(("_bucket", (("le", "+Inf"),), self.n))
        out.append(("_sum", (), self.total))
        out.append(("_count", (), self.n))
        return out

    def observe(self, value: float) -> None:
        idx = bisect.bisect_left(self.buckets, value)
        if idx < len(self.counts):
            self.counts[idx] += 1
        self.total += value
        self.n += 1


class EngineCounters:
    """The engine's stats as /metrics shows them, so a scraper never sees a counter go back:

    - a scrape that gets no stats (the engine busy past the timeout, dead, or
      being rebuilt) shows the last ones read, gauges included, instead of zeros;
    - a rebuilt engine's counters restart at 0: each ``*_total`` counter adds what
      the engines before it had counted."""

    def __init__(self) -> None:
        self.last: dict[str, Any] = {}
        self._raw: dict[str, Any] = {}  # the last engine's own counts
        self._base: dict[str, Any] = {}  # what earlier engines counted

    def update(self, stats: dict[str, Any]) -> dict[str, Any]:
        """``stats`` (``normalize_engine_stats``; empty: none could be read) as rendered."""
        if not stats:
            return self.last
        out = dict(stats)
        for name, value in stats.items():
            if name == PER_POS:
                value, raw, base = list(value), list(self._raw.get(name, ())), list(self._base.get(name, ()))
                restarted = any(v < r for v, r in zip(value, raw)) or len(value) < len(raw)
                if restarted:
                    base = [a + b for a, b in zip_longest(base, raw, fillvalue=0.0)]
                out[name] = tuple(a + b for a, b in zip_longest(value, base, fillvalue=0.0))
            elif name.endswith("_total") and name != "kv_cache_blocks_total":
                raw, base = self._raw.get(name, 0.0), self._base.get(name, 0.0)
                if value < raw:
                    base += raw
                out[name] = value + base
            else:
                continue
            self._base[name] = base
            self._raw[name] = value
        self.last = out
        return out


class ServerMetrics:
    """What the server counts itself; engine gauges are passed in at render time."""

    def __init__(self) -> None:
        self.engine = EngineCounters()
        self.requests: dict[tuple[tuple[str, str], ...], int] = defaultdict(int)
        self.finish_reasons: dict[str, int] = defaultdict(int)
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.cached_prompt_tokens = 0
        self.ttft = Histogram(TTFT_BUCKETS)
        self.e2e = Histogram(E2E_BUCKETS)
        self.tpot = Histogram(TPOT_BUCKETS)

    def record_request(self, endpoint: str, outcome: str) -> None:
        """outcome: success | client_error | server_error | aborted (client went away)."""
        self.requests[(("endpoint", endpoint), ("outcome", outcome))] += 1

    def record_tokens(self, prompt: int, generated: int, cached: int) -> None:
        self.prompt_tokens += prompt
        self.generation_tokens += generated
        self.cached_prompt_tokens += cached

    def record_finish(self, reason: str | None) -> None:
        self.finish_reasons[reason or "none"] += 1

    def record_ttft(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def record_latencies(self, output: RequestOutput) -> None:
        """End-to-end latency and time per output token of one finished prompt,
        from the engine's own timestamps (arrival, first token, finish).

        TPOT is observed only for a prompt with two or more tokens in its
        longest choice; an output without timestamps (an engine that keeps
        none) records nothing."""
        m = getattr(output, "metrics", None)
        if m is None or m.finished_time is None:
            return
        self.e2e.observe(m.finished_time - m.arrival_time)
        generated = max((len(c.token_ids) for c in output.outputs), default=0)
        if m.first_token_time is not None and generated > 1:
            self.tpot.observe((m.finished_time - m.first_token_time) / (generated - 1))

    def render(self, engine_stats: dict[str, Any], replicas: list[dict[str, float]] | None = None) -> str:
        """The exposition text; ``replicas`` (``replica_loads``) adds one sample per
        data-parallel replica to each ``replica_*`` metric, labelled ``replica``."""
        lines: list[str] = []
        engine_stats = self.engine.update(engine_stats)

        def metric(name: str, kind: str, help_: str, samples: list[tuple[str, tuple, float]]) -> None:
            full = f"{PREFIX}{name}"
            lines.append(f"# HELP {full} {help_}")
            lines.append(f"# TYPE {full} {kind}")
            for suffix, labels, value in samples:
                lines.append(f"{full}{suffix}{_labels(labels)} {_num(value)}")

        metric(
            "requests_total", "counter", "Finished HTTP generation requests by endpoint and outcome.",
            [("", k, v) for k, v in sorted(self.requests.items())],
        )
        metric(
            "request_success_total", "counter", "Finished completions (choices) by finish reason (vLLM's name).",
            [("", (("finished_reason", r),), v) for r, v in sorted(self.finish_reasons.items())],
        )
        metric("prompt_tokens_total", "counter", "Prompt tokens processed.", [("", (), self.prompt_tokens)])
        metric("generation_tokens_total", "counter", "Tokens generated.", [("", (), self.generation_tokens)])
        metric(
            "cached_prompt_tokens_total", "counter", "Prompt tokens served by the KV prefix cache.",
            [("", (), self.cached_prompt_tokens)],
        )
        metric(
            "time_to_first_token_seconds", "histogram",
            "Time from an HTTP request's arrival to each prompt's first token.", self.ttft.samples(),
        )
        metric(
            "e2e_request_latency_seconds", "histogram", "Time from a prompt's arrival in the engine to its last token.",
            self.e2e.samples(),
        )
        metric(
            "time_per_output_token_seconds", "histogram",
            "Per prompt: time from its first to its last token over the tokens after the first.",
            self.tpot.samples(),
        )

        gauges = [
            ("num_requests_running", "Requests being stepped by the engine."),
            ("num_requests_waiting", "Requests queued for admission."),
            ("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0..1; the name is vLLM's)."),
            ("kv_cache_blocks_used", "KV-cache blocks in use."),
            ("kv_cache_blocks_total", "KV-cache blocks in the pool."),
            ("prefix_cache_hit_rate", "KV prefix cache: hit tokens / queried tokens since start."),
            ("encoder_cache_hit_rate", "Encoder cache: hit items / queried items since start (0 with no multimodal model)."),
        ]
        for name, help_ in gauges:
            metric(name, "gauge", help_, [("", (), float(engine_stats.get(name, 0.0)))])
        counters = [
            ("prefix_cache_queries_total", "Prompt tokens looked up in the KV prefix cache."),
            ("prefix_cache_hits_total", "Prompt tokens found in the KV prefix cache."),
        ]
        for name, help_ in counters:
            metric(name, "counter", help_, [("", (), float(engine_stats.get(name, 0.0)))])
        # Speculative decoding, vLLM's spec_decode_* counters (all 0 / no positions when it is off).
        spec = [
            ("spec_decode_num_drafts_total", "Verify runs: a request's drafts checked in one step."),
            ("spec_decode_num_draft_tokens_total", "Draft tokens verified."),
            ("spec_decode_num_accepted_tokens_total", "Draft tokens accepted."),
        ]
        for name, help_ in spec:
            metric(name, "counter", help_, [("", (), float(engine_stats.get(name, 0.0)))])
        per_pos = engine_stats.get(PER_POS, ())
        metric(
            "spec_decode_num_accepted_tokens_per_pos_total", "counter",
            "Draft tokens accepted, by position in their run (0 = first draft).",
            [("", (("position", str(i)),), float(v)) for i, v in enumerate(per_pos)],
        )
        for name, kind, help_ in _REPLICA_METRICS if replicas else ():
            samples = [("", (("replica", str(int(r["replica"]))),), float(r.get(name, 0.0))) for r in replicas or ()]
            metric(f"replica_{name}", kind, help_, samples)
        return "\n".join(lines) + "\n"


# Per data-parallel replica (EngineArgs.data_parallel_size > 1): the load the router balances.
_REPLICA_METRICS = (
    ("up", "gauge", "1 while the replica serves; 0 once it died (its requests failed or moved)."),
    ("num_requests", "gauge", "Requests routed to the replica and not finished."),
    ("num_requests_running", "gauge", "Requests the replica is stepping."),
    ("num_requests_waiting", "gauge", "Requests queued in the replica for admission."),
    ("kv_cache_usage_perc", "gauge", "Fraction of the replica's KV-cache blocks in use."),
    ("cached_blocks", "gauge", "KV blocks the router knows the replica caches."),
    ("prefix_cache_queries_total", "counter", "Prompt tokens the replica looked up in its KV prefix cache."),
    ("prefix_cache_hits_total", "counter", "Prompt tokens the replica found in its KV prefix cache."),
)


def replica_loads(stats: Any) -> list[dict[str, float]]:
    """Each replica's load from a data-parallel engine's stats (``ReplicaLoad``s in
    ``stats.replicas``) under the ``replica_*`` names; empty for one engine."""
    out = []
    for r in getattr(stats, "replicas", None) or ():
        out.append({
            "replica": r.replica,
            "up": float(r.alive),
            "num_requests": r.num_requests,
            "num_requests_running": r.num_running_reqs,
            "num_requests_waiting": r.num_waiting_reqs,
            "kv_cache_usage_perc": r.kv_cache_usage,
            "cached_blocks": r.cached_blocks,
            "prefix_cache_queries_total": r.prefix_cache_query_tokens,
            "prefix_cache_hits_total": r.prefix_cache_hit_tokens,
        })  # fmt: skip
    return out


PER_POS = "spec_decode_num_accepted_tokens_per_pos_total"  # a tuple, one count per draft position


def normalize_engine_stats(stats: Any) -> dict[str, Any]:
    """Map ``engine.get_stats()`` (``EngineStats``, or a dict) onto the gauge names above.

    Fields are read by name with ``getattr``/``get`` and default to 0, so a
    renamed engine field degrades one gauge instead of breaking /metrics.
    """
    if stats is None:
        return {}

    def get(name: str) -> float:
        value = stats.get(name, 0.0) if isinstance(stats, dict) else getattr(stats, name, 0.0)
        return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0.0

    per_pos = stats.get("num_accepted_tokens_per_pos", ()) if isinstance(stats, dict) else getattr(
        stats, "num_accepted_tokens_per_pos", ()
    )
    used, total = get("kv_blocks_used"), get("kv_blocks_total")
    queries, hits = get("prefix_cache_query_tokens"), get("prefix_cache_hit_tokens")
    enc_queries, enc_hits = get("encoder_cache_queries"), get("encoder_cache_hits")
    return {
        "num_requests_running": get("num_running_reqs"),
        "num_requests_waiting": get("num_waiting_reqs"),
        "kv_cache_blocks_used": used,
        "kv_cache_blocks_total": total,
        "kv_cache_usage_perc": used / total if total else 0.0,
        "prefix_cache_queries_total": queries,
        "prefix_cache_hits_total": hits,
        "prefix_cache_hit_rate": hits / queries if queries else 0.0,
        "encoder_cache_hit_rate": enc_hits / enc_queries if enc_queries else 0.0,
        "spec_decode_num_drafts_total": get("num_drafts"),
        "spec_decode_num_draft_tokens_total": get("num_draft_tokens"),
        "spec_decode_num_accepted_tokens_total": get("num_accepted_tokens"),
        PER_POS: tuple(float(v) for v in per_pos),
    }
