"""The controller's CPU cost of HTTP generation, per sample, as `HttpBackend` sends it (CPU).

`generation.backend: http` (`rl_core.generation.http.backend.HttpBackend`) sends a single-turn
prompt group as one completions request (`generate_group`: `n` choices, one seed each, the
group call the rollout prefers), and any other sample as one request of its own (`generate`).
This bench prices the controller's side of both, side by side in one run, against the client
the backend used before (httpx, one request a sample, the standard-library JSON decoder):

- `httpx, a request a sample (before)`: `httpx.AsyncClient` posts, `response.json()`, ids,
  logprobs and versions read into Python lists: what HttpBackend did before it moved to
  aiohttp + orjson and group requests;
- `HttpBackend.generate`: the real backend, a request a sample;
- `HttpBackend.generate_group, JSON lists`: the real backend, a request a group of `--group`
  samples, the answer in the OpenAI layout (`token_arrays` off);
- `HttpBackend.generate_group, packed`: the same with the answer's ids, logprobs and versions
  packed (`return_token_arrays`, what the backend asks rl_core servers for);
- `httpx, a request a sample, vLLM (before)`, `VLLMServerBackend.generate` / `generate_group`:
  the vLLM server backend's client before, and now a request a sample or a group, against
  the same server answering vLLM's `/inference/v1/generate` shape (ids, a logprob record per
  token, version spans).

The server is a minimal HTTP/1.1 server in a subprocess (raw asyncio, keep-alive): it answers
`/health` and `/rl/metrics` as `rl-core serve` does, and every completions request with `n`
choices of 191 tokens each, in the shapes `rl-core serve` answers (`rl_core.serve.app`: text,
the OpenAI logprobs layout, prompt and completion ids, versions; or, with
`return_token_arrays`, the packed arrays), without generating. It runs in its own process, so
its time is not counted (on a 2-core machine it runs beside the client); it is stopped by its
PID at the end. Each line gives the client process's CPU time per sample, and what 1,000
groups x 16 samples a step (16,000 samples) would cost as a share of a 10 s step; the last
line compares the group paths with the clients before (at each concurrency). The timed part
runs with the collector settings of the controller's pumps (setup objects frozen, raised
thresholds).

Run: .venv/bin/python bench/http_client_cost.py [--samples 4800] [--concurrency 16 64 256]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import socket
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rl_core.metrics.gc_pauses import freeze_setup_objects, run_thresholds, unfreeze  # noqa: E402

SERVER = r'''
import asyncio, json, random, struct, sys
random.seed(0)
L = int(sys.argv[2]) if len(sys.argv) > 2 else 191  # completion tokens a choice
state = {"version": 0}
ids = [random.randrange(150000) for _ in range(L)]
lps = [-random.random() for _ in range(L)]
strs = ["".join(random.choice("abcdefgh ") for _ in range(random.randint(2, 6))) for _ in range(L)]
offsets = [sum(map(len, strs[:i])) for i in range(L)]
bodies = {}

def choice(i, packed, v):
    # the shapes of rl-core serve's /v1/completions answer (rl_core.serve.app): logprobs 0 with
    # return_token_ids (text, the OpenAI logprobs layout, ids, versions), or return_token_arrays
    if packed:
        return {"index": i, "finish_reason": "length", "start_version": v, "end_version": v,
                "token_ids_i32": struct.pack("<%di" % L, *ids).hex(),
                "token_logprobs_f32": struct.pack("<%df" % L, *lps).hex()}
    return {"index": i, "text": "".join(strs), "finish_reason": "length",
            "logprobs": {"tokens": strs, "token_logprobs": lps, "top_logprobs": None, "text_offset": offsets},
            "prompt_token_ids": list(range(12)), "token_ids": ids, "start_version": v, "end_version": v,
            "token_versions": [v] * L}

def vllm_choice(i, v):
    # vLLM's /inference/v1/generate choice (GenerateTokensChoice, sampled-token logprobs only)
    return {"index": i, "finish_reason": "length", "stop_reason": None, "token_ids": ids,
            "logprobs": {"content": [{"token_id": t, "logprob": lp, "rank": 1, "top_logprobs": []}
                                     for t, lp in zip(ids, lps)]},
            "routed_experts": None, "sampling_mask": None,
            "weight_versions": [{"version": str(v), "start": 0, "end": L}]}

def vllm_generate(n):
    key = "vllm", n, state["version"]
    if key not in bodies:
        bodies[key] = json.dumps({"request_id": "x", "choices": [vllm_choice(i, key[2]) for i in range(n)]}).encode()
    return bodies[key]

def completion(n, packed):
    key = n, packed, state["version"]
    if key not in bodies:
        bodies[key] = json.dumps({"id": "x", "object": "text_completion",
                                  "choices": [choice(i, packed, key[2]) for i in range(n)]}).encode()
    return bodies[key]

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
                body = json.dumps({"weight_version": state["version"], "max_batch_size": 256,
                                   "max_model_len": 65536}).encode()
            elif path == b"/rl/update_weights":  # the version only (controller_scale.py's refit)
                state["version"] = int(json.loads(raw)["version"])
                body = json.dumps({"weight_version": state["version"]}).encode()
            elif path in (b"/rl/metrics", b"/update_weight_version"):
                body = b"{}"
            elif path == b"/inference/v1/generate":
                body = vllm_generate(int(json.loads(raw)["sampling_params"].get("n", 1)))
            else:
                req = json.loads(raw)
                body = completion(int(req.get("n", 1)), bool(req.get("return_token_arrays")))
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


def start_server(tokens: int = 191) -> tuple[subprocess.Popen, str]:
    """The bench's instant server (choices of `tokens` tokens) in a subprocess, and its URL; the
    caller stops it by its PID (`server.terminate()`)."""
    port = free_port()
    server = subprocess.Popen([sys.executable, "-c", SERVER, str(port), str(tokens)], stdout=subprocess.PIPE,
                              text=True)
    if server.stdout.readline().strip() != "ready":
        server.terminate()
        raise SystemExit("the bench's server did not start")
    return server, f"http://127.0.0.1:{port}"


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
    # the controller's collector settings while its pumps run (controller.py): setup objects
    # frozen, raised thresholds; otherwise full collections over the imported libraries'
    # objects, triggered by the answers' many small objects, dominate the larger answers
    freeze_setup_objects()
    old = run_thresholds(64)  # the default async_rl.max_inflight_groups is 32; 1,000-group runs raise it
    try:
        cpu = time.process_time()
        await asyncio.gather(*[one(i) for i in range(total // samples_each)])
        return (time.process_time() - cpu) / (total // samples_each * samples_each)
    finally:
        gc.set_threshold(*old)
        unfreeze()


async def httpx_per_sample(url: str, total: int, concurrency: int, vllm: bool = False) -> float:
    """The client before: httpx, `response.json()`, the answer read as `HttpBackend._result`
    (`vllm`: as `VLLMServerBackend.generate`) read it."""
    import httpx

    if vllm:
        path, body = "/inference/v1/generate", {"request_id": "r", "token_ids": list(range(12)), "model": "m",
                                                 "sampling_params": {"n": 1, "temperature": 1.0, "max_tokens": 256,
                                                                     "seed": 1, "logprobs": 0}}
    else:
        path, body = "/v1/completions", {"model": "m", "prompt": list(range(12)), "max_tokens": 256,
                                         "temperature": 1.0, "top_p": 1.0, "logprobs": 0, "return_token_ids": True,
                                         "seed": 1}
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(limits=limits, timeout=60.0) as client:
        async def call(i: int):
            choice = (await client.post(f"{url}{path}", json=body)).json()["choices"][0]
            tokens = [int(t) for t in choice["token_ids"]]
            if vllm:
                content = choice["logprobs"]["content"]
                [float(c["logprob"]) for c in content]
                any(int(c["token_id"]) != t for c, t in zip(content, tokens))
            else:
                [float(x) for x in choice["logprobs"]["token_logprobs"]]
                [int(v) for v in choice["token_versions"]]

        return await _timed(call, 1, total, concurrency)


async def drive(backend, total: int, concurrency: int, group: int) -> float:
    """Start `backend`, time a `generate` a sample (`group` 1) or a `generate_group` a group of
    `group` (consecutive seeds), shut it down; client CPU seconds a sample."""
    from rl_core.types import GenerationRequest, SamplingParams

    await backend.start()
    params, prompt, seeds = SamplingParams(temperature=1.0, max_tokens=256), list(range(12)), list(range(1000, 1000 + group))
    try:
        if group == 1:
            async def call(i: int):
                await backend.generate(GenerationRequest(f"r{i}-{time.monotonic_ns()}", prompt,
                                                         SamplingParams(temperature=1.0, max_tokens=256, seed=i)))
        else:
            async def call(i: int):
                await backend.generate_group(f"g{i}-{time.monotonic_ns()}", prompt, params, seeds)

        return await _timed(call, group, total, concurrency)
    finally:
        await backend.shutdown()


async def backend_cost(url: str, total: int, concurrency: int, group: int, arrays: bool = True) -> float:
    from rl_core.generation.http.backend import HttpBackend

    backend = HttpBackend([url], model_name="m", health_check_interval_s=60.0)
    backend.token_arrays = arrays
    return await drive(backend, total, concurrency, group)


async def vllm_cost(url: str, total: int, concurrency: int, group: int) -> float:
    from rl_core.generation.vllm.backend import VLLMOptions
    from rl_core.generation.vllm.server import VLLMServerBackend

    return await drive(VLLMServerBackend(VLLMOptions(model="m", max_num_seqs=256), server_url=url), total,
                       concurrency, group)


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
    server, url = start_server()
    shares, ratios = [], []
    try:
        for conc in args.concurrency:
            print(f"{conc} samples in flight:", flush=True)
            old = asyncio.run(httpx_per_sample(url, args.samples, conc))
            print(line("httpx, a request a sample (before)", old), flush=True)
            single = asyncio.run(backend_cost(url, args.samples, conc, 1))
            print(line("HttpBackend.generate (a request a sample)", single), flush=True)
            lists = asyncio.run(backend_cost(url, args.samples, conc, args.group, arrays=False))
            print(line(f"HttpBackend.generate_group ({args.group}), JSON lists", lists), flush=True)
            grouped = asyncio.run(backend_cost(url, args.samples, conc, args.group))
            print(line(f"HttpBackend.generate_group ({args.group}), packed", grouped), flush=True)
            v_old = asyncio.run(httpx_per_sample(url, args.samples, conc, vllm=True))
            print(line("httpx, a request a sample, vLLM (before)", v_old), flush=True)
            v1 = asyncio.run(vllm_cost(url, args.samples, conc, 1))
            print(line("VLLMServerBackend.generate (a sample)", v1), flush=True)
            vg = asyncio.run(vllm_cost(url, args.samples, conc, args.group))
            print(line(f"VLLMServerBackend.generate_group ({args.group})", vg), flush=True)
            shares.append((grouped * SAMPLES_PER_STEP / STEP_S * 100, vg * SAMPLES_PER_STEP / STEP_S * 100))
            ratios.append((old / grouped, v_old / vg))
    finally:
        server.terminate()
        server.wait(timeout=10)
    print(f"at 1,000 groups x 16 a 10 s step: HttpBackend (group requests, packed) "
          f"{min(a for a, _ in shares):.1f}-{max(a for a, _ in shares):.1f}% of the step, "
          f"{min(a for a, _ in ratios):.0f}-{max(a for a, _ in ratios):.0f}x less CPU a sample than before; "
          f"VLLMServerBackend (group requests) {min(b for _, b in shares):.1f}-{max(b for _, b in shares):.1f}%, "
          f"{min(b for _, b in ratios):.1f}-{max(b for _, b in ratios):.1f}x less than before")


if __name__ == "__main__":
    main()
