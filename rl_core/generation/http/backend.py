"""HttpBackend: the `GenerationBackend` protocol over N OpenAI-compatible HTTP servers.

Owns: driving `rl-core serve` servers (started here on 127.0.0.1, or given by URL) or any
OpenAI-compatible server that returns token ids (`server_kind="openai"`; no weight updates
then) through the fleet's one HTTP client: a request a sample (`generate`) or one a prompt
group on rl_core servers (`generate_group`: `n` choices, the `seeds` extension, packed
answers); retries of infrastructure failures with backoff (data errors raise
`GenerationRequestError` at once; seeds travel with the request, each attempt its own
server-side id), weight updates fanned out to every server (a published version directory,
or the trainer's broadcast group), aborts through `/rl/abort`, every token's weight version.

Does not own: the servers' engines (rl_core.serve), routing and health (fleet.py), local
server processes (servers.py), or when to refit. Read more: docs/generation.md, "The HTTP backend".
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import operator
import secrets
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import torch

from rl_core.generation.base import GenerationError
from rl_core.columns import GroupResults, generate_each, logprob_array, token_array
from rl_core.generation.http.fleet import (TRANSPORT_ERRORS, Endpoint, FleetPolicy, GenerationRequestError, ServerFleet,
                                           error_message, from_json, is_infra_status)
from rl_core.generation.http.servers import EngineArgs, LocalServer
from rl_core.server_contract import DEFAULT_CONTROL_SECRET_ENV, MAX_N
from rl_core.types import GenerationRequest, GenerationResult, SamplingParams

_INDEX = operator.itemgetter("index")

log = logging.getLogger(__name__)

__all__ = ["GenerationRequestError", "HttpBackend", "make_http_backend"]


class HttpBackend:
    """Generation over HTTP servers (see the module docstring)."""

    def __init__(self, urls: Sequence[str] = (), *, model_dir: str | Path | None = None, num_local_servers: int = 0,
                 engine_args: EngineArgs | None = None, server_kind: str = "rl_core", api_key: str | None = None,
                 control_secret: str | None = None,
                 model_name: str | None = None, weight_root: str | Path | None = None, keep_weight_versions: int = 2,
                 weight_version: int = 0, routing: str = "least_outstanding", request_timeout_s: float = 600.0,
                 connect_timeout_s: float = 10.0, max_retries: int = 3, retry_backoff_s: float = 0.5,
                 retry_max_backoff_s: float = 10.0, health_check_interval_s: float = 5.0,
                 startup_timeout_s: float = 300.0, max_local_server_restarts: int = 3,
                 log_dir: str | Path | None = None, name: str = "http", servers: Sequence[LocalServer] = ()):
        if servers:  # server processes built by the caller (e.g. Slurm job steps: slurm_servers.py)
            num_local_servers, model_dir = len(servers), model_dir or servers[0].model_dir
        if bool(urls) == bool(num_local_servers):
            raise ValueError("give server URLs or a number of local servers to start (exactly one of them)")
        if num_local_servers and model_dir is None:
            raise ValueError("local servers need model_dir (the HF directory they load)")
        if server_kind not in ("rl_core", "openai"):
            raise ValueError(f"server_kind is {server_kind!r}; expected 'rl_core' or 'openai'")
        if server_kind == "openai" and num_local_servers:
            raise ValueError("local servers are rl_core servers (server_kind 'rl_core')")
        self.name = name
        self.kind = server_kind
        self.model_name = model_name
        self.api_key = api_key
        self.control_secret = control_secret  # remote `rl-core serve --managed` servers' X-RL-Core-Secret
        self.weight_root = None if weight_root is None else Path(weight_root)
        self.keep_weight_versions = keep_weight_versions
        self._version = weight_version
        self._latest_dir: Path | None = None
        self._sync = None  # FilesystemWeightSync, created on the first state-dict update
        endpoints = [Endpoint(url.rstrip("/")) for url in urls]
        if num_local_servers:
            self.api_key = secrets.token_urlsafe(24)  # local servers accept only this backend's requests
            self.model_name = model_name or Path(model_dir).resolve().name
            log_dir = Path(log_dir) if log_dir is not None else Path(model_dir).resolve().parent / "servers"
            for server in servers:
                server.token = self.api_key
            endpoints = [Endpoint("", local=server) for server in servers] or [
                Endpoint("", local=LocalServer(i, model_dir, engine_args or EngineArgs(), self.api_key, log_dir,
                                               self.model_name, weight_version)) for i in range(num_local_servers)]
        # requests: HTTP completions requests (a group request counts once); samples: the samples they asked for
        self.counters = {k: 0 for k in ("requests", "group_requests", "samples", "retries", "infra_errors",
                                        "data_errors", "aborts", "weight_updates", "server_restarts",
                                        "stale_servers_caught_up")}
        policy = FleetPolicy(kind=server_kind, routing=routing, request_timeout_s=request_timeout_s,
                             connect_timeout_s=connect_timeout_s, startup_timeout_s=startup_timeout_s,
                             max_retries=max_retries, retry_backoff_s=retry_backoff_s,
                             retry_max_backoff_s=retry_max_backoff_s, health_check_interval_s=health_check_interval_s,
                             max_local_server_restarts=max_local_server_restarts)
        self.fleet = ServerFleet(endpoints, policy, self.counters)
        self.fleet.catch_up = self._catch_up
        if server_kind == "openai":
            self.generate_group = None  # a plain server seeds its choices its own way: a request a sample
        # rl_core servers answer with packed arrays (`return_token_arrays`), not the OpenAI lists;
        # bench/http_client_cost.py turns this off to price the lists
        self.token_arrays = True
        self._prepared = False
        self._started = False
        self._update_lock: asyncio.Lock | None = None
        # request id -> (server, the server's id of it, the POST, whether the POST is a group's)
        self._inflight: dict[str, tuple[Endpoint, str, asyncio.Task, bool]] = {}
        self._pending: set[str] = set()
        self._aborted: set[str] = set()
        self.last_update_s = 0.0
        self._started_at = 0.0
        # set by a broadcast transport (rl_core.weights.broadcast): brings servers that are behind
        # (restarted from the initial weights, or missed a version) to the current one
        self.broadcast_catch_up = None

    @property
    def endpoints(self) -> list[Endpoint]:
        return self.fleet.endpoints

    @property
    def max_model_len(self) -> int | None:
        """The smallest context the rl_core servers told (GET /health), None when none did: what a
        session's prompt is checked against (rl_core.rollout.session_server)."""
        known = [ep.max_model_len for ep in self.fleet.endpoints if ep.max_model_len]
        return min(known) if known else None

    @property
    def weight_version(self) -> int:
        return self._version

    # ------------------------------------------------------------------ life cycle

    def prepare(self) -> None:
        """Launch the local servers and wait until they serve (blocking; safe to run in a
        thread while the trainer builds). A no-op for remote servers."""
        if not self._prepared:
            self.fleet.launch_local()
            self._prepared = True

    def close_sync(self) -> None:
        """Stop local servers (by PID)."""
        self.fleet.stop_local()

    async def start(self) -> None:
        if self._started:
            raise RuntimeError("HttpBackend.start() was already called")
        self._started, self._started_at = True, time.monotonic()
        if not self._prepared:
            await asyncio.to_thread(self.prepare)
        self.fleet.open(self.api_key, self.control_secret)
        self._update_lock = asyncio.Lock()
        try:
            await self._first_contact()
        except BaseException:
            await self.shutdown()
            raise
        self.fleet.start_health(self.name)

    async def _first_contact(self) -> None:
        """Wait (up to startup_timeout_s) until every server answers; check model and versions."""
        policy = self.fleet.policy
        deadline = time.monotonic() + policy.startup_timeout_s
        while True:
            await self.fleet.check_all(catch_up=False)
            if all(ep.healthy for ep in self.endpoints) or time.monotonic() > deadline:
                break
            await asyncio.sleep(min(1.0, policy.health_check_interval_s))
        down = [f"{ep.url} ({ep.last_error})" for ep in self.endpoints if not ep.healthy]
        if down:
            raise GenerationError(f"generation servers did not answer within {policy.startup_timeout_s:.0f}s "
                                  f"(generation.http.startup_timeout_s): {', '.join(down)}")
        if self.model_name is None:
            models = await self.fleet.request("GET", self.endpoints[0], "/v1/models")
            self.model_name = models["data"][0]["id"]
        if self.kind == "rl_core":
            wrong = [f"{ep.url} serves {ep.version}" for ep in self.endpoints if ep.version != self._version]
            if wrong:
                raise GenerationError(
                    f"servers serve another weight version than the trainer's ({self._version}): {', '.join(wrong)}. "
                    f"Start them from the same policy with --weight-version {self._version}.")

    async def shutdown(self) -> None:
        for rid in list(self._inflight):
            try:
                await self.abort(rid)
            except Exception:  # noqa: BLE001 - best effort while shutting down
                pass
        await self.fleet.close()
        await asyncio.to_thread(self.close_sync)

    # ------------------------------------------------------------------ generation

    def _body(self, prompt_ids, p: SamplingParams) -> dict[str, Any]:
        greedy = p.is_greedy
        body: dict[str, Any] = {
            "model": self.model_name, "prompt": list(prompt_ids), "max_tokens": p.max_tokens,
            "temperature": 0.0 if greedy else p.temperature, "top_p": 1.0 if greedy else p.top_p,
            "logprobs": 0, "return_token_ids": True,
        }
        if p.top_k and not greedy:
            body["top_k"] = p.top_k
        if p.seed is not None:
            body["seed"] = p.seed
        if p.stop_strings:
            body["stop"] = list(p.stop_strings)
        if p.stop_token_ids:
            body["stop_token_ids"] = list(p.stop_token_ids)
        if self.kind == "rl_core" and self.token_arrays:  # ids, logprobs, versions packed (serve.protocol)
            body["return_token_arrays"] = True
        return body

    def _check(self, params: SamplingParams) -> None:
        if params.top_logprobs:
            raise GenerationRequestError("top_logprobs are not available through the HTTP backend (the OpenAI "
                                         "format names tokens by text, not id); request 0")
        if self.fleet.client is None:
            raise RuntimeError("HttpBackend.start() must be awaited before generate")

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        self._check(request.params)
        rid = request.request_id
        started = time.monotonic()
        answer = await self._complete(rid, [rid], self._body(request.prompt_ids, request.params))
        if answer is None:
            return self._aborted_result(request, started)
        ep, data = answer
        return self._result(request, ep, data, started)

    async def generate_group(self, key: str, prompt_ids: list[int], params: SamplingParams,
                             seeds: list[int]) -> GroupResults:
        """One prompt group in one completions request (`n` = len(seeds), the rl_core extension
        `seeds`: choice i samples with seeds[i]), so sample i is what `generate` of
        `f"{key}/{i}"` with seed seeds[i] gives (`protocols.GroupGenerationBackend`). One
        request a group instead of one a sample, its answer packed (`return_token_arrays`): the
        controller's CPU a sample falls several times (`bench/http_client_cost.py`). rl_core
        servers only: a plain OpenAI server derives its choices' seeds its own way
        (`server_kind: openai` turns this off)."""
        self._check(params)
        n = len(seeds)
        if n > MAX_N:  # more choices than a request may ask for: a request a sample
            return await generate_each(self.generate, key, prompt_ids, params, seeds)
        sample_ids = [f"{key}/{i}" for i in range(n)]
        body = self._body(prompt_ids, params)
        body.pop("seed", None)
        body.update(n=n, seeds=[int(s) for s in seeds])
        answer = await self._complete(key, sample_ids, body)
        if answer is None:
            return GroupResults([[] for _ in sample_ids], [[] for _ in sample_ids], ["abort"] * n, [self._version] * n,
                                [self._version] * n, [[] for _ in sample_ids], worker="")
        ep, data = answer
        choices = data.get("choices")
        indexes = [c.get("index") if isinstance(c, dict) else None for c in choices] \
            if isinstance(choices, list) else None
        if indexes is None or sorted(indexes, key=str) != sorted(range(n), key=str):
            raise GenerationError(f"server {ep.url} answered choices with indexes {indexes} for a request of n={n} "
                                  f"(group {key!r}); expected each of 0..{n - 1} once")
        version = self._version if ep.version is None else ep.version
        tokens, logprobs, finishes, starts, ends, versions = [], [], [], [], [], []
        for choice in sorted(choices, key=_INDEX):
            ids, lps = self._columns(ep, choice)
            tokens.append(token_array(ids))  # no copy of the arrays of `return_token_arrays`
            logprobs.append(logprob_array(lps))
            finishes.append(choice.get("finish_reason") or "stop")
            start = int(choice.get("start_version", version))
            starts.append(start)
            ends.append(int(choice.get("end_version", version)))
            versions.append(choice.get("token_versions") or [start] * len(ids))  # sent when the version changed
        return GroupResults(tokens, logprobs, finishes, starts, ends, versions, worker=ep.url)

    async def _complete(self, key: str, sample_ids: list[str], body: dict) -> tuple[Endpoint, dict] | None:
        """POST `body` to /v1/completions on a routable server until it answers: infrastructure
        failures are retried elsewhere (with backoff, at most max_retries times), data errors
        raise `GenerationRequestError`. `sample_ids`: the request ids the answer's choices stand
        for (abortable by `abort`; one for `generate`, `f"{key}/{i}"` for a group). Returns the
        server and its answer, or None when every sample was aborted before it was sent."""
        busy = [rid for rid in sample_ids if rid in self._pending]
        if busy:
            raise GenerationRequestError(f"request_id {busy[0]!r} is already in flight (ids must be unique)")
        self._pending.update(sample_ids)
        group = len(sample_ids) > 1 or sample_ids[0] != key
        self.counters["requests"] += 1
        self.counters["group_requests"] += group
        self.counters["samples"] += len(sample_ids)
        try:
            for attempt in itertools.count():
                if all(rid in self._aborted for rid in sample_ids):
                    return None
                ep = await self.fleet.pick()
                server_rid = f"{key}@{attempt}"
                payload = {**body, "request_id": server_rid} if self.kind == "rl_core" else body
                if ep.max_model_len and body["max_tokens"] > ep.max_model_len:
                    # the server refuses more than its context (400); the engine would stop there anyway
                    payload = {**payload, "max_tokens": ep.max_model_len}
                post = asyncio.ensure_future(self.fleet.send("POST", f"{ep.url}/v1/completions", json=payload))
                for i, rid in enumerate(sample_ids):  # a group's choice i runs on the server as "<id>/i"
                    self._inflight[rid] = (ep, f"{server_rid}/{i}" if group else server_rid, post, group)
                ep.outstanding += len(sample_ids)  # routing balances samples, not requests
                ep.requests += 1
                try:
                    status, raw = await post
                except asyncio.CancelledError:
                    if post.cancelled() and all(rid in self._aborted for rid in sample_ids):
                        return None
                    if self.kind == "rl_core":  # the caller gave up: free the server at once
                        asyncio.ensure_future(self._abort_on(ep, server_rid))
                    raise
                except TRANSPORT_ERRORS as exc:
                    error = f"{type(exc).__name__}: {exc}"
                else:
                    if status == 200:
                        return ep, from_json(raw)
                    error = f"HTTP {status}: {error_message(raw)}"
                    if not is_infra_status(status):
                        self.counters["data_errors"] += 1
                        raise GenerationRequestError(f"server {ep.url} refused request {key!r}: {error}")
                finally:
                    ep.outstanding -= len(sample_ids)
                    for rid in sample_ids:
                        self._inflight.pop(rid, None)
                self.counters["infra_errors"] += 1
                self.fleet.suspect(ep, error)
                if attempt >= self.fleet.policy.max_retries:
                    raise GenerationError(f"request {key!r} failed {attempt + 1} times on generation servers "
                                          f"(generation.http.max_retries = {self.fleet.policy.max_retries}); "
                                          f"last: {ep.url}: {error}")
                self.counters["retries"] += 1
                await asyncio.sleep(self.fleet.policy.backoff(attempt))
            raise AssertionError("unreachable")
        finally:
            self._pending.difference_update(sample_ids)
            self._aborted.difference_update(sample_ids)

    @staticmethod
    def _columns(ep: Endpoint, choice: dict) -> tuple:
        """A choice's token ids and logprobs, checked: 1-D int64 and float32 arrays from an rl_core
        server (`return_token_arrays`), else the answer's lists."""
        packed = choice.get("token_ids_i32")
        if packed is not None:
            try:
                tokens = np.frombuffer(bytes.fromhex(packed), dtype="<i4").astype(np.int64)
                logprobs = np.frombuffer(bytes.fromhex(choice["token_logprobs_f32"]), dtype="<f4")
            except (KeyError, TypeError, ValueError) as exc:
                raise GenerationError(f"server {ep.url} answered token arrays that do not decode ({exc!r}); "
                                      "expected hex of little-endian int32 ids and float32 logprobs")
            if tokens.size != logprobs.size:
                raise GenerationError(f"server {ep.url} returned {tokens.size} tokens but {logprobs.size} logprobs")
            return tokens, logprobs.astype(np.float32, copy=False)
        try:
            tokens = choice["token_ids"]
            logprobs = (choice.get("logprobs") or {})["token_logprobs"]
        except (KeyError, TypeError) as exc:
            raise GenerationError(f"server {ep.url} answered without token ids or logprobs ({exc!r}); rl_core "
                                  "needs `return_token_ids` and `logprobs` support (rl-core serve, vLLM >= 0.10.2)")
        if not isinstance(tokens, list) or not isinstance(logprobs, list) or len(logprobs) != len(tokens):
            raise GenerationError(f"server {ep.url} returned {len(tokens)} tokens but {len(logprobs)} logprobs"
                                  if isinstance(tokens, list) and isinstance(logprobs, list) else
                                  f"server {ep.url} returned token ids or logprobs that are not lists")
        return tokens, logprobs

    def _result(self, request: GenerationRequest, ep: Endpoint, data: dict, started: float) -> GenerationResult:
        try:
            choice = data["choices"][0]
        except (KeyError, IndexError, TypeError) as exc:
            raise GenerationError(f"server {ep.url} answered without choices ({exc!r})")
        tokens, logprobs = self._columns(ep, choice)
        if isinstance(tokens, np.ndarray):
            tokens, logprobs = tokens.tolist(), logprobs.tolist()
        else:
            tokens, logprobs = [int(t) for t in tokens], [float(x) for x in logprobs]
        version = self._version if ep.version is None else ep.version
        start = int(choice.get("start_version", version))
        versions = choice.get("token_versions") or [start] * len(tokens)  # sent when the version changed
        return GenerationResult(
            request_id=request.request_id, prompt_ids=list(request.prompt_ids), token_ids=tokens, logprobs=logprobs,
            finish_reason=choice.get("finish_reason") or "stop",
            start_version=start, end_version=int(choice.get("end_version", version)),
            token_versions=[int(v) for v in versions], started_at=started, finished_at=time.monotonic(), worker=ep.url)

    def _aborted_result(self, request: GenerationRequest, started: float) -> GenerationResult:
        return GenerationResult(request.request_id, list(request.prompt_ids), [], [], "abort", self._version,
                                self._version, token_versions=[], started_at=started, finished_at=time.monotonic())

    async def abort(self, request_id: str) -> None:
        where = self._inflight.get(request_id)
        if where is None:
            if request_id in self._pending:  # between attempts: it returns an abort result
                self._aborted.add(request_id)
                self.counters["aborts"] += 1
            return
        ep, server_rid, post, group = where
        self._aborted.add(request_id)
        self.counters["aborts"] += 1
        if self.kind == "rl_core" and await self._abort_on(ep, server_rid):
            return  # the server returns the partial result
        if not group:
            post.cancel()  # nobody else needs this request's answer
        # else one sample of a group request the server does not hold (not arrived yet, or
        # done): the group's other samples need the answer, so this one ends as generated

    async def _abort_on(self, ep: Endpoint, server_rid: str) -> bool:
        """Abort on the server; False if it did not hold the request (not arrived yet, or done)."""
        try:
            data = await self.fleet.request("POST", ep, "/rl/abort", json={"request_ids": [server_rid]},
                                            timeout=self.fleet.policy.connect_timeout_s)
            return int(data.get("aborted", 0)) > 0
        except (GenerationError, GenerationRequestError):
            return False

    # ------------------------------------------------------------------ weights

    async def update_weights(self, version: int, weights: Mapping[str, torch.Tensor] | str | Path) -> None:
        """Publish `weights` (or use the published directory) and have every server load it."""
        if self.kind != "rl_core":
            raise GenerationError("plain OpenAI servers cannot load new weights; use rl-core serve servers for RL")
        t0 = time.monotonic()
        if isinstance(weights, (str, Path)):
            path = Path(weights)
        else:
            if self.weight_root is None:
                raise GenerationError("update_weights with a state dict needs weight_root (a directory every "
                                      "server can read)")
            if self._sync is None:
                from rl_core.weights.filesystem import FilesystemWeightSync

                self._sync = FilesystemWeightSync(self.weight_root, keep_last_versions=self.keep_weight_versions)
            await asyncio.to_thread(self._sync.write, version, weights)
            from rl_core.weights.filesystem import version_dir

            path = version_dir(self.weight_root, version)
        async with self._update_lock:
            self._latest_dir = path.resolve()
            previous, self._version = self._version, version
            targets = [ep for ep in self.endpoints if ep.healthy]
            outcomes = await asyncio.gather(*(self._load(ep, version) for ep in targets), return_exceptions=True)
            loaded = 0
            for ep, outcome in zip(targets, outcomes):
                if isinstance(outcome, GenerationRequestError):
                    self._version = previous
                    raise outcome
                if isinstance(outcome, BaseException):
                    ep.stale = True
                    ep.last_error = f"missed weight version {version}: {outcome}"
                    log.warning("generation server %s missed weight version %d: %s", ep.url, version, outcome)
                else:
                    loaded += 1
            for ep in self.endpoints:
                if ep not in targets:
                    ep.stale = True  # unhealthy now: it loads the current version when it comes back
            if not loaded:
                self._version = previous
                raise GenerationError(f"no generation server loaded weight version {version}")
        self.counters["weight_updates"] += 1
        self.last_update_s = time.monotonic() - t0

    async def _load(self, ep: Endpoint, version: int) -> None:
        data = await self.fleet.request("POST", ep, "/rl/update_weights", retries=self.fleet.policy.max_retries,
                                        json={"version": version, "path": str(self._latest_dir)})
        ep.version = int(data["weight_version"])
        ep.stale = False

    @property
    def weight_group_host(self) -> str:
        """The address the servers reach this process at for the weight-broadcast group: this
        node's name when a server runs on another node, else 127.0.0.1."""
        import socket

        return socket.gethostname() if any(ep.local is not None and ep.local.remote for ep in self.endpoints) \
            else "127.0.0.1"

    def weight_group_members(self) -> list[Endpoint]:
        """The servers that can join a broadcast group now: healthy (answering; stale ones included)."""
        return [ep for ep in self.endpoints if ep.healthy]

    async def join_weight_broadcast(self, host: str, port: int, timeout_s: float, bucket_size_mb: float,
                                    members: Sequence[Endpoint] | None = None) -> list[dict]:
        """Have server i of `members` (default: every server) join the trainer's broadcast group
        as rank i + 1, leaving any group it was in (rank 0, the trainer, joins at the same time:
        this returns once the whole group formed)."""
        members = list(self.endpoints if members is None else members)
        world = len(members) + 1
        return list(await asyncio.gather(*(
            self.fleet.request("POST", ep, "/rl/init_weight_broadcast", timeout=timeout_s,
                               json={"host": host, "port": port, "rank": i + 1, "world_size": world,
                                     "timeout_s": timeout_s, "bucket_size_mb": bucket_size_mb})
            for i, ep in enumerate(members))))

    async def receive_weight_broadcast(self, version: int, timeout_s: float,
                                       members: Sequence[Endpoint] | None = None) -> list[dict]:
        """Have every server of the group (`members`, default every server) receive `version`
        from it and load it (the trainer sends meanwhile); returns each server's report
        (bytes, recv_s, load_s). The others are marked stale: they catch up later."""
        members = list(self.endpoints if members is None else members)
        async with self._update_lock:
            out = list(await asyncio.gather(*(
                self.fleet.request("POST", ep, "/rl/receive_weights", timeout=timeout_s, json={"version": version})
                for ep in members)))
            for ep, data in zip(members, out):
                ep.version = int(data["weight_version"])
            self.defer_weights(version)
        self.counters["weight_updates"] += 1
        return out

    def defer_weights(self, version: int) -> None:
        """Make `version` the backend's: a server at another one takes no request until it has
        loaded it (`broadcast_catch_up`; e.g. it was down while the group received it)."""
        self._version = version
        for ep in self.endpoints:
            ep.stale = ep.version != version

    async def invalidate_kv_cache(self) -> None:
        if self.kind != "rl_core":
            raise GenerationError("plain OpenAI servers have no invalidate endpoint")
        targets = [ep for ep in self.endpoints if ep.routable]
        outcomes = await asyncio.gather(*(self.fleet.request("POST", ep, "/rl/invalidate_kv_cache") for ep in targets),
                                        return_exceptions=True)
        for ep, outcome in zip(targets, outcomes):
            if isinstance(outcome, GenerationRequestError):
                raise outcome
            if isinstance(outcome, BaseException):
                self.fleet.suspect(ep, str(outcome))

    async def _catch_up(self, ep: Endpoint) -> None:
        """Called after each successful health check: bring a server that missed weight
        updates (or restarted from the initial weights) to the current version."""
        if self.kind != "rl_core":
            return
        if ep.version == self._version:
            ep.stale = False
            return
        if self.broadcast_catch_up is not None:  # the trainer's broadcast group carries the weights
            await self.broadcast_catch_up(self)
            self.counters["stale_servers_caught_up"] += 1
            return
        if self._update_lock.locked():
            return  # a fan-out is loading it now
        async with self._update_lock:
            ep.stale = True
            if self._latest_dir is None:
                raise GenerationError(f"server {ep.url} serves weight version {ep.version}, the backend "
                                      f"{self._version}, and no version directory was published yet")
            await self._load(ep, self._version)
            self.counters["stale_servers_caught_up"] += 1

    # ------------------------------------------------------------------ reporting

    def capacity(self) -> int:
        return self.fleet.capacity()

    def metrics(self) -> dict[str, float]:
        out = {k: float(v) for k, v in self.counters.items()}
        out.update(self.fleet.metrics())
        out.update(weight_version=float(self._version), last_update_s=self.last_update_s,
                   uptime_s=time.monotonic() - self._started_at if self._started_at else 0.0)
        return out


def make_http_backend(cfg: Any, policy_dir: str | Path, *, device: str, weight_version: int = 0) -> HttpBackend:
    """The recipe's `generation.backend: http` (not started). Servers rl_core starts run the
    native engine with `generation.native` settings on the run's device and log to <run
    dir>/servers: on this machine, or, inside the controller job with `cluster.generation`,
    as Slurm job steps on the generation nodes (slurm_servers.py). Weight versions go to
    `trainer.weight_sync.dir` (default <run dir>/weights)."""
    import os

    from rl_core.config import run_dir
    from rl_core.generation.http.slurm_servers import generation_nodes, slurm_servers
    from rl_core.generation.native.options import EngineOptions

    gen, rd = cfg.generation, run_dir(cfg)
    h, ws = gen.http, cfg.trainer.weight_sync
    nodes = generation_nodes(cfg) if h.num_local_servers else None
    engine = EngineArgs(EngineOptions.from_recipe(cfg, device=device),
                        torch_num_threads=h.server_torch_num_threads or cfg.runtime.torch_num_threads,
                        cuda_devices=() if nodes else tuple(h.local_server_cuda_devices),
                        lockstep=cfg.async_rl.reproducible)
    servers = slurm_servers(cfg, nodes, policy_dir, engine, rd / "servers", weight_version) if nodes else ()
    return HttpBackend(
        h.urls, model_dir=policy_dir if h.num_local_servers else None, num_local_servers=h.num_local_servers,
        servers=servers, model_name=servers[0].model_name if servers else None,
        engine_args=engine, api_key=os.environ.get(h.api_key_env) or None,
        control_secret=os.environ.get(DEFAULT_CONTROL_SECRET_ENV) or None,  # remote `rl-core serve --managed`
        weight_root=Path(ws.dir) if ws.dir else rd / "weights",
        keep_weight_versions=ws.keep_last_versions, weight_version=weight_version, routing=h.routing,
        request_timeout_s=h.request_timeout_s, connect_timeout_s=h.connect_timeout_s, max_retries=h.max_retries,
        retry_backoff_s=h.retry_backoff_s, retry_max_backoff_s=h.retry_max_backoff_s,
        health_check_interval_s=h.health_check_interval_s, startup_timeout_s=h.startup_timeout_s,
        max_local_server_restarts=h.max_local_server_restarts, log_dir=rd / "servers")
