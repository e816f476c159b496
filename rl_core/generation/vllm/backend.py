"""VLLMBackend: the `GenerationBackend` protocol over vLLM's async engine (`AsyncLLM`).

Owns: building an `AsyncLLM` for one HF model directory with the settings that matter,
translating rl_core requests into vLLM `SamplingParams` and vLLM outputs back into
`GenerationResult`s (tokens, the logprob of each sampled token, per-token weight versions),
the engine's steps of abort, the weight update and the KV/prefix-cache reset (the sequence,
pause / reload through `ext.py` / reset / label / resume, is `common.VLLMBackendBase`'s,
shared with `server.py`), LoRA adapter refits through vLLM's LoRA support (`lora_rank`:
`common.AdapterSlot`), and a clean shutdown that leaves no vLLM process behind. Driven from
the controller's event loop; only `prepare()` (the construction) may run in a worker thread.

Does not own: which weights to send or when (refit), the recipe (`from_recipe` reads it), or
the OpenAI-server path (`server.py`). Read more: docs/generation.md, "The vLLM backends".
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import operator
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import torch

from rl_core.adapters import is_adapter_state
from rl_core.generation.vllm.common import (EXTENSION_CLS, LORA_ID, LORA_NAME, AdapterSlot, VLLMBackendBase, VLLMError,
                                            max_lora_rank, safetensors_files, scoped_env, state_dict_bytes,
                                            to_vllm_sampling, token_versions_from_spans, vllm_engine_env)
from rl_core.columns import GroupResults, generate_each
from rl_core.types import GenerationRequest, GenerationResult, SamplingParams, group_requests

_OUTPUT_INDEX = operator.attrgetter("index")

log = logging.getLogger(__name__)

# --------------------------------------------------------------------------- the async-engine backend


@dataclass
class VLLMOptions:
    """Engine settings of a vLLM backend (the recipe's `generation.vllm` section maps here)."""

    model: str
    dtype: str = "float32"
    max_model_len: int | None = None  # None: the model's context
    max_num_seqs: int = 64
    kv_cache_memory_bytes: int = 64 * 2**20
    enforce_eager: bool = True
    enable_prefix_caching: bool = True
    seed: int = 0
    lora_rank: int = 0  # > 0: serve LoRA adapters of this rank (`trainer.lora.refit: adapters`); `model` is the base
    lora_start: str | None = None  # the starting adapter (a PEFT directory, e.g. a LoRA checkpoint's); None: zeros
    extra: dict[str, Any] = field(default_factory=dict)  # further AsyncEngineArgs / server flags

    def engine_args(self) -> dict[str, Any]:
        args = {
            "model": self.model, "dtype": self.dtype, "max_num_seqs": self.max_num_seqs,
            "kv_cache_memory_bytes": self.kv_cache_memory_bytes, "enforce_eager": self.enforce_eager,
            "enable_prefix_caching": self.enable_prefix_caching, "seed": self.seed,
            "distributed_executor_backend": "uni", "worker_extension_cls": EXTENSION_CLS,
            "logprobs_mode": "processed_logprobs", "disable_log_stats": True,
        }
        if self.max_model_len is not None:
            args["max_model_len"] = self.max_model_len
        if self.lora_rank:
            args.update(enable_lora=True, max_lora_rank=max_lora_rank(self.lora_rank), max_loras=1)
        args.update(self.extra)
        return args


def _is_cpu_platform() -> bool:
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


class VLLMBackend(VLLMBackendBase):
    """Async generation over vLLM's `AsyncLLM` (one engine, one model directory)."""

    def __init__(self, options: VLLMOptions, *, weight_version: int = 0, name: str = "vllm"):
        super().__init__(options, weight_version, name)
        self._engine = None
        self._adapter_dir: str | None = None  # LoRA (options.lora_rank): the adapter's directory, made here
        self._lora = None  # the LoRARequest every request names

    def _start_adapter(self) -> None:
        from vllm.lora.request import LoRARequest

        self._adapter_dir = tempfile.mkdtemp(prefix="rl_core_vllm_lora_")
        self._slot = AdapterSlot(self._adapter_dir, self.options.model, self.options.lora_rank)
        self._lora = LoRARequest(LORA_NAME, LORA_ID, str(self._slot.write_start(self.options.lora_start)))

    # ------------------------------------------------------------------ start-up

    def prepare(self) -> None:
        """Build the engine (spawns the EngineCore, loads the weights): blocking (seconds on CPU).
        Safe in a worker thread; `start()` calls it if nobody did."""
        if self._engine is not None:
            return
        t0 = time.monotonic()
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        if self.options.lora_rank:
            self._start_adapter()
        self._reaper.before()
        try:
            with scoped_env(vllm_engine_env(_is_cpu_platform())):
                self._engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**self.options.engine_args()))
        finally:
            self._reaper.after()
        self.setup_s = time.monotonic() - t0

    async def start(self) -> None:
        if self._started:
            raise RuntimeError("VLLMBackend.start() was already called")
        if self._engine is None:
            await asyncio.to_thread(self.prepare)
        await self._engine.update_weight_version(str(self._version))
        self._started = True
        self._t_start = time.monotonic()

    def _handle(self):
        """The engine, once started and until shut down."""
        if not self._started:
            raise RuntimeError(f"{type(self).__name__}.start() must be awaited first")
        if self._closed:
            raise RuntimeError(f"the {self.name} backend is shut down")
        return self._engine

    # ------------------------------------------------------------------ protocol

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        rid = request.request_id
        final, start_version, started = await self._run(rid, request.prompt_ids, to_vllm_sampling(request.params))
        if final is None or not final.outputs:
            raise VLLMError(f"vLLM returned no output for request {rid!r}")
        return self._result(request, final.outputs[0], start_version, started)

    async def generate_group(self, key: str, prompt_ids: list[int], params: SamplingParams,
                             seeds: list[int]) -> GroupResults:
        """One prompt group as one `AsyncLLM` request of `n` = len(seeds) samples with seed
        seeds[0]: vLLM seeds sample i with seed + i and the rollout derives a group's seeds
        consecutively (`rollout.group.seed_last`), so sample i is what `generate` of
        `f"{key}/{i}"` with seeds[i] gives (`protocols.GroupGenerationBackend`), for one
        request instead of n. Seeds that are not consecutive below 2^63, or more samples than
        `max_num_seqs`, go as a request a sample. Cancelling the call aborts every sample; one
        sample alone cannot be aborted (`abort(f"{key}/{i}")` leaves it running)."""
        sampling = self._one_request(params, seeds)
        if sampling is None:
            return await generate_each(self.generate, key, prompt_ids, params, seeds)
        final, start_version, started = await self._run(key, prompt_ids, sampling)
        n = len(seeds)
        outputs = sorted(final.outputs, key=_OUTPUT_INDEX) if final is not None else []
        if [o.index for o in outputs] != list(range(n)):
            raise VLLMError(f"vLLM returned outputs {[o.index for o in outputs]} for a group of {n} ({key!r})")
        requests = group_requests(key, prompt_ids, params, seeds)
        return GroupResults.of([self._result(r, o, start_version, started) for r, o in zip(requests, outputs)])

    async def _run(self, rid: str, prompt_ids, sampling: dict):
        """One `AsyncLLM` request to its end (flat logprobs, the final output only): its last
        `RequestOutput` (None if none came), the weight version at its start and when it started."""
        from vllm import SamplingParams as VSamplingParams
        from vllm import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        engine = self._handle()
        sp = VSamplingParams(**sampling, output_kind=RequestOutputKind.FINAL_ONLY, flat_logprobs=True)
        final = None
        with self._in_flight(rid) as (start_version, started):
            try:
                async for out in engine.generate(TokensPrompt(prompt_token_ids=list(prompt_ids)), sp, rid,
                                                 lora_request=self._lora):
                    final = out
            except Exception as exc:
                raise VLLMError(f"vLLM failed on request {rid!r}: {exc!r}") from exc
        return final, start_version, started

    def _result(self, request: GenerationRequest, out, start_version: int, started: float) -> GenerationResult:
        tokens = [int(t) for t in out.token_ids]
        flat = out.logprobs
        if not getattr(request.params, "top_logprobs", 0) and hasattr(flat, "start_indices") and \
                flat.token_ids == tokens and len(flat.logprobs) == len(tokens):
            # `flat_logprobs` (vLLM's FlatLogprobs): the sampled tokens' logprobs as one list,
            # one entry a position; reading them through its per-position dicts costs more
            logprobs = list(flat.logprobs)
        else:
            logprobs = [float(pos[t].logprob) for t, pos in zip(tokens, flat or [])]
        if len(logprobs) != len(tokens):
            raise VLLMError(f"vLLM returned {len(logprobs)} logprobs for {len(tokens)} tokens "
                            f"(request {request.request_id!r})")
        reason = self._finished(request.request_id, out.finish_reason, len(tokens))
        k = int(getattr(request.params, "top_logprobs", 0) or 0)
        extra = {}
        if k:  # the k most likely tokens at each position, by vLLM's rank
            extra["top_logprobs"] = [[(int(t), float(lp.logprob)) for t, lp in sorted(pos.items(), key=lambda x: x[1].rank)
                                      if lp.rank is not None and lp.rank <= k] for pos in out.logprobs or []]
        return GenerationResult(
            request_id=request.request_id, prompt_ids=list(request.prompt_ids), token_ids=tokens, logprobs=logprobs,
            finish_reason=reason, start_version=start_version, end_version=self._version,
            token_versions=token_versions_from_spans(getattr(out, "weight_versions", None), len(tokens), start_version),
            started_at=started, finished_at=time.monotonic(), worker="vllm", **extra)

    async def update_weights(self, version: int, weights: Mapping[str, torch.Tensor] | str | Path) -> None:
        """Load new weights (a state dict with HF names, or a directory of safetensors files)
        and label the tokens generated from now on with `version`. LoRA adapters (rl_core.adapters'
        refit format; `lora_rank` set) replace the served adapter."""
        engine = self._handle()
        adapters = not isinstance(weights, (str, Path)) and is_adapter_state(weights)
        if adapters:
            self._check_adapters()
            method, args = "rl_core_reload_adapter", (str(self._slot.path), LORA_ID, LORA_NAME)
        elif isinstance(weights, (str, Path)):
            method, args = "rl_core_reload_files", (safetensors_files(weights),)
        else:
            method, args = "rl_core_reload_bytes", (await asyncio.to_thread(state_dict_bytes, weights),)

        async def reload() -> None:
            try:
                if adapters:  # rewritten under the update lock: one update at a time reads the directory
                    await asyncio.to_thread(self._slot.write, weights)
                await engine.collective_rpc(method, args=args)
            except Exception as exc:
                raise VLLMError(f"the {self.name} engine failed to load weights of version {version}: "
                                f"{exc!r}") from exc

        await self._swap_weights(engine, version, reload)

    async def _pause(self, engine) -> None:
        await engine.pause_generation(mode="keep", clear_cache=False)

    async def _reset_cache(self, engine) -> None:
        if not await engine.reset_prefix_cache(reset_running_requests=True):
            raise VLLMError(f"the {self.name} engine refused to reset its prefix cache")

    async def _label(self, engine, version: int) -> None:
        await engine.update_weight_version(str(version))

    async def _resume(self, engine) -> None:
        await engine.resume_generation()

    async def _send_abort(self, engine, request_id: str) -> None:
        await engine.abort(request_id)

    def _detach(self):
        """Mark the backend closed and take its engine (None if it has none)."""
        self._closed = True
        engine, self._engine = self._engine, None
        return engine

    async def shutdown(self) -> None:
        """Abort what is in flight (those callers get "abort"), stop the engine, and end any
        process it left behind. Idempotent."""
        if self._closed:
            return
        engine = self._detach()
        try:
            if engine is not None:
                if self._inflight:
                    with contextlib.suppress(Exception):
                        await engine.abort(list(self._inflight))
                    for _ in range(100):  # let the aborted generate() calls return their results
                        if not self._inflight:
                            break
                        await asyncio.sleep(0.01)
                # Stop AsyncLLM's output task on this loop first: `shutdown()` ends the EngineCore
                # before it cancels that task, which would otherwise report the engine dead.
                handler = getattr(engine, "output_handler", None)
                if isinstance(handler, asyncio.Task) and not handler.done():
                    handler.cancel()
                    with contextlib.suppress(asyncio.CancelledError, Exception):
                        await handler
                await asyncio.to_thread(engine.shutdown)
        finally:
            self._drop_adapter()
            ended = await asyncio.to_thread(self._reaper.reap)
            if ended:
                log.warning("the %s backend ended leftover vLLM processes %s", self.name, ended)

    def _drop_adapter(self) -> None:
        if self._adapter_dir is not None:
            shutil.rmtree(self._adapter_dir, ignore_errors=True)
            self._adapter_dir = None

    def close_sync(self) -> None:
        """Shut down from synchronous code (a prepared engine that never started)."""
        if self._closed:
            return
        engine = self._detach()
        try:
            if engine is not None:
                engine.shutdown()
        finally:
            self._drop_adapter()
            self._reaper.reap()
