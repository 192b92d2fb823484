"""Prometheus text rendering and engine-stat mapping."""

from __future__ import annotations

from dataclasses import dataclass

from omnistage.entrypoints.openai.metrics import ServerMetrics, normalize_engine_stats


@dataclass
class _Stats:
    num_running_reqs: int = 2
    num_waiting_reqs: int = 1
    kv_blocks_used: int = 5
    kv_blocks_total: int = 20
    prefix_cache_queries: int = 3  # admissions, not tokens: must not be mistaken for query tokens
    prefix_cache_query_tokens: int = 100
    prefix_cache_hit_tokens: int = 25


def _samples(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def test_engine_stats_mapping() -> None:
    s = normalize_engine_stats(_Stats())
    assert s["kv_cache_usage_ratio"] == 0.25
    assert s["prefix_cache_hit_rate"] == 0.25
    assert s["num_requests_running"] == 2 and s["num_requests_waiting"] == 1
    assert s["encoder_cache_hit_rate"] == 0.0
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
    s = _samples(text)
    assert s['omnistage_requests_total{endpoint="chat",outcome="success"}'] == 2
    assert s['omnistage_requests_total{endpoint="completions",outcome="client_error"}'] == 1
    assert s["omnistage_prompt_tokens_total"] == 10 and s["omnistage_generation_tokens_total"] == 4
    assert s['omnistage_time_to_first_token_seconds_bucket{le="0.025"}'] == 0
    assert s['omnistage_time_to_first_token_seconds_bucket{le="0.05"}'] == 1
    assert s['omnistage_time_to_first_token_seconds_bucket{le="60"}'] == 1
    assert s['omnistage_time_to_first_token_seconds_bucket{le="+Inf"}'] == 2
    assert s["omnistage_time_to_first_token_seconds_count"] == 2
    assert s["omnistage_kv_cache_usage_ratio"] == 0.25
    assert s["omnistage_prefix_cache_hit_rate"] == 0.25
    assert s["omnistage_encoder_cache_hit_rate"] == 0
    assert "# TYPE omnistage_time_to_first_token_seconds histogram" in text
