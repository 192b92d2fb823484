"""Serving benchmark: the OpenAI server against offline ``LLMEngine`` on the same prompts.

For each concurrency level (default 1, 8, 32) the same prompts run twice, in one
process run, side by side:

- offline: ``LLMEngine`` driven inline, with at most ``c`` requests in flight
  (a new one is added as soon as one finishes), the upper bound for the server;
- server: ``c`` streaming HTTP clients (asyncio + httpx) against
  ``omnistage serve`` on ``/v1/completions``.

Every request generates exactly ``--max-tokens`` tokens (greedy, ``ignore_eos``),
so both sides do identical work. Reported per level: requests/s, output
tokens/s, time to first token and inter-token latency percentiles (p50/p90/p99),
and the server/offline throughput ratio (1.0 = no serving overhead).

By default the script starts the server itself (a subprocess on a free loopback
port; it idles while the offline runs go, so the two never share the CPU, and
each level runs offline then server back to back so both see the same
background load); ``--url`` points it at a server already running on the same
model instead.

    python benchmarks/bench_server.py                  # embedded default model
    python benchmarks/bench_server.py --model /path/to/checkpoint --concurrency 1 8
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field

import httpx

TOPICS = [
    "the history of paris", "how rivers form", "why the sky is blue", "the life of bees", "how a compiler works",
    "the rules of chess", "volcanoes", "the moon landing", "how bread rises", "the water cycle", "black holes",
    "the roman empire", "photosynthesis", "how vaccines work", "the printing press", "ocean tides",
]


def make_prompts(n: int) -> list[str]:
    return [f"Write a short paragraph about {TOPICS[i % len(TOPICS)]} (note {i})." for i in range(n)]


@dataclass
class RunResult:
    wall_s: float
    num_requests: int
    output_tokens: int
    ttft_s: list[float] = field(default_factory=list)
    itl_s: list[float] = field(default_factory=list)

    @property
    def req_per_s(self) -> float:
        return self.num_requests / self.wall_s

    @property
    def tok_per_s(self) -> float:
        return self.output_tokens / self.wall_s


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q / 100 * (len(s) - 1))))]


# --------------------------------------------------------------------------- offline


def run_offline(engine, prompts: list[str], concurrency: int, max_tokens: int) -> RunResult:
    from omnistage.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    pending = list(enumerate(prompts))
    started: dict[str, float] = {}
    last_token_time: dict[str, float] = {}
    seen_tokens: dict[str, int] = {}
    result = RunResult(0.0, len(prompts), 0)
    t0 = time.perf_counter()

    def admit() -> None:
        while pending and len(started) < concurrency:
            i, p = pending.pop(0)
            rid = f"off-{concurrency}-{i}"
            engine.add_request(rid, p, params)
            started[rid] = time.perf_counter()
            seen_tokens[rid] = 0

    admit()
    while engine.has_unfinished_requests():
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            rid = out.request_id
            n = len(out.outputs[0].token_ids)
            if n > seen_tokens[rid]:
                if seen_tokens[rid] == 0:
                    result.ttft_s.append(now - started[rid])
                else:
                    result.itl_s.append((now - last_token_time[rid]) / (n - seen_tokens[rid]))
                last_token_time[rid] = now
                seen_tokens[rid] = n
            if out.finished:
                result.output_tokens += n
                del started[rid]
        admit()
    result.wall_s = time.perf_counter() - t0
    return result


# --------------------------------------------------------------------------- server


async def _one_stream(http: httpx.AsyncClient, model: str, prompt: str, max_tokens: int, result: RunResult) -> None:
    body = {
        "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
        "stream": True, "stream_options": {"include_usage": True},
    }
    t_start = time.perf_counter()
    t_prev: float | None = None
    async with http.stream("POST", "/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"server answered {resp.status_code}: {(await resp.aread())[:300]!r}")
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            now = time.perf_counter()
            if chunk.get("usage"):
                result.output_tokens += chunk["usage"]["completion_tokens"]
            if not chunk["choices"] or not chunk["choices"][0]["text"]:
                continue
            if t_prev is None:
                result.ttft_s.append(now - t_start)
            else:
                result.itl_s.append(now - t_prev)
            t_prev = now


async def run_server_load(base_url: str, model: str, prompts: list[str], concurrency: int, max_tokens: int) -> RunResult:
    result = RunResult(0.0, len(prompts), 0)
    queue: asyncio.Queue[str] = asyncio.Queue()
    for p in prompts:
        queue.put_nowait(p)
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=base_url, timeout=600, limits=limits) as http:

        async def worker() -> None:
            while not queue.empty():
                await _one_stream(http, model, queue.get_nowait(), max_tokens, result)

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        result.wall_s = time.perf_counter() - t0
    return result


def start_server(args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    from omnistage.entrypoints.openai.api_server import find_free_port

    port = find_free_port()
    cmd = [
        sys.executable, "-m", "omnistage.entrypoints.openai.api_server", "--host", "127.0.0.1", "--port", str(port),
        "--log-level", "warning", "--max-num-seqs", str(max(args.concurrency)), "--served-model-name", "bench",
    ]
    if args.model:
        cmd += ["--model", args.model]
    if args.max_model_len:
        cmd += ["--max-model-len", str(args.max_model_len)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=None, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with code {proc.returncode} during startup")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise TimeoutError("the server did not become healthy in 600 s")


# --------------------------------------------------------------------------- main


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint (default: the embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--url", default=None, help="use a running server on the same model instead of starting one")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--prompts-per-client", type=int, default=1, help="requests per level = max(8, this * concurrency)")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--skip-offline", action="store_true")
    args = ap.parse_args()

    levels = {c: make_prompts(max(8, args.prompts_per_client * c)) for c in args.concurrency}

    # Start the server first and keep it idle while the offline engine runs: an
    # idle server costs nothing (its engine thread blocks on its queue), and
    # running offline and server back to back per level keeps both under the
    # same background load on a shared machine.
    proc = None
    url = args.url
    if url is None:
        proc, url = start_server(args)
    offline: dict[int, RunResult] = {}
    server: dict[int, RunResult] = {}
    try:
        engine = None
        if not args.skip_offline:
            from omnistage.engine.arg_utils import EngineArgs
            from omnistage.engine.stage_engine import LLMEngine

            engine = LLMEngine(EngineArgs(model=args.model, max_model_len=args.max_model_len, max_num_seqs=max(args.concurrency)))
            run_offline(engine, make_prompts(2), 2, 4)  # warm-up
        model = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
        asyncio.run(run_server_load(url, model, make_prompts(2), 2, 4))  # warm-up
        for c, prompts in levels.items():
            if engine is not None:
                offline[c] = run_offline(engine, prompts, c, args.max_tokens)
            server[c] = asyncio.run(run_server_load(url, model, prompts, c, args.max_tokens))
            off = f"{offline[c].req_per_s:7.2f}" if c in offline else "      -"
            print(f"c={c:<3d} offline {off} req/s   server {server[c].req_per_s:7.2f} req/s", flush=True)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)

    ms = 1000.0
    print()
    print(f"model={args.model or 'embedded default (SmolLM2-135M-Instruct)'}  max_tokens={args.max_tokens}  cpu_count={os.cpu_count()}")
    header = (
        f"{'conc':>4} {'reqs':>4} | {'srv req/s':>9} {'srv tok/s':>9} | {'TTFT p50/p90/p99 ms':>22} | "
        f"{'ITL p50/p90/p99 ms':>20} | {'off req/s':>9} {'off TTFT p50':>12} {'off ITL p50':>11} | {'srv/off':>7}"
    )
    print(header)
    print("-" * len(header))
    for c in args.concurrency:
        s = server[c]
        o = offline.get(c)
        ttft = "/".join(f"{pct(s.ttft_s, q) * ms:.0f}" for q in (50, 90, 99))
        itl = "/".join(f"{pct(s.itl_s, q) * ms:.1f}" for q in (50, 90, 99))
        off = (
            f"{o.req_per_s:9.2f} {pct(o.ttft_s, 50) * ms:10.0f}ms {pct(o.itl_s, 50) * ms:9.1f}ms | {s.req_per_s / o.req_per_s:7.2f}"
            if o else f"{'-':>9} {'-':>12} {'-':>11} | {'-':>7}"
        )
        print(f"{c:>4} {s.num_requests:>4} | {s.req_per_s:9.2f} {s.tok_per_s:9.1f} | {ttft:>22} | {itl:>20} | {off}")
    if offline:
        mean_ratio = statistics.fmean(server[c].req_per_s / offline[c].req_per_s for c in args.concurrency)
        print(f"\nserver throughput / offline throughput, mean over levels: {mean_ratio:.2f}")


if __name__ == "__main__":
    main()
