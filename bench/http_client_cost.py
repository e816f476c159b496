"""The controller's CPU cost of HTTP generation, per sample, as `HttpBackend` sends it (CPU).

`generation.backend: http` (`rl_core.generation.http.backend.HttpBackend`) sends a single-turn
prompt group as one completions request (`generate_group`: `n` choices, one seed each, the
group call the rollout prefers), and any other sample as one request of its own (`generate`).
This bench prices the controller's side of both, side by side in one run, against the client
the backend used before (httpx, one request a sample, the standard-library JSON decoder):

- `httpx, a request a sample`: `httpx.AsyncClient` posts and `response.json()`, ids and
  logprobs read into Python lists (what HttpBackend did until it moved to aiohttp + orjson);
- `HttpBackend.generate`: the real backend, a request a sample;
- `HttpBackend.generate_group`: the real backend, a request a group of `--group` samples.

The server is a minimal HTTP/1.1 server in a subprocess (raw asyncio, keep-alive): it answers
`/health` and `/rl/metrics` as `rl-core serve` does, and every completions request with `n`
choices of 191 token ids, their logprobs and weight versions (what `return_token_ids` adds),
without generating. It runs in its own process, so its time is not counted (on a 2-core
machine it runs beside the client); it is stopped by its PID at the end. Each line gives the
client process's CPU time per sample, and what 1,000 groups x 16 samples a step (16,000
samples) would cost as a share of a 10 s step; the last line the ratio of the old path to the
group path.

Run: .venv/bin/python bench/http_client_cost.py [--samples 4800] [--concurrency 16 64 256]
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SERVER = r'''
import asyncio, json, random, sys
random.seed(0)
ids = [random.randrange(150000) for _ in range(191)]
lps = [-random.random() for _ in range(191)]
bodies = {}

def completion(n):
    if n not in bodies:
        choice = lambda i: {"index": i, "text": "", "token_ids": ids, "prompt_token_ids": list(range(12)),
                            "finish_reason": "length", "logprobs": {"token_logprobs": lps},
                            "start_version": 0, "end_version": 0, "token_versions": [0] * len(ids)}
        bodies[n] = json.dumps({"id": "x", "object": "text_completion",
                                "choices": [choice(i) for i in range(n)]}).encode()
    return bodies[n]

HEALTH = json.dumps({"weight_version": 0, "max_batch_size": 256, "max_model_len": 4096}).encode()

async def handle(reader, writer):
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            size = 0
            for line in head.split(b"\r\n"):
                if line.lower().startswith(b"content-length:"):
                    size = int(line.split(b":")[1])
            raw = await reader.readexactly(size)
            path = head.split(b" ", 2)[1]
            if path == b"/health":
                body = HEALTH
            elif path == b"/rl/metrics":
                body = b"{}"
            else:
                body = completion(int(json.loads(raw).get("n", 1)))
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n"
                         % len(body) + body)
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionResetError):
        pass

async def main():
    server = await asyncio.start_server(handle, "127.0.0.1", int(sys.argv[1]))
    print("ready", flush=True)
    async with server:
        await server.serve_forever()

asyncio.run(main())
'''

SAMPLES_PER_STEP = 16_000  # 1,000 groups x 16 samples
STEP_S = 10.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _timed(calls, samples_each: int, total: int, concurrency: int) -> float:
    """Client CPU seconds per sample over `total` samples (after a warm-up of a tenth)."""
    gate = asyncio.Semaphore(max(1, concurrency // samples_each))

    async def one(i: int):
        async with gate:
            await calls(i)

    await asyncio.gather(*[one(i) for i in range(max(1, total // samples_each // 10))])
    cpu = time.process_time()
    await asyncio.gather(*[one(i) for i in range(total // samples_each)])
    return (time.process_time() - cpu) / (total // samples_each * samples_each)


async def httpx_per_sample(url: str, total: int, concurrency: int) -> float:
    import httpx

    body = {"model": "m", "prompt": list(range(12)), "max_tokens": 256, "temperature": 1.0, "top_p": 1.0,
            "logprobs": 0, "return_token_ids": True, "seed": 1}
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(limits=limits, timeout=60.0) as client:
        async def call(i: int):
            choice = (await client.post(f"{url}/v1/completions", json=body)).json()["choices"][0]
            [int(t) for t in choice["token_ids"]], [float(x) for x in choice["logprobs"]["token_logprobs"]]

        return await _timed(call, 1, total, concurrency)


async def backend_cost(url: str, total: int, concurrency: int, group: int) -> float:
    from rl_core.generation.http.backend import HttpBackend
    from rl_core.types import GenerationRequest, SamplingParams

    backend = HttpBackend([url], model_name="m", health_check_interval_s=60.0)
    await backend.start()
    params = SamplingParams(temperature=1.0, max_tokens=256)
    prompt = list(range(12))
    try:
        if group == 1:
            async def call(i: int):
                await backend.generate(GenerationRequest(f"r{i}-{time.monotonic_ns()}", prompt,
                                                         SamplingParams(temperature=1.0, max_tokens=256, seed=i)))
        else:
            seeds = list(range(group))

            async def call(i: int):
                await backend.generate_group(f"g{i}-{time.monotonic_ns()}", prompt, params, seeds)

        return await _timed(call, group, total, concurrency)
    finally:
        await backend.shutdown()


def line(name: str, per_sample: float) -> str:
    step = per_sample * SAMPLES_PER_STEP
    return (f"  {name:<44} {per_sample * 1e6:7.1f} us a sample; 16,000 samples a step = {step:6.2f} s "
            f"= {step / STEP_S * 100:5.1f}% of a 10 s step")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=4800, help="samples timed per path and concurrency")
    parser.add_argument("--group", type=int, default=16, help="samples a group (n of a group request)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[16, 64, 256],
                        help="samples in flight at once")
    args = parser.parse_args()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen([sys.executable, "-c", SERVER, str(port)], stdout=subprocess.PIPE, text=True)
    worst_old, worst_group = 0.0, 0.0
    try:
        if server.stdout.readline().strip() != "ready":
            raise SystemExit("the bench's server did not start")
        for conc in args.concurrency:
            print(f"{conc} samples in flight:", flush=True)
            old = asyncio.run(httpx_per_sample(url, args.samples, conc))
            print(line("httpx, a request a sample (before)", old), flush=True)
            single = asyncio.run(backend_cost(url, args.samples, conc, 1))
            print(line("HttpBackend.generate (a request a sample)", single), flush=True)
            grouped = asyncio.run(backend_cost(url, args.samples, conc, args.group))
            print(line(f"HttpBackend.generate_group ({args.group} a request)", grouped), flush=True)
            worst_old, worst_group = max(worst_old, old), max(worst_group, grouped)
    finally:
        server.terminate()
        server.wait(timeout=10)
    print(f"HttpBackend with group requests: {worst_group * SAMPLES_PER_STEP / STEP_S * 100:.1f}% of a 10 s step "
          f"at 1,000 groups x 16 (worst concurrency), {worst_old / worst_group:.1f}x less CPU a sample than httpx "
          f"with a request a sample ({worst_old * SAMPLES_PER_STEP / STEP_S * 100:.0f}%)")


if __name__ == "__main__":
    main()
