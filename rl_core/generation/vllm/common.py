"""Pieces shared by rl_core's two vLLM backends (`backend.py`, `server.py`).

Owns: the translation of an rl_core request into vLLM sampling arguments and the refusal of
settings whose vLLM logprobs would mean something else (`to_vllm_sampling`,
`check_request`), per-token weight versions from vLLM's `weight_versions` spans, the
environment a vLLM engine process needs on CPU (`vllm_engine_env`, scoped with
`scoped_env`), state dicts as safetensors bytes, `ChildReaper`, which ends by PID the
processes a vLLM start left alive, LoRA adapter refits (`AdapterSlot`: one adapter a backend
serves under a fixed name, id and directory) and `VLLMBackendBase`: the requests in flight,
counters, abort and the weight-update sequence of both backends. Imports no vLLM.

Does not own: driving an engine or a server (the two backends' hooks).
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import os
import time
from pathlib import Path
from typing import Any, Awaitable, Callable, Iterator, Mapping

import torch

from rl_core.types import MAX_SEED, SamplingParams, with_seed

EXTENSION_CLS = "rl_core.generation.vllm.ext.WeightReloadExtension"
MIN_TEMPERATURE = 0.01  # vLLM clamps 0 < T < 0.01 up to 0.01 (its logprobs would use 0.01)
FINISH_REASONS = {"stop": "stop", "length": "length", "abort": "abort"}
LORA_NAME, LORA_ID = "rl_core", 1  # the one LoRA adapter a backend serves (`trainer.lora.refit: adapters`)
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's allowed `max_lora_rank` values


class VLLMError(RuntimeError):
    """vLLM failed (engine died, server unreachable, a reload failed); the cause is chained."""


# --------------------------------------------------------------------------- shared helpers


def backend_metrics(stats: Mapping[str, float], t_start: float | None, running: int, version: int,
                    setup_s: float) -> dict[str, float]:
    """`metrics()` of both vLLM backends: their counters plus running, version, uptime, tokens/s."""
    uptime = time.monotonic() - t_start if t_start else 0.0
    out = {k: float(v) for k, v in stats.items()}
    out.update(running=float(running), weight_version=float(version), setup_s=setup_s, uptime_s=uptime,
               tokens_per_s=stats["tokens_generated"] / uptime if uptime > 0 else 0.0)
    return out


def vllm_engine_env(is_cpu: bool) -> dict[str, str]:
    """Environment for a vLLM engine process (vllm-cpu.md §2). On CPU: one in-process
    executor ("uni") instead of a third process, one OpenMP thread for the EngineCore
    (two threads beside the front-end on two cores are far slower), no torch.compile of the
    logprob-rank kernel (a compilation per new shape, needs g++). On GPU nothing is changed."""
    if not is_cpu:
        return {}
    return {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": "1", "TORCHDYNAMO_DISABLE": "1"}


@contextlib.contextmanager
def scoped_env(values: Mapping[str, str]) -> Iterator[None]:
    """Set environment variables for the duration of the block (spawned children inherit them)."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def check_request(params: SamplingParams) -> None:
    """Refuse sampling settings whose vLLM logprobs would not mean what rl_core's mean."""
    if params.is_greedy:
        return
    if params.top_k > 0 or params.top_p < 1.0:
        raise ValueError(
            f"top_k={params.top_k}, top_p={params.top_p}: vLLM reports logprobs of the top-k/top-p *filtered* "
            "distribution, rl_core's definition is before filtering (generation/native/sampling.py). Use top_k=0 and "
            "top_p=1 with the vLLM backends, or the native backend.")
    if params.temperature < MIN_TEMPERATURE:
        raise ValueError(f"temperature={params.temperature}: vLLM raises temperatures below {MIN_TEMPERATURE} to "
                         f"{MIN_TEMPERATURE}. Use temperature 0 (greedy) or >= {MIN_TEMPERATURE}.")


def to_vllm_sampling(params: SamplingParams, *, n: int = 1) -> dict[str, Any]:
    """Keyword arguments of `vllm.SamplingParams` for one rl_core request (sampled-token
    logprobs only; detokenization only when stop strings need it)."""
    check_request(params)
    greedy = params.is_greedy
    kw: dict[str, Any] = {
        "n": n,
        "temperature": 0.0 if greedy else float(params.temperature),
        "top_p": 1.0,
        "top_k": 0,
        "max_tokens": int(params.max_tokens),
        "logprobs": int(getattr(params, "top_logprobs", 0) or 0),  # 0: the sampled token's only
        "seed": None if params.seed is None else int(params.seed),
        "detokenize": bool(params.stop_strings),
    }
    if params.stop_strings:
        kw["stop"] = list(params.stop_strings)
    if params.stop_token_ids:
        kw["stop_token_ids"] = [int(t) for t in params.stop_token_ids]
    return kw


def consecutive_seeds(seeds) -> bool:
    """Whether `seeds` are s, s + 1, ... without passing 2^63 - 1: then one vLLM request of
    `n` = len(seeds) with seed s samples them (vLLM seeds a request's sample i with seed + i)."""
    if not seeds or seeds[0] is None:
        return False
    first = int(seeds[0])
    return first + len(seeds) - 1 <= MAX_SEED and all(int(s) == first + i for i, s in enumerate(seeds))


def token_versions_from_spans(spans: Any, num_tokens: int, fallback: int) -> list[int]:
    """Per-token weight versions from vLLM `weight_versions` spans [(version, start, end)]
    over output-token indexes (objects or dicts); tokens outside every span get `fallback`."""
    versions = [fallback] * num_tokens
    for span in spans or ():
        get = span.get if isinstance(span, Mapping) else lambda k, s=span: getattr(s, k)
        label, start, end = get("version"), int(get("start")), int(get("end"))
        try:
            value = int(label)
        except (TypeError, ValueError):
            continue  # a label rl_core did not set (e.g. vLLM's initial None)
        for i in range(max(0, start), min(end, num_tokens)):
            versions[i] = value
    return versions


def state_dict_bytes(weights: Mapping[str, torch.Tensor]) -> bytes:
    """`safetensors` bytes of a state dict on CPU; a tensor that shares storage with an
    earlier one (a tied LM head) is left out: vLLM ties it again on load."""
    from safetensors.torch import save

    seen: set[tuple[int, int]] = set()
    out: dict[str, torch.Tensor] = {}
    for name, t in weights.items():
        key = (t.untyped_storage().data_ptr(), t.storage_offset()) if t.numel() else (id(t), 0)
        if key in seen:
            continue
        seen.add(key)
        out[name] = t.detach().to("cpu").contiguous()
    return save(out)


def safetensors_files(directory: str | Path) -> list[str]:
    files = sorted(str(p) for p in Path(directory).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors file in {directory}: a weights directory holds the new "
                                "version's safetensors shards.")
    return files


def max_lora_rank(rank: int) -> int:
    """vLLM's `max_lora_rank` for adapters of `rank`: the smallest value vLLM allows that holds it."""
    for r in VLLM_LORA_RANKS:
        if r >= rank:
            return r
    raise ValueError(f"trainer.lora.rank {rank}: vLLM serves LoRA adapters of rank <= {VLLM_LORA_RANKS[-1]}")


class AdapterSlot:
    """The LoRA adapter a vLLM backend serves with `trainer.lora.refit: adapters`: one PEFT
    directory at a fixed path (`path`), served under `LORA_NAME` / `LORA_ID`; every request
    names it, and an adapter update rewrites the directory (atomically) and has the worker
    reload it under the same id (`ext.rl_core_reload_adapter`), so requests in flight go on with
    the new adapter, as they go on with new full weights. Before the first update the directory
    holds the starting adapter: a saved one (a LoRA checkpoint's) or zeros (the base policy)."""

    def __init__(self, directory: str | Path, base_dir: str | Path, rank: int):
        self.path = Path(directory) / "rl_core_adapter"
        self.base_dir, self.rank = str(base_dir), rank

    def write(self, state: Mapping[str, torch.Tensor]) -> Path:
        from rl_core.adapters import write_peft_dir

        return write_peft_dir(self.path, state, self.base_dir)

    def write_start(self, saved_adapter: str | Path | None = None) -> Path:
        """The starting adapter: `saved_adapter`'s (a PEFT directory) or a zero one of `rank` on
        one linear layer of the base (B = 0 adds nothing: the base policy)."""
        from rl_core.adapters import read_adapter_dir

        if saved_adapter is not None:
            return self.write(read_adapter_dir(saved_adapter))
        name, (out_f, in_f) = _first_linear(self.base_dir)
        module = name[:-len(".weight")]
        return self.write({module + ".lora_A": torch.zeros(self.rank, in_f), module + ".lora_B": torch.zeros(out_f, self.rank)})


def _first_linear(model_dir: str) -> tuple[str, tuple[int, int]]:
    """(name, shape) of a decoder projection weight in an HF directory's safetensors files."""
    from safetensors import safe_open

    for f in safetensors_files(model_dir):
        with safe_open(f, "pt") as st:
            for name in sorted(st.keys()):
                if name.endswith(("_proj.weight", ".dense.weight")) and ".layers." in name:
                    shape = st.get_slice(name).get_shape()
                    if len(shape) == 2:
                        return name, (int(shape[0]), int(shape[1]))
    raise ValueError(f"{model_dir} has no decoder projection weight (`*.layers.*_proj.weight`) for a LoRA adapter")


class ChildReaper:
    """Remembers the processes a vLLM start created (children of this process) and ends the
    ones still alive at shutdown, by PID (vllm-cpu.md §9: an orphaned EngineCore spins)."""

    def __init__(self):
        self._before: set[int] = set()
        self.pids: set[int] = set()

    def before(self) -> None:
        import psutil

        self._before = {p.pid for p in psutil.Process().children(recursive=True)}

    def after(self) -> None:
        import psutil

        now = {p.pid for p in psutil.Process().children(recursive=True)}
        self.pids |= now - self._before

    def reap(self, timeout_s: float = 10.0) -> list[int]:
        """Terminate (then kill) the remembered processes still alive; returns those ended."""
        import psutil

        alive = []
        for pid in sorted(self.pids):
            with contextlib.suppress(psutil.NoSuchProcess):
                proc = psutil.Process(pid)
                if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                    alive.append(proc)
        for proc in alive:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.terminate()
        _, still = psutil.wait_procs(alive, timeout=timeout_s)
        for proc in still:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.kill()
        psutil.wait_procs(still, timeout=timeout_s)
        return [p.pid for p in alive]


class VLLMBackendBase(abc.ABC):
    """What the two vLLM backends share: the weight version, the requests in flight and the
    counters of `metrics()`, abort, and the sequence of a weight update and of a KV-cache
    invalidation (pause keeping the requests, reload, reset the prefix cache, label the version,
    resume; vllm-cpu.md §6). A backend drives its vLLM through the hooks (`_handle`, `_pause`,
    `_reset_cache`, `_label`, `_resume`, `_send_abort`); `_who` names it in errors."""

    _who = "vLLM"
    _abort_poll_s = 0.01  # how long an abort waits for the request to end before it is sent again

    def __init__(self, options: Any, weight_version: int, name: str):
        self.options = options
        self.name = name
        self._version = weight_version
        self._started = self._closed = False
        self._inflight: dict[str, asyncio.Event] = {}  # request id -> set when its generate() ends
        self._update_lock = asyncio.Lock()
        self._reaper = ChildReaper()
        self.setup_s = 0.0
        self._t_start = 0.0
        self._stats = {"requests_added": 0, "requests_finished": 0, "requests_aborted": 0, "tokens_generated": 0,
                       "weight_updates": 0, "kv_invalidations": 0, "update_s": 0.0}

    @property
    def weight_version(self) -> int:
        return self._version

    def capacity(self) -> int:
        return self.options.max_num_seqs

    def _check_adapters(self) -> None:
        """An adapter update needs a backend built to serve LoRA (`options.lora_rank`)."""
        if not self.options.lora_rank:
            raise VLLMError(f"{self._who} got a LoRA adapter update but serves no LoRA adapter (VLLMOptions.lora_rank "
                            "is 0). Fix: build the backend from a recipe with trainer.lora.refit: adapters, or send "
                            "merged weights (trainer.lora.refit: merged).")

    def metrics(self) -> dict[str, float]:
        return backend_metrics(self._stats, self._t_start, len(self._inflight), self._version, self.setup_s)

    def _one_request(self, params: SamplingParams, seeds: list[int]) -> dict[str, Any] | None:
        """vLLM's sampling arguments of a group sent as one request of n = len(seeds) samples with
        seed seeds[0] (vLLM seeds sample i with seed + i); None where the group goes as a request a
        sample: seeds that are not consecutive below 2^63, or more samples than `max_num_seqs`."""
        if not consecutive_seeds(seeds) or len(seeds) > self.options.max_num_seqs:
            return None
        return to_vllm_sampling(with_seed(params, int(seeds[0])), n=len(seeds))

    @contextlib.contextmanager
    def _in_flight(self, rid: str) -> Iterator[tuple[int, float]]:
        """Request `rid` in flight for the block (counted, abortable): yields the weight version at
        its start and when it started."""
        if rid in self._inflight:
            raise ValueError(f"request id {rid!r} is already in flight; request ids must be unique.")
        start = self._version, time.monotonic()
        self._inflight[rid] = done = asyncio.Event()
        self._stats["requests_added"] += 1
        try:
            yield start
        finally:
            del self._inflight[rid]
            done.set()

    def _finished(self, rid: str, finish_reason: Any, num_tokens: int) -> str:
        """rl_core's finish reason of a request vLLM ended with `finish_reason`, counted in `metrics()`."""
        reason = FINISH_REASONS.get(str(finish_reason))
        if reason is None:
            raise VLLMError(f"{self._who} ended request {rid!r} with finish_reason {finish_reason!r}")
        self._stats["requests_aborted" if reason == "abort" else "requests_finished"] += 1
        self._stats["tokens_generated"] += num_tokens
        return reason

    async def abort(self, request_id: str) -> None:
        """Stop one request; returns once it has ended (its `generate()` returns finish_reason
        "abort" with the tokens so far). Unknown ids are ignored. An abort that reaches vLLM
        before the request does (its input is still being processed) is repeated until it
        takes."""
        handle = self._handle()
        done = self._inflight.get(request_id)
        deadline = time.monotonic() + 30.0
        while done is not None and not done.is_set():
            await self._send_abort(handle, request_id)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(done.wait(), self._abort_poll_s)
            if time.monotonic() > deadline:
                raise VLLMError(f"request {request_id!r} did not end within 30 s of its abort")

    async def _swap_weights(self, handle: Any, version: int, reload: Callable[[], Awaitable[None]]) -> None:
        """The weight update around `reload()` (see the class doc); tokens from now on carry `version`."""
        async with self._update_lock:
            t0 = time.monotonic()
            await self._pause(handle)
            try:
                await reload()
                if self.options.enable_prefix_caching:
                    await self._reset_cache(handle)
                await self._label(handle, version)
                self._version = version
            finally:
                await self._resume(handle)
            self._stats["weight_updates"] += 1
            self._stats["update_s"] += time.monotonic() - t0

    async def invalidate_kv_cache(self) -> None:
        """Drop cached keys/values: the prefix cache is reset and running requests are
        re-prefilled under the current weights."""
        handle = self._handle()
        async with self._update_lock:
            await self._pause(handle)
            try:
                await self._reset_cache(handle)
            finally:
                await self._resume(handle)
            self._stats["kv_invalidations"] += 1

    # ------------------------------------------------------------------ hooks

    @abc.abstractmethod
    def _handle(self) -> Any:
        """What the hooks below drive (the engine); raises when the backend is not running."""

    @abc.abstractmethod
    async def _pause(self, handle: Any) -> None:
        """Stop scheduling new work on the engine."""

    @abc.abstractmethod
    async def _reset_cache(self, handle: Any) -> None:
        """Drop the engine's prefix cache."""

    @abc.abstractmethod
    async def _label(self, handle: Any, version: int) -> None:
        """Tell the engine the weight version it now serves."""

    @abc.abstractmethod
    async def _resume(self, handle: Any) -> None:
        """Let the engine schedule again."""

    @abc.abstractmethod
    async def _send_abort(self, handle: Any, request_id: str) -> None:
        """Abort one request on the engine."""
