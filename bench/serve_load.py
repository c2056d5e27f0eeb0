"""Load on a running `twell serve`: at each concurrency, `rounds x concurrency` streamed
chat requests through the OpenAI client (AsyncOpenAI), at most `concurrency` in flight.
Reports the aggregate generated tokens/s and the p50/p99 time to first token, as JSON.

    python3 bench/serve_load.py BASE_URL --concurrency 1,8,32,64 --max-tokens 32 [--rounds 2]
"""

import argparse
import asyncio
import json
import statistics
import time

import openai

PROMPTS = [
    "Tell me about the history of the printing press.",
    "Write a short story about a lighthouse keeper.",
    "Explain how vaccines train the immune system.",
    "What are the main causes of the seasons on Earth?",
]


async def one(client, i, max_tokens, ttfts, counts):
    start = time.perf_counter()
    first = None
    tokens = 0
    stream = await client.chat.completions.create(
        model="default",
        messages=[{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
        max_tokens=max_tokens, temperature=0.7, seed=i, stream=True,
        stream_options={"include_usage": True},
    )
    async for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].delta.content:
            first = time.perf_counter() - start
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    ttfts.append(first if first is not None else time.perf_counter() - start)
    counts.append(tokens)


async def level(base_url, concurrency, rounds, max_tokens):
    client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=600)
    gate = asyncio.Semaphore(concurrency)
    ttfts, counts = [], []

    async def gated(i):
        async with gate:
            await one(client, i, max_tokens, ttfts, counts)

    start = time.perf_counter()
    await asyncio.gather(*(gated(i) for i in range(rounds * concurrency)))
    wall = time.perf_counter() - start
    await client.close()
    q = statistics.quantiles(ttfts, n=100, method="inclusive") if len(ttfts) > 1 else ttfts * 99
    return {
        "concurrency": concurrency,
        "requests": len(counts),
        "generated_tokens": sum(counts),
        "wall_secs": wall,
        "tokens_per_sec": sum(counts) / wall,
        "ttft_p50_secs": statistics.median(ttfts),
        "ttft_p99_secs": q[98],
    }


def main():
    p = argparse.ArgumentParser()
    p.add_argument("base_url")
    p.add_argument("--concurrency", default="1,8,32,64")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=32)
    a = p.parse_args()
    out = [asyncio.run(level(a.base_url, int(c), a.rounds, a.max_tokens)) for c in a.concurrency.split(",")]
    print(json.dumps(out))


main()
