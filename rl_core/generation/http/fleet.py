"""The servers behind an `HttpBackend`: their state, routing, health checks and restarts.

Owns: `Endpoint` (one server: healthy, stale, weight version, capacity, outstanding requests,
counters) and `ServerFleet`: routing (`pick`: the routable server with the fewest outstanding
requests, ties rotating, or `round_robin`; while none is routable a request waits up to
`startup_timeout_s`); health checks every `health_check_interval_s` (a failure, or a
transport error a request reports through `suspect`, takes a server out until a check
succeeds; a server at another weight version goes to the backend's catch-up; a dead local
server is relaunched up to `max_local_server_restarts` times); the one HTTP client (aiohttp,
JSON through orjson: httpx's pool and the standard JSON decoder cost far more CPU a request);
control requests with the control secret, and the failure classes (408/429/5xx, transport:
infrastructure, retried; other 4xx: data, never retried).

Does not own: generation, aborts or weight updates (backend.py), or the processes (servers.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable

import aiohttp
import orjson

from rl_core.generation.base import GenerationError
from rl_core.generation.http.servers import LocalServer
from rl_core.server_contract import CONTROL_SECRET_HEADER

log = logging.getLogger(__name__)

INFRA_STATUS = frozenset({408, 429})  # plus every 5xx
ROUTING = ("least_outstanding", "round_robin")
DEFAULT_OPENAI_CAPACITY = 256  # a plain OpenAI server does not report how many requests it batches


class GenerationRequestError(ValueError):
    """A server refused a request as invalid (HTTP 4xx): a data error, never retried."""


CLIENT_KEEPALIVE_S = 2.0  # below every server's keep-alive timeout (uvicorn's default is 5 s)


def is_infra_status(status: int) -> bool:
    return status >= 500 or status in INFRA_STATUS


TRANSPORT_ERRORS = (aiohttp.ClientError, TimeoutError)  # a request that got no answer: infrastructure


def to_json(body) -> bytes:
    """A request body as JSON (NumPy arrays and scalars as their values)."""
    return orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY)


def from_json(raw: bytes):
    return orjson.loads(raw)


def error_message(body: bytes) -> str:
    """The message of an error answer (the OpenAI error format, else the body's start)."""
    try:
        data = from_json(body)
        return str(data.get("error", {}).get("message") or data)[:500]
    except (ValueError, AttributeError):
        return body[:500].decode("utf-8", "replace")


@dataclass
class Endpoint:
    """What the backend knows about one server."""

    url: str
    local: LocalServer | None = None
    healthy: bool = False
    stale: bool = False  # missed a weight update: not routable until caught up
    version: int | None = None
    capacity: int = 0
    max_model_len: int | None = None  # an rl_core server's context (GET /health)
    outstanding: int = 0
    requests: int = 0
    failures: int = 0
    restarts: int = 0
    last_error: str = ""
    server_metrics: dict[str, float] = field(default_factory=dict)
    checking: bool = False

    @property
    def routable(self) -> bool:
        return self.healthy and not self.stale


@dataclass
class FleetPolicy:
    """Timeouts and retry/health settings (the `generation.http` knobs)."""

    kind: str = "rl_core"  # "rl_core" | "openai"
    routing: str = "least_outstanding"
    request_timeout_s: float = 600.0
    connect_timeout_s: float = 10.0
    startup_timeout_s: float = 300.0
    max_retries: int = 3
    retry_backoff_s: float = 0.5
    retry_max_backoff_s: float = 10.0
    health_check_interval_s: float = 5.0
    max_local_server_restarts: int = 3

    def backoff(self, attempt: int) -> float:
        """Seconds to wait before retry `attempt + 1`."""
        return min(self.retry_max_backoff_s, self.retry_backoff_s * 2 ** attempt)


class ServerFleet:
    """Endpoints, one HTTP client, routing and the health task."""

    def __init__(self, endpoints: list[Endpoint], policy: FleetPolicy, counters: dict[str, int]):
        if policy.routing not in ROUTING:
            raise ValueError(f"routing is {policy.routing!r}; expected one of {ROUTING}")
        self.endpoints = endpoints
        self.policy = policy
        self.counters = counters
        self.client: aiohttp.ClientSession | None = None
        self.catch_up: Callable[[Endpoint], Awaitable[None]] | None = None  # set by the backend
        self.wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._turn = itertools.count()
        self.control_secret: str | None = None  # remote managed servers' secret (local ones have their own)

    # ------------------------------------------------------------------ processes

    def launch_local(self) -> None:
        """Launch the local servers and wait for them (blocking); stops them all on failure."""
        try:
            for ep in self.endpoints:
                if ep.local is not None:
                    ep.local.launch()
            for ep in self.endpoints:
                if ep.local is not None:
                    ep.url = ep.local.wait_ready(self.policy.startup_timeout_s)
        except BaseException:
            self.stop_local()
            raise

    def stop_local(self) -> None:
        for ep in self.endpoints:
            if ep.local is not None:
                ep.local.stop()

    # ------------------------------------------------------------------ client, health task

    def open(self, api_key: str | None, control_secret: str | None = None) -> None:
        self.control_secret = control_secret
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = aiohttp.ClientSession(
            # no cap on connections (aiohttp's default is 100: requests beyond it would queue in the
            # client, not in the servers' batches); idle connections expire on the client (2 s)
            # before servers close them (uvicorn: 5 s by default): otherwise a request sent on a
            # connection the server is closing fails with "Server disconnected" and counts as an
            # infrastructure error
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=CLIENT_KEEPALIVE_S),
            headers=headers, timeout=aiohttp.ClientTimeout(total=self.policy.request_timeout_s,
                                                           sock_connect=self.policy.connect_timeout_s))
        self.wake = asyncio.Event()

    def start_health(self, name: str) -> None:
        self._task = asyncio.create_task(self._health_loop(), name=f"{name}-health")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(BaseException):
                await self._task
            self._task = None
        if self.client is not None:
            await self.client.close()
            self.client = None

    async def check_all(self, catch_up: bool = True) -> None:
        await asyncio.gather(*(self.check(ep, catch_up) for ep in self.endpoints), return_exceptions=True)

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.policy.health_check_interval_s)
            await self.check_all()

    # ------------------------------------------------------------------ routing

    async def pick(self) -> Endpoint:
        """A routable server (waits while there is none, at most startup_timeout_s)."""
        deadline = time.monotonic() + self.policy.startup_timeout_s
        while True:
            ready = [ep for ep in self.endpoints if ep.routable]
            if ready:
                turn = next(self._turn)
                if self.policy.routing == "round_robin":
                    return ready[turn % len(ready)]
                fewest = min(ep.outstanding for ep in ready)
                tied = [ep for ep in ready if ep.outstanding == fewest]
                return tied[turn % len(tied)]
            left = deadline - time.monotonic()
            if left <= 0:
                raise GenerationError("no generation server is healthy: " + "; ".join(
                    f"{ep.url or 'local server'}: {ep.last_error or 'stale'}" for ep in self.endpoints))
            self.wake.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.wake.wait(), timeout=min(left, self.policy.health_check_interval_s))

    def suspect(self, ep: Endpoint, error: str) -> None:
        """A request to `ep` failed at the transport level: stop routing to it, check it now."""
        ep.healthy = False
        ep.failures += 1
        ep.last_error = error
        if not ep.checking and self._task is not None:
            asyncio.ensure_future(self.check(ep))

    # ------------------------------------------------------------------ checks

    async def check(self, ep: Endpoint, catch_up: bool = True) -> None:
        if ep.checking:
            return
        ep.checking = True
        timeout = self.policy.connect_timeout_s
        try:
            if ep.local is not None and not ep.local.alive():
                await self._restart(ep)
            if self.policy.kind == "rl_core":
                info = await self.request("GET", ep, "/health", timeout=timeout)
                ep.version, ep.capacity = int(info["weight_version"]), int(info["max_batch_size"])
                ep.max_model_len = int(info["max_model_len"]) if info.get("max_model_len") else None
                with contextlib.suppress(GenerationError, GenerationRequestError):
                    m = await self.request("GET", ep, "/rl/metrics", timeout=timeout)
                    ep.server_metrics = {k: float(v) for k, v in m.items() if isinstance(v, (int, float))}
            else:
                await self.request("GET", ep, "/v1/models", timeout=timeout)
                ep.capacity = DEFAULT_OPENAI_CAPACITY
            ep.healthy, ep.failures = True, 0
            if catch_up and self.catch_up is not None:
                await self.catch_up(ep)
        except (GenerationError, GenerationRequestError, RuntimeError, TimeoutError, OSError) as exc:
            ep.healthy = False
            ep.failures += 1
            ep.last_error = str(exc)
        finally:
            ep.checking = False
        if ep.routable and self.wake is not None:
            self.wake.set()

    async def _restart(self, ep: Endpoint) -> None:
        if ep.restarts >= self.policy.max_local_server_restarts:
            raise RuntimeError(f"local server {ep.local.index} died and was restarted {ep.restarts} times "
                               f"(generation.http.max_local_server_restarts); see {ep.local.log_path}")
        log.warning("local generation server %d died; restarting it (log: %s)", ep.local.index, ep.local.log_path)
        ep.restarts += 1
        self.counters["server_restarts"] += 1
        ep.healthy, ep.stale = False, True  # it starts from the initial weights: catch up before routing
        ep.local.launch()
        ep.url = await asyncio.to_thread(ep.local.wait_ready, self.policy.startup_timeout_s)

    async def send(self, method: str, url: str, json=None, headers: dict | None = None,
                   timeout: float | None = None) -> tuple[int, bytes]:
        """One HTTP request: its status and body. Raises `TRANSPORT_ERRORS` when no answer came
        (`timeout`: seconds for the whole request, else generation.http.request_timeout_s)."""
        kwargs = {}
        if json is not None:
            kwargs["data"] = to_json(json)
            headers = {**(headers or {}), "Content-Type": "application/json"}
        if timeout is not None:
            kwargs["timeout"] = aiohttp.ClientTimeout(total=timeout)
        async with self.client.request(method, url, headers=headers, **kwargs) as response:
            return response.status, await response.read()

    async def request(self, method: str, ep: Endpoint, path: str, retries: int = 0, timeout: float | None = None,
                      json=None) -> dict:
        """One control request, classified (infra errors retried `retries` times)."""
        for attempt in range(retries + 1):
            # read at every attempt: a relaunched local server has a new secret
            secret = (ep.local.control_secret if ep.local is not None else self.control_secret) \
                if path.startswith("/rl/") else None
            try:
                status, body = await self.send(method, ep.url + path, json=json, timeout=timeout,
                                               headers={CONTROL_SECRET_HEADER: secret} if secret else None)
            except TRANSPORT_ERRORS as exc:
                error = f"{type(exc).__name__}: {exc}"
            else:
                if status == 200:
                    return from_json(body)
                error = f"HTTP {status}: {error_message(body)}"
                if not is_infra_status(status):
                    raise GenerationRequestError(f"{method} {ep.url}{path}: {error}")
            if attempt < retries:
                self.counters["retries"] += 1
                await asyncio.sleep(self.policy.backoff(attempt))
        raise GenerationError(f"{method} {ep.url}{path} failed: {error}")

    # ------------------------------------------------------------------ reporting

    def capacity(self) -> int:
        return sum(ep.capacity for ep in self.endpoints) or DEFAULT_OPENAI_CAPACITY * len(self.endpoints)

    def metrics(self) -> dict[str, float]:
        out = {"servers": float(len(self.endpoints)),
               "healthy_servers": float(sum(ep.routable for ep in self.endpoints)),
               "outstanding": float(sum(ep.outstanding for ep in self.endpoints))}
        for key in ("tokens_generated", "requests_finished", "requests_aborted", "preemptions", "busy_s"):
            values = [ep.server_metrics[key] for ep in self.endpoints if key in ep.server_metrics]
            if values:
                out[f"servers_{key}"] = float(sum(values))
        return out
