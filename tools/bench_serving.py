"""Load a running northmk server with concurrent streaming clients; report latencies.

    python tools/bench_serving.py --url http://127.0.0.1:8000 --num-requests 64 \
        --concurrency 8 --prompt-lens 32,256,1024 --max-tokens 128 [--json]

Prompts are token-id prompts of exactly the given lengths (built from /tokenize output),
sent to /v1/completions with `ignore_eos` so every request generates exactly
--max-tokens tokens. Reports TTFT, inter-token latency, per-request decode tokens/s
(p50/p90/p99), and overall output tokens/s and requests/s. Loopback servers only.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import random
import sys
import time
from dataclasses import dataclass, field

import aiohttp
from yarl import URL

SEED_TEXT = ("def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n"
             "    return a\n\nclass Stack:\n    def __init__(self):\n        self.items = []\n")
PERCENTILES = (50, 90, 99)


@dataclass
class Result:
    prompt_len: int
    start: float
    first: float | None = None  # first generated token arrived
    end: float | None = None
    chunk_times: list[float] = field(default_factory=list)
    chunk_tokens: list[int] = field(default_factory=list)
    error: str | None = None

    @property
    def num_tokens(self) -> int:
        return sum(self.chunk_tokens)

    def inter_token_latencies(self) -> list[float]:
        """Gap between chunks, spread over the tokens the later chunk carried."""
        gaps = []
        for i in range(1, len(self.chunk_times)):
            gap = self.chunk_times[i] - self.chunk_times[i - 1]
            gaps += [gap / self.chunk_tokens[i]] * self.chunk_tokens[i]
        return gaps


def percentiles(values: list[float]) -> dict[str, float | None]:
    ordered = sorted(values)
    if not ordered:
        return {f"p{p}": None for p in PERCENTILES}
    return {f"p{p}": ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))] for p in PERCENTILES}


def check_loopback(url: str) -> None:
    host = URL(url).host or ""
    if host == "localhost":
        return
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        raise SystemExit(f"bench_serving: refusing non-loopback server {host!r}")


async def base_ids(session: aiohttp.ClientSession, url: str) -> list[int]:
    async with session.post(f"{url}/tokenize", json={"prompt": SEED_TEXT, "add_special_tokens": False}) as r:
        body = await r.json()
        if r.status != 200:
            raise SystemExit(f"bench_serving: /tokenize failed: {body}")
    return body["tokens"]


def make_prompt(ids: list[int], length: int, rng: random.Random) -> list[int]:
    start = rng.randrange(len(ids))  # different prompts share no long prefix
    return [ids[(start + i * 7) % len(ids)] for i in range(length)]


async def one_request(session: aiohttp.ClientSession, url: str, args, prompt: list[int]) -> Result:
    result = Result(len(prompt), time.perf_counter())
    body = {"model": args.model, "prompt": prompt, "max_tokens": args.max_tokens, "stream": True,
            "ignore_eos": True, "temperature": 0.0, "return_token_ids": True,
            "stream_options": {"include_usage": True}}
    try:
        async with session.post(f"{url}/v1/completions", json=body) as response:
            if response.status != 200:
                result.error = f"HTTP {response.status}: {(await response.text())[:200]}"
                return result
            async for line in response.content:
                if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    result.error = chunk["error"]["message"]
                    return result
                tokens = sum(len(c.get("token_ids") or []) for c in chunk.get("choices", []))
                if tokens:
                    now = time.perf_counter()
                    result.first = result.first or now
                    result.chunk_times.append(now)
                    result.chunk_tokens.append(tokens)
        result.end = time.perf_counter()
    except aiohttp.ClientError as error:
        result.error = f"{type(error).__name__}: {error}"
    return result


async def run(args) -> dict:
    url = args.url.rstrip("/")
    rng = random.Random(args.seed)
    lengths = [int(x) for x in args.prompt_lens.split(",")]
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    timeout = aiohttp.ClientTimeout(total=args.request_timeout)
    async with aiohttp.ClientSession(headers=headers, timeout=timeout) as session:
        ids = await base_ids(session, url)
        prompts = [make_prompt(ids, rng.choice(lengths), rng) for _ in range(args.num_requests)]
        queue: asyncio.Queue = asyncio.Queue()
        for p in prompts:
            queue.put_nowait(p)
        results: list[Result] = []
        deadline = time.perf_counter() + args.duration

        async def client() -> None:
            while not queue.empty() and time.perf_counter() < deadline:
                results.append(await one_request(session, url, args, queue.get_nowait()))

        start = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(args.concurrency)))
        wall = time.perf_counter() - start
    return summarize(results, wall, args)


def summarize(results: list[Result], wall: float, args) -> dict:
    ok = [r for r in results if r.error is None and r.first is not None]
    decode_rates = [(r.num_tokens - 1) / (r.end - r.first) for r in ok if r.num_tokens > 1 and r.end > r.first]
    total_tokens = sum(r.num_tokens for r in ok)
    return {
        "requests": len(results), "succeeded": len(ok), "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if r.error})[:5],
        "concurrency": args.concurrency, "max_tokens": args.max_tokens, "wall_s": round(wall, 3),
        "requests_per_s": len(ok) / wall if wall else 0.0,
        "output_tokens_per_s": total_tokens / wall if wall else 0.0,
        "ttft_s": percentiles([r.first - r.start for r in ok]),
        "itl_s": percentiles([g for r in ok for g in r.inter_token_latencies()]),
        "decode_tokens_per_s_per_request": percentiles(decode_rates),
        "e2e_s": percentiles([r.end - r.start for r in ok]),
    }


def print_report(report: dict) -> None:
    print(f"requests {report['succeeded']}/{report['requests']} ok in {report['wall_s']} s "
          f"(concurrency {report['concurrency']}, {report['max_tokens']} tokens each)")
    print(f"throughput: {report['requests_per_s']:.2f} req/s, {report['output_tokens_per_s']:.1f} output tok/s")
    for name, unit, scale in (("ttft_s", "ms", 1e3), ("itl_s", "ms", 1e3),
                              ("decode_tokens_per_s_per_request", "tok/s", 1), ("e2e_s", "s", 1)):
        values = "  ".join(f"{k} {'-' if v is None else f'{v * scale:.2f}'}" for k, v in report[name].items())
        print(f"{name:<34} [{unit}] {values}")
    for error in report["errors"]:
        print(f"error: {error}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="default: the server's first served name")
    p.add_argument("--api-key", default=None)
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--prompt-lens", default="32,128,512", help="comma-separated prompt lengths, mixed at random")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--duration", type=float, default=600.0, help="stop starting requests after this many s")
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")
    args = p.parse_args(argv)
    for name in ("num_requests", "concurrency", "max_tokens"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if any(not x.strip().isdigit() or int(x) < 1 for x in args.prompt_lens.split(",")):
        p.error("--prompt-lens must be positive integers separated by commas")
    check_loopback(args.url)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report = asyncio.run(run(args))
    if args.json:
        print(json.dumps(report))
    else:
        print_report(report)
    return 0 if report["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
