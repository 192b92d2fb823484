"""The server's periodic engine-stats log line.

Every ``interval_s`` seconds the server samples ``engine.get_stats()`` (in the
engine thread, between steps) and logs one INFO line::

    engine: 3 running, 1 waiting, KV cache 12.5% used, prefix-cache hit rate 40.0%,
    prompt 512.0 tokens/s, generation 88.3 tokens/s

Policy: a line is logged only when requests are running or waiting, or when
tokens were admitted or generated since the previous sample, so an idle server
logs one last line after its work ends and then stays quiet. Rates and the hit
rate cover the interval since the previous sample: prompt tokens are those of
requests admitted to the KV cache (cached ones included, as vLLM counts them),
and the hit rate is ``-`` when nothing was admitted. Each record carries the
numbers as ``record.engine_stats`` (a ``StatsWindow``) for log handlers.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

DEFAULT_INTERVAL_S = 10.0


@dataclass(frozen=True)
class _Counters:
    time: float
    prompt_tokens: int  # admitted to the KV cache (``prefix_cache_query_tokens``)
    hit_tokens: int
    generated_tokens: int


@dataclass(frozen=True)
class StatsWindow:
    """What one line reports: the load now, and the counts since the previous sample."""

    running: int
    waiting: int
    kv_cache_usage: float  # 0..1
    interval_s: float
    prompt_tokens: int
    generation_tokens: int
    prefix_cache_hit_rate: float | None  # None: nothing admitted in the interval

    @property
    def prompt_tokens_per_s(self) -> float:
        return self.prompt_tokens / self.interval_s if self.interval_s > 0 else 0.0

    @property
    def generation_tokens_per_s(self) -> float:
        return self.generation_tokens / self.interval_s if self.interval_s > 0 else 0.0

    @property
    def active(self) -> bool:
        return bool(self.running or self.waiting or self.prompt_tokens or self.generation_tokens)

    def format(self) -> str:
        hit = "-" if self.prefix_cache_hit_rate is None else f"{100 * self.prefix_cache_hit_rate:.1f}%"
        return (
            f"engine: {self.running} running, {self.waiting} waiting, "
            f"KV cache {100 * self.kv_cache_usage:.1f}% used, prefix-cache hit rate {hit}, "
            f"prompt {self.prompt_tokens_per_s:.1f} tokens/s, generation {self.generation_tokens_per_s:.1f} tokens/s"
        )


def _int(stats: Any, name: str) -> int:
    value = getattr(stats, name, 0)
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0


class StatsLogger:
    """Turns successive ``EngineStats`` samples into ``StatsWindow``s (and log lines)."""

    def __init__(self, interval_s: float = DEFAULT_INTERVAL_S, now: float | None = None) -> None:
        self.interval_s = interval_s
        start = time.monotonic() if now is None else now
        self._last = _Counters(start, 0, 0, 0)  # counters start at zero with the engine

    def window(self, stats: Any, now: float | None = None) -> StatsWindow:
        """The window from the previous sample to ``stats`` (taken at ``now``); advances the baseline."""
        now = time.monotonic() if now is None else now
        cur = _Counters(
            now,
            _int(stats, "prefix_cache_query_tokens"),
            _int(stats, "prefix_cache_hit_tokens"),
            _int(stats, "num_generated_tokens"),
        )
        last, self._last = self._last, cur
        queried = cur.prompt_tokens - last.prompt_tokens
        used, total = _int(stats, "kv_blocks_used"), _int(stats, "kv_blocks_total")
        return StatsWindow(
            running=_int(stats, "num_running_reqs"),
            waiting=_int(stats, "num_waiting_reqs"),
            kv_cache_usage=used / total if total else 0.0,
            interval_s=cur.time - last.time,
            prompt_tokens=queried,
            generation_tokens=cur.generated_tokens - last.generated_tokens,
            prefix_cache_hit_rate=(cur.hit_tokens - last.hit_tokens) / queried if queried > 0 else None,
        )

    def log(self, stats: Any, now: float | None = None) -> StatsWindow:
        w = self.window(stats, now)
        if w.active:
            logger.info("%s", w.format(), extra={"engine_stats": w})
        return w

    async def run(self, client: Any, timeout_s: float) -> None:
        """Sample ``client`` (an ``EngineClient``) every interval until cancelled."""
        while True:
            await asyncio.sleep(self.interval_s)
            if not client.is_healthy:
                continue
            try:
                stats = await asyncio.wait_for(client.get_stats(), timeout_s)
            except Exception:  # noqa: BLE001 - a missed sample must not stop the logger
                logger.debug("engine stats unavailable for the stats line", exc_info=True)
                continue
            self.log(stats)
