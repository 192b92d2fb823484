"""Prometheus text rendering, engine-stat mapping and the periodic stats line."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import pytest
from oai_helpers import metric_samples

from omnistage.entrypoints.openai.metrics import ServerMetrics, normalize_engine_stats
from omnistage.entrypoints.openai.stats_log import StatsLogger
from omnistage.outputs import CompletionOutput, RequestMetrics, RequestOutput


@dataclass
class _Stats:
    num_running_reqs: int = 2
    num_waiting_reqs: int = 1
    kv_blocks_used: int = 5
    kv_blocks_total: int = 20
    prefix_cache_queries: int = 3  # admissions, not tokens: must not be mistaken for query tokens
    prefix_cache_query_tokens: int = 100
    prefix_cache_hit_tokens: int = 25


def test_engine_stats_mapping() -> None:
    s = normalize_engine_stats(_Stats())
    assert s["kv_cache_usage_perc"] == 0.25
    assert s["prefix_cache_hit_rate"] == 0.25
    assert s["num_requests_running"] == 2 and s["num_requests_waiting"] == 1
    assert s["encoder_cache_hit_rate"] == 0.0
    assert normalize_engine_stats({"encoder_cache_queries": 8, "encoder_cache_hits": 6})["encoder_cache_hit_rate"] == 0.75
    assert normalize_engine_stats(None) == {}


def test_render() -> None:
    m = ServerMetrics()
    m.record_request("chat", "success")
    m.record_request("chat", "success")
    m.record_request("completions", "client_error")
    m.record_tokens(10, 4, 2)
    m.record_finish("length")
    m.record_ttft(0.03)
    m.record_ttft(100.0)
    text = m.render(normalize_engine_stats(_Stats()))
    s = metric_samples(text)
    assert s['omnistage:requests_total{endpoint="chat",outcome="success"}'] == 2
    assert s['omnistage:requests_total{endpoint="completions",outcome="client_error"}'] == 1
    assert s["omnistage:prompt_tokens_total"] == 10 and s["omnistage:generation_tokens_total"] == 4
    assert s['omnistage:request_success_total{finished_reason="length"}'] == 1  # vLLM's name and label
    assert s['omnistage:time_to_first_token_seconds_bucket{le="0.025"}'] == 0
    assert s['omnistage:time_to_first_token_seconds_bucket{le="0.05"}'] == 1
    assert s['omnistage:time_to_first_token_seconds_bucket{le="60"}'] == 1
    assert s['omnistage:time_to_first_token_seconds_bucket{le="+Inf"}'] == 2
    assert s["omnistage:time_to_first_token_seconds_count"] == 2
    assert s["omnistage:kv_cache_usage_perc"] == 0.25
    assert s["omnistage:prefix_cache_hit_rate"] == 0.25
    assert s["omnistage:encoder_cache_hit_rate"] == 0
    assert "# TYPE omnistage:time_to_first_token_seconds histogram" in text


def test_engine_counters_never_go_back() -> None:
    """A scrape without engine stats (busy past the timeout, or down) shows the last ones read,
    and a rebuilt engine's counters, restarting at 0, add to what the old one had counted."""
    m = ServerMetrics()
    first = {"num_draft_tokens": 40, "num_accepted_tokens": 30, "num_accepted_tokens_per_pos": (20, 10)}
    s = metric_samples(m.render(normalize_engine_stats({**vars(_Stats()), **first})))
    hits, accepted = "omnistage:prefix_cache_hits_total", "omnistage:spec_decode_num_accepted_tokens_total"
    pos1 = 'omnistage:spec_decode_num_accepted_tokens_per_pos_total{position="1"}'
    assert (s[hits], s[accepted], s[pos1], s["omnistage:num_requests_running"]) == (25, 30, 10, 2)
    busy = metric_samples(m.render(normalize_engine_stats(None)))
    assert (busy[hits], busy[accepted], busy[pos1], busy["omnistage:num_requests_running"]) == (25, 30, 10, 2)
    rebuilt = {"prefix_cache_hit_tokens": 5, "num_accepted_tokens": 3, "num_accepted_tokens_per_pos": (2, 1)}
    s = metric_samples(m.render(normalize_engine_stats(rebuilt)))
    assert (s[hits], s[accepted], s[pos1], s["omnistage:num_requests_running"]) == (30, 33, 11, 0)
    assert s["omnistage:kv_cache_blocks_total"] == 0  # a gauge, whatever its name: as read
    later = {**rebuilt, "prefix_cache_hit_tokens": 9, "num_accepted_tokens_per_pos": (4, 1)}
    s = metric_samples(m.render(normalize_engine_stats(later)))
    assert (s[hits], s[pos1], s['omnistage:spec_decode_num_accepted_tokens_per_pos_total{position="0"}']) == (
        34, 11, 24
    )


def _finished(arrival: float, first: float | None, finished: float | None, n_tokens: int) -> RequestOutput:
    choice = CompletionOutput(index=0, text="", token_ids=list(range(n_tokens)), finish_reason="length")
    metrics = RequestMetrics(arrival_time=arrival, first_token_time=first, finished_time=finished)
    return RequestOutput("r", None, [1, 2], [choice], finished=True, metrics=metrics)


def test_latency_histograms() -> None:
    m = ServerMetrics()
    m.record_latencies(_finished(10.0, 10.5, 12.5, 5))  # e2e 2.5 s; (12.5 - 10.5) / 4 = 0.5 s per token
    m.record_latencies(_finished(0.0, 0.02, 0.02, 1))  # one token: no time per output token
    m.record_latencies(_finished(0.0, None, None, 0))  # no timestamps: nothing
    s = metric_samples(m.render({}))
    e2e, tpot = "omnistage:e2e_request_latency_seconds", "omnistage:time_per_output_token_seconds"
    assert s[f"{e2e}_count"] == 2 and s[f"{e2e}_sum"] == pytest.approx(2.52)
    assert s[f'{e2e}_bucket{{le="0.025"}}'] == 1 and s[f'{e2e}_bucket{{le="2.5"}}'] == 2
    assert s[f"{tpot}_count"] == 1 and s[f"{tpot}_sum"] == pytest.approx(0.5)
    assert s[f'{tpot}_bucket{{le="0.25"}}'] == 0 and s[f'{tpot}_bucket{{le="0.5"}}'] == 1


@dataclass
class _EngineStats:
    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 100
    prefix_cache_query_tokens: int = 0
    prefix_cache_hit_tokens: int = 0
    num_generated_tokens: int = 0


def test_stats_windows(caplog) -> None:
    log = StatsLogger(interval_s=10.0, now=0.0)
    with caplog.at_level(logging.INFO, logger="omnistage.entrypoints.openai.stats_log"):
        idle = log.log(_EngineStats(), now=10.0)
        busy = log.log(
            _EngineStats(3, 1, 25, 100, prefix_cache_query_tokens=400, prefix_cache_hit_tokens=100, num_generated_tokens=50),
            now=20.0,
        )
        tail = log.log(
            _EngineStats(0, 0, 0, 100, prefix_cache_query_tokens=400, prefix_cache_hit_tokens=100, num_generated_tokens=70),
            now=25.0,
        )
        quiet = log.log(_EngineStats(prefix_cache_query_tokens=400, prefix_cache_hit_tokens=100, num_generated_tokens=70), now=35.0)
    assert not idle.active and not quiet.active
    assert busy.prompt_tokens_per_s == 40.0 and busy.generation_tokens_per_s == 5.0
    assert busy.prefix_cache_hit_rate == 0.25 and busy.kv_cache_usage == 0.25
    assert tail.generation_tokens_per_s == 4.0 and tail.prefix_cache_hit_rate is None  # nothing admitted
    assert [r.getMessage() for r in caplog.records] == [
        "engine: 3 running, 1 waiting, KV cache 25.0% used, prefix-cache hit rate 25.0%, "
        "prompt 40.0 tokens/s, generation 5.0 tokens/s",
        "engine: 0 running, 0 waiting, KV cache 0.0% used, prefix-cache hit rate -, "
        "prompt 0.0 tokens/s, generation 4.0 tokens/s",
    ]
