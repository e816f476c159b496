"""The controller's CPU cost of one HTTP generation request, as the server backends send them (CPU).

`generation.backend: http` (`rl_core.generation.http.backend.HttpBackend`) and the vLLM server
backend (`rl_core.generation.vllm.server`) send one request a sample through one
`httpx.AsyncClient` on the controller's event loop. This bench prices that path's client side
alone: it starts a minimal HTTP/1.1 server in a subprocess (raw asyncio, keep-alive, every answer
the same OpenAI completions body with 191 token ids and their logprobs, no generation) and posts
completions requests to it with the body `HttpBackend` sends, `--concurrency` in flight, then
reads each answer's ids and logprobs as `HttpBackend._result` does. It prints the client
process's CPU time per request and what 1,000 groups x 16 samples a step (16,000 requests) would
cost as a share of a 10 s step. The server runs in its own process, so its time is not counted;
on a 2-core machine it runs beside the client. The server is stopped by its PID at the end.

Run: .venv/bin/python bench/http_client_cost.py [--requests 3000] [--concurrency 16 64 256]
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import subprocess
import sys
import time

SERVER = r'''
import asyncio, json, random, sys
random.seed(0)
ids = [random.randrange(150000) for _ in range(191)]
lps = [-random.random() for _ in range(191)]
body = json.dumps({"id": "x", "object": "text_completion", "choices": [{"index": 0, "text": "", "token_ids": ids,
                   "finish_reason": "length", "logprobs": {"token_logprobs": lps}}]}).encode()
resp = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(body) + body

async def handle(reader, writer):
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            size = 0
            for line in head.split(b"\r\n"):
                if line.lower().startswith(b"content-length:"):
                    size = int(line.split(b":")[1])
            await reader.readexactly(size)
            writer.write(resp)
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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def cost(port: int, requests: int, concurrency: int) -> float:
    """Client CPU seconds per request over `requests` requests (after 500 warm-up requests)."""
    import httpx

    body = {"model": "m", "prompt": list(range(12)), "max_tokens": 256, "temperature": 1.0, "top_p": 1.0,
            "logprobs": 0, "return_token_ids": True, "seed": 1}
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(limits=limits, timeout=60.0) as client:
        gate = asyncio.Semaphore(concurrency)

        async def one() -> int:
            async with gate:
                r = await client.post(f"http://127.0.0.1:{port}/v1/completions", json=body)
                choice = r.json()["choices"][0]
                tokens = [int(t) for t in choice["token_ids"]]
                logprobs = [float(x) for x in choice["logprobs"]["token_logprobs"]]
                return len(tokens) + len(logprobs)

        await asyncio.gather(*[one() for _ in range(500)])
        cpu = time.process_time()
        await asyncio.gather(*[one() for _ in range(requests)])
        return (time.process_time() - cpu) / requests


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[16, 64, 256])
    args = parser.parse_args()
    port = free_port()
    server = subprocess.Popen([sys.executable, "-c", SERVER, str(port)], stdout=subprocess.PIPE, text=True)
    try:
        if server.stdout.readline().strip() != "ready":
            raise SystemExit("the bench's server did not start")
        for conc in args.concurrency:
            per = asyncio.run(cost(port, args.requests, conc))
            step = per * 16_000
            print(f"concurrency {conc:>4}: {per * 1e6:7.0f} us of client CPU a request; 1,000 groups x 16 samples "
                  f"(16,000 requests) = {step:.1f} s a step = {step / 10 * 100:.0f}% of a 10 s step", flush=True)
    finally:
        server.terminate()
        server.wait(timeout=10)


if __name__ == "__main__":
    main()
