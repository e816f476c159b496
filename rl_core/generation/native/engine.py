"""NativeEngine: synchronous, step-based continuous batching over the slot KV cache.

Owns: the life of a request inside the engine (waiting queue -> slot -> finished), the
schedule of one step (decodes, then prefill chunks, then admissions, within
`max_step_tokens` fed and `max_num_kv_tokens` held; the newest sequences are preempted
over the KV budget), stop conditions, weight refits (full weights, or LoRA adapters merged
into them: lora.py) and KV invalidation, the per-token
weight versions and MoE routes of each request, and per-step statistics. One `step()` is
one forward over every running sequence. Built from one `EngineOptions` record, whose
values it checks against the model and device. Not thread-safe: one thread drives it.

Does not own: the model maths (model.py), the cache layout (kv_cache.py), sampling
(sampling.py), graph capture (decode_graph.py), the scale rule (kv_calibration.py), the
records (engine_state.py), the settings (options.py). Read more: docs/generation.md.
"""

from __future__ import annotations

import time
from collections import deque
from pathlib import Path
from typing import Any, Mapping

import torch

from rl_core.adapters import is_adapter_dir, is_adapter_state, read_adapter_dir, resolve_base
from rl_core.errors import EngineOptionsError
from rl_core.generation.native.decode_attention import check_supported
from rl_core.generation.native.decode_graph import DecodeRunner
from rl_core.generation.native.engine_state import EngineStats, StepRecord, LaunchedStep, EngineSequence
from rl_core.generation.native.kv_cache import KV_STORAGE, KVCache, StepLayout
from rl_core.generation.native.kv_calibration import KVScaleSync
from rl_core.generation.native.lora import AdapterMerge
from rl_core.generation.native.model import CausalLM, ModelSpec, SafetensorsDir, read_config
from rl_core.generation.native.options import EngineOptions
from rl_core.generation.native.sampling import SamplingBatch, draw_uniforms, new_generator, sample_tokens
from rl_core.types import GenerationRequest, GenerationResult

DEFAULT_MAX_SEQ_LEN_CAP = 4096  # max_seq_len=None: the model's context, at most this (bounds the cache)


class NativeEngine:
    """Continuous-batching generation for Llama/Qwen2 models in plain torch.

    `config`: a transformers config or a `config.json` dict; `state_dict`: HF-named tensors;
    `options`: every setting (`EngineOptions`, validated when built; default: all defaults).
    The cache takes `2 * layers * max_batch_size * kv_heads * max_seq_len * head_dim`
    elements. `max_step_tokens` bounds the tokens fed in one forward (longer prefills are
    chunked); `max_num_kv_tokens` bounds the tokens held in the cache by running sequences.
    `kv_cache_dtype` "fp8_e4m3" stores keys and values in FP8 (`kv_scale_margin`: headroom of
    the scales over the calibration maximum). `decode_path`: "auto" | "eager" | "static" |
    "graph" (see the module docstring); `decode_compile`: run the static/graph decode step's
    layers through `torch.compile` (decode_graph.py); `overlap_steps`: launch the next decode
    step before reading this one's tokens (see `step`); `decode_attention` "fused": RoPE, cache
    write and attention of that step in one Triton kernel (decode_attention.py); `decode_mlp`
    "fused" (with it): the gate/up projection and SiLU gate in one Triton kernel (fused_mlp.py). Checked here,
    against the model and device: `max_seq_len` within the model's context, static/graph decode only for dense
    models, CUDA graphs only on CUDA, and `decode_compile`/`overlap_steps` only where
    `decode_path` does not resolve to "eager" (`EngineOptionsError` naming the option).
    """

    def __init__(self, config: Any, state_dict: Mapping[str, torch.Tensor], options: EngineOptions | None = None):
        options = EngineOptions() if options is None else options
        self.options = options
        self.spec = ModelSpec.from_config(config)
        max_batch_size, decode_path = options.max_batch_size, options.decode_path
        context = self.spec.max_position_embeddings
        max_seq_len = options.max_seq_len or min(context, DEFAULT_MAX_SEQ_LEN_CAP)
        if not 2 <= max_seq_len <= context:
            raise EngineOptionsError("max_seq_len", max_seq_len,
                                     f"an integer in [2, {context}] (config.max_position_embeddings)",
                                     "lower max_seq_len.")
        max_step_tokens = options.max_step_tokens or max(8192, max_batch_size)
        if self.spec.is_moe and decode_path in ("static", "graph"):
            raise EngineOptionsError("decode_path", decode_path,
                                     f"'auto' or 'eager' for this {self.spec.model_type} model: the static and graph "
                                     "paths run dense models only, and it is a mixture of experts",
                                     "use decode_path 'auto' or 'eager'.")
        self.device = torch.device(options.device)
        if decode_path == "graph" and self.device.type != "cuda":
            raise EngineOptionsError("decode_path", decode_path,
                                     f"a CUDA device for 'graph' (CUDA graphs); got device {self.device}",
                                     "use decode_path 'auto', 'eager' or 'static'.")
        dtype = options.dtype
        self.dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
        self.max_batch_size, self.max_seq_len, self.max_step_tokens = max_batch_size, max_seq_len, max_step_tokens
        self.max_num_kv_tokens = options.max_num_kv_tokens or max_batch_size * max_seq_len
        eos_token_ids = options.eos_token_ids
        self.eos_token_ids = frozenset(self.spec.eos_token_ids if eos_token_ids is None else eos_token_ids)
        self.decode = options.decode
        self.model = CausalLM.build(self.spec, state_dict, self.device, self.dtype, max_positions=max_seq_len)
        self.adapters = AdapterMerge(self.model)  # LoRA adapter updates, merged into the weights
        storage = KV_STORAGE[1] if options.kv_cache_dtype == "fp8_e4m3" else KV_STORAGE[0]
        self.cache = KVCache(self.spec.num_layers, max_batch_size, max_seq_len, self.spec.num_kv_heads,
                             self.spec.head_dim, dtype=self.dtype, device=self.device, storage=storage)
        self.stats = EngineStats()
        self.kv_sync = (KVScaleSync(self.model, margin=options.kv_scale_margin, seed=options.seed)
                        if self.cache.fp8 else None)
        if self.kv_sync is not None:
            self._set_kv_scales(*self.kv_sync.calibrate())
        if decode_path == "auto":
            decode_path = "graph" if self.device.type == "cuda" and not self.spec.is_moe else "eager"
        for flag in ("decode_compile", "overlap_steps"):  # both need the static-shape decode step
            if getattr(options, flag) and decode_path == "eager":
                raise EngineOptionsError(flag, True, "false where decode_path resolves to 'eager' "
                                         f"({self.device.type} device, model_type {self.spec.model_type!r})",
                                         f"use decode_path 'static' or 'graph' (dense models), or turn {flag} off.")
        self.overlap_steps = options.overlap_steps
        self._ahead: LaunchedStep | None = None  # a step launched before the previous one's tokens were read
        self._drained: list[GenerationResult] = []  # finished by a drained step, returned by the next step()
        self._last_done = 0.0
        self.decode_path = decode_path
        if options.decode_attention == "fused":
            why = check_supported(self.device, self.dtype, self.spec.head_dim, self.cache.fp8)
            if decode_path == "eager" or why is not None:
                raise EngineOptionsError(
                    "decode_attention", "fused", "'torch' here: the fused decode-attention kernel cannot run, "
                    + (why or f"decode_path resolves to 'eager' ({self.device.type} device)"),
                    "use decode_attention 'torch'.")
        self.decoder = None if decode_path == "eager" else DecodeRunner(
            self.model, self.cache, use_graphs=decode_path == "graph", compile=options.decode_compile,
            fused_attention=options.decode_attention == "fused", fused_mlp=options.decode_mlp == "fused")
        self.generator = new_generator(options.seed)
        self.version = options.weight_version
        self._waiting: deque[EngineSequence] = deque()
        self._running: dict[str, EngineSequence] = {}  # admission order
        self._ids: set[str] = set()

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, options: EngineOptions | None = None) -> "NativeEngine":
        """From an HF directory (config.json, *.safetensors; eos ids of config.json and
        generation_config.json are merged), or a LoRA adapter directory (PEFT's, as rl_core's
        checkpoints hold it): its base model with the adapters merged in."""
        if not is_adapter_dir(model_dir):
            return cls(read_config(model_dir), SafetensorsDir(model_dir), options)
        base = resolve_base(model_dir)
        engine = cls(read_config(base), SafetensorsDir(base), options)
        engine.adapters.apply(read_adapter_dir(model_dir))
        return engine

    # ------------------------------------------------------------------ queries

    @property
    def weight_version(self) -> int:
        return self.version

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def has_work(self) -> bool:
        return bool(self._running or self._waiting or self._drained)

    @property
    def kv_tokens(self) -> int:
        """Tokens in the KV cache now (filled positions of running sequences): never above
        `max_num_kv_tokens`, because each step first preempts until every running
        sequence's cache length + pending tokens fits."""
        return sum(self.cache.lengths)  # a slot that no running sequence holds has length 0 (KVCache.free)

    def progress(self, request_id: str) -> tuple[list[int], list[float], list | None] | None:
        """(token ids, logprobs, top logprobs or None) generated so far by a waiting or
        running request (live lists: copy what you keep); None if it is not in the engine."""
        seq = self._running.get(request_id)
        if seq is None:
            seq = next((s for s in self._waiting if s.request.request_id == request_id), None)
        return None if seq is None else (seq.tokens, seq.logprobs, seq.top)

    # ------------------------------------------------------------------ requests

    def add_request(self, request: GenerationRequest) -> None:
        """Queue a request; it starts at the first step with a free slot. Raises ValueError
        for a request the engine cannot honour (it is then not queued)."""
        self._validate(request)
        params = request.params
        stop_ids = self.eos_token_ids.union(params.stop_token_ids)
        self._waiting.append(EngineSequence(request, stop_ids, self.version, record_routes=self.spec.is_moe,
                                            max_seq_len=self.max_seq_len))
        self._ids.add(request.request_id)
        self.stats.requests_added += 1

    def abort(self, request_id: str) -> GenerationResult | None:
        """End a waiting or running request now, freeing its slot. Returns its result
        (finish_reason "abort", tokens so far), or None if the id is not in the engine.
        The result is not returned again by `step()`."""
        self._drain()
        seq = self._running.get(request_id)
        if seq is None:
            seq = next((s for s in self._waiting if s.request.request_id == request_id), None)
            if seq is None:
                return None
            self._waiting.remove(seq)
        return self._finish(seq, "abort")

    def abort_all(self) -> list[GenerationResult]:
        """Abort every waiting and running request (results in admission order)."""
        self._drain()
        ids = [s.request.request_id for s in list(self._running.values()) + list(self._waiting)]
        return [r for r in map(self.abort, ids) if r is not None]

    # ------------------------------------------------------------------ weights

    def update_weights(self, version: int, state_dict: Mapping[str, torch.Tensor], strict: bool = True,
                       kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """Copy HF-named tensors into the live parameters, or merge LoRA adapters (names
        `<module>.lora_A` / `.lora_B`, rl_core.adapters) into them (lora.py); tokens sampled from
        now on record `version`. All names/shapes are checked first: on error nothing changes.

        With an FP8 KV cache, the KV scales are then synced: `kv_scales` = (k_scale,
        v_scale) [layers, kv_heads] if given, else a calibration pass over recently
        finished sequences under the new weights (kv_calibration.py)."""
        if kv_scales is not None and self.kv_sync is None:
            raise ValueError("kv_scales were given but the KV cache is not FP8 (kv_cache_dtype='auto').")
        self._drain()  # a step launched ahead ran with the old weights: its tokens keep the old version
        if is_adapter_state(state_dict.keys()):
            self.adapters.apply(state_dict)
        else:
            self.model.load_weights(state_dict, strict=strict)
            self.adapters.forget(state_dict.keys())
        self.version = version
        self.stats.weight_updates += 1
        if self.kv_sync is not None:
            self._set_kv_scales(*(kv_scales if kv_scales is not None else self.kv_sync.calibrate()))

    def calibrate_kv_scales(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Recompute and apply FP8 KV scales from the current weights; returns them."""
        if self.kv_sync is None:
            raise ValueError("calibrate_kv_scales needs kv_cache_dtype='fp8_e4m3'.")
        self._drain()
        scales = self.kv_sync.calibrate()
        self._set_kv_scales(*scales)
        return scales

    def _set_kv_scales(self, k_scale: torch.Tensor, v_scale: torch.Tensor) -> None:
        self.cache.set_scales(k_scale, v_scale, requantize=True)
        self.stats.kv_calibrations += 1

    def invalidate_kv_cache(self) -> None:
        """Drop every in-flight sequence's cache: its next step re-feeds prompt + tokens so
        far under the current weights (then samples as usual)."""
        self._drain()
        for seq in self._running.values():
            self.cache.lengths[seq.slot] = 0
            seq.pending = list(seq.request.prompt_ids) + seq.tokens
        self.stats.kv_invalidations += 1

    # ------------------------------------------------------------------ stepping

    def step(self) -> list[GenerationResult]:
        """Run one forward over the scheduled rows; returns the requests that finished.

        With `overlap_steps`, a plain decode step also launches the next one (fed with this
        step's tokens on the device) before its own tokens are read back, so that the host
        work of a step runs while the device computes the next (see `_launch_ahead`)."""
        done, self._drained = self._drained, []
        if self._ahead is not None:
            cur, self._ahead = self._ahead, None
        else:
            if not self.has_work():
                return done
            rows = self._schedule()
            if not rows:  # everything waits on the KV budget; cannot happen (one sequence always fits)
                return done
            cur = self._launch(rows)
        if self.overlap_steps:
            self._ahead = self._launch_ahead(cur)
        return done + self._complete(cur)

    def _launch(self, rows: list[tuple[EngineSequence, int]]) -> LaunchedStep:
        """Feed the rows (asynchronously on CUDA) and advance the cache lengths; the sampled
        tokens are read in `_complete`."""
        started = time.monotonic()
        want = [n == len(s.pending) for s, n in rows]
        sampling = [s for (s, _), w in zip(rows, want) if w]
        num_fed = sum(n for _, n in rows)
        plain = None  # (temperature, greedy, uniform) per sampling row when the decode step samples
        with torch.no_grad():
            if self.decoder is not None and num_fed == len(rows):  # every row feeds one token
                plain = self._plain_inputs(sampling)
                logits = self.decoder.run([s.slot for s, _ in rows], [s.pending[0] for s, _ in rows],
                                          [s.slot for s in sampling], plain)
                self.stats.static_decode_steps += 1
            else:
                layout = StepLayout.build([(s.slot, self.cache.lengths[s.slot], s.pending[:n]) for s, n in rows],
                                          want_logits=want, device=self.device)
                logits = self.model(layout, self.cache)
                if self.spec.is_moe:
                    self._record_routes(rows)
        # On CUDA the forward runs asynchronously: the host work from here to the copy of the
        # sampled tokens overlaps it (the sampling batch's copies go through pinned memory and
        # do not wait for it).
        for seq, n in rows:
            self.cache.lengths[seq.slot] += n
            del seq.pending[:n]
        return self._launched(rows, sampling, num_fed, started, logits, plain is not None)

    def _launched(self, rows, sampling, num_fed, started, out, packed: bool) -> LaunchedStep:
        record = LaunchedStep(rows, sampling, num_fed, started, self.version, out, packed)
        if packed and self.overlap_steps and self.device.type == "cuda":
            # Copy the packed tokens back now, before a step launched ahead can reuse the buffer.
            record.host = self.decoder.host_out()[:, :out.shape[1]]
            record.host.copy_(out, non_blocking=True)
            record.event = torch.cuda.Event()
            record.event.record()
        return record

    def _plain_inputs(self, sampling: list[EngineSequence]):
        """(temperature, greedy, uniform) of each sampling row when all are plain, else None."""
        plain = [s.plain for s in sampling]
        if not sampling or None in plain:
            return None
        temperature, greedy = zip(*plain)
        if not any(greedy) and all(s.generator is None for s in sampling):  # draw_uniforms' common case, direct
            return temperature, greedy, torch.rand(len(plain), generator=self.generator, dtype=torch.float64).tolist()
        draws = draw_uniforms([s.request.params for s in sampling], [s.generator for s in sampling], self.generator)
        return temperature, greedy, [0.0] * len(plain) if draws is None else draws.tolist()

    def _launch_ahead(self, cur: LaunchedStep) -> LaunchedStep | None:
        """Launch the step after `cur` before reading `cur`'s tokens, when that step is
        certain to be a plain decode step of the same sequences: `cur` sampled in the step,
        every running sequence is in it, none ends by length at `cur`, no waiting request
        could take a free slot, and one more token each fits the KV budget. Its input tokens
        are `cur`'s, copied on the device. A sequence that ends at `cur` with a stop token
        or string computes one row nobody reads (its slot is freed; as for idle slots, what
        it wrote is overwritten before anything attends to it)."""
        if not cur.packed or len(cur.sampling) != len(self._running) or (self._waiting and self.cache.num_free):
            return None
        rows = [s for s in cur.sampling if len(s.tokens) + 1 < s.length_limit]
        if not rows or self.kv_tokens + len(rows) > self.max_num_kv_tokens:
            return None
        started = time.monotonic()
        slots = [s.slot for s in rows]
        with torch.no_grad():
            out = self.decoder.run(slots, None, slots, self._plain_inputs(rows), tokens_from=cur.out)
        self.stats.static_decode_steps += 1
        self.stats.ahead_steps += 1
        for seq in rows:
            self.cache.lengths[seq.slot] += 1
            seq.fed_ahead = True
        return self._launched([(s, 1) for s in rows], rows, len(rows), started, out, True)

    def _drain(self) -> None:
        """Complete a step launched ahead (before anything changes the engine's state); its
        finished requests are returned by the next `step()`."""
        if self._ahead is not None:
            cur, self._ahead = self._ahead, None
            self._drained += self._complete(cur)

    def _complete(self, cur: LaunchedStep) -> list[GenerationResult]:
        """Read the step's tokens (sampling its logits first if the step did not) and apply
        them: append, stamp the step's weight version, check the stop rules."""
        finished = []
        sampling = cur.sampling
        applied = 0
        if sampling:
            top = None
            if cur.packed:  # sampled in the decode step: [2, S], slot s in column s
                if cur.event is not None:
                    cur.event.synchronize()
                by_slot = (cur.host if cur.host is not None else cur.out).tolist()
                tokens = [by_slot[0][s.slot] for s in sampling]
                logprobs = [by_slot[1][s.slot] for s in sampling]
            else:
                batch = SamplingBatch.build([s.request.params for s in sampling], [s.generator for s in sampling],
                                            self.generator, self.device)
                out = sample_tokens(cur.out, batch)
                if out.top_ids is not None:
                    top = list(zip(out.top_ids.tolist(), out.top_logprobs.tolist()))
                # one device-to-host copy for both (float64 holds token ids and float32 logprobs exactly)
                tokens, logprobs = torch.stack((out.tokens.double(), out.logprobs.double())).tolist()
            version = cur.version
            # The per-token loop of every step at every batch size: attribute reads kept to the
            # minimum (weight versions are recorded where they change, see EngineSequence).
            for i, (seq, token, logprob) in enumerate(zip(sampling, map(int, tokens), logprobs)):
                if seq.slot < 0:  # ended (stop token of the step before) while this step ran ahead
                    continue
                applied += 1
                seq_tokens = seq.tokens
                seq_tokens.append(token)
                seq.logprobs.append(logprob)
                if seq.version != version:
                    seq.version_marks.append((len(seq_tokens) - 1, version))
                    seq.version = version
                if seq.top is not None:
                    k = seq.request.params.top_logprobs
                    seq.top.append(list(zip(top[i][0][:k], top[i][1][:k])))
                # fed already when the next step was launched ahead with it
                if seq.fed_ahead:
                    seq.pending = []
                    seq.fed_ahead = False
                else:
                    seq.pending = [token]
                if (token in seq.stop_ids or len(seq_tokens) >= seq.length_limit
                        or seq.stop_strings):  # the common case skips the call
                    reason = self._stop_reason(seq, token)
                    if reason is not None:
                        finished.append(self._finish(seq, reason))
        now = time.monotonic()
        duration = now - max(cur.started, self._last_done)  # this step's share of the wall time
        self._last_done = now
        stats = self.stats
        stats.steps += 1
        stats.busy_s += duration
        stats.tokens_generated += applied
        stats.tokens_fed += cur.num_fed
        stats.last_batch_size = len(cur.rows)
        stats.kv_tokens = self.kv_tokens
        stats.trace.append(StepRecord(cur.started, duration, len(cur.rows), cur.num_fed, applied, len(finished)))
        return finished

    def _record_routes(self, rows: list[tuple[EngineSequence, int]]) -> None:
        """Store the last forward's routes [tokens, layers, k] by position (before the cache
        lengths advance). StepLayout packs one-token rows first, then the others, each in
        row order."""
        flat = self.model.last_routes.flatten(1).tolist()
        at = 0
        for seq, n in [r for r in rows if r[1] == 1] + [r for r in rows if r[1] > 1]:
            start = self.cache.lengths[seq.slot]
            seq.routes[start:start + n] = flat[at:at + n]
            at += n

    def _schedule(self) -> list[tuple[EngineSequence, int]]:
        """(sequence, tokens to feed) of this step: decodes, then prefill chunks, then
        newly admitted requests, within `max_step_tokens` tokens fed and
        `max_num_kv_tokens` tokens held (preempting the newest sequences if needed)."""
        held = self._preempt_over_budget()
        budget = self.max_step_tokens
        decoding = [(s, 1) for s in self._running.values() if len(s.pending) == 1]
        budget -= len(decoding)
        prefilling = []
        for seq in self._running.values():
            if len(seq.pending) > 1 and budget > 0:
                n = min(len(seq.pending), budget)
                prefilling.append((seq, n))
                budget -= n
        # Admission keeps room for one more token of every running sequence (growth of the
        # next step), so a just-admitted request is not preempted at once.
        while self._waiting and self.cache.num_free and budget > 0:
            seq = self._waiting[0]
            need = len(seq.pending)
            if held + need + len(self._running) + 1 > self.max_num_kv_tokens and self._running:
                break  # first come, first served: later requests wait behind this one
            self._waiting.popleft()
            seq.slot = self.cache.allocate()
            self._running[seq.request.request_id] = seq
            held += need
            n = min(need, budget)
            prefilling.append((seq, n))
            budget -= n
        return decoding + prefilling

    def _preempt_over_budget(self) -> int:
        """Send the most recently admitted sequences back to the queue until what running
        sequences hold fits the KV budget; returns what they hold then."""
        held = sum(s.held(self.cache) for s in self._running.values())
        while held > self.max_num_kv_tokens and len(self._running) > 1:
            request_id, seq = self._running.popitem()  # dicts pop the newest insertion
            held -= seq.held(self.cache)
            self.cache.free(seq.slot)
            seq.slot = -1
            seq.pending = list(seq.request.prompt_ids) + seq.tokens
            self._waiting.appendleft(seq)  # oldest preempted ends up first
            self.stats.preemptions += 1
        return held

    def _stop_reason(self, seq: EngineSequence, token: int) -> str | None:
        params = seq.request.params
        if token in seq.stop_ids:
            return "stop"
        if params.stop_strings:
            # A stop string was absent before this token, so a new one ends in its text and
            # spans at most 4 bytes per char, i.e. 4 * len tokens of at least one byte each:
            # decoding that tail (plus a margin for a partial char or a leading space) is
            # enough, and keeps the check O(1) per token instead of O(completion length).
            window = 4 * max(map(len, params.stop_strings)) + 8
            text = self.decode(seq.tokens[-window:])
            if any(s in text for s in params.stop_strings):
                return "stop"
        if len(seq.tokens) >= seq.length_limit:  # max_tokens, or the sequence at max_seq_len
            return "length"
        return None

    def _finish(self, seq: EngineSequence, reason: str) -> GenerationResult:
        request = seq.request
        if seq.slot >= 0:
            self.cache.free(seq.slot)
            seq.slot = -1
            del self._running[request.request_id]
        self._ids.discard(request.request_id)
        if reason == "abort":
            self.stats.requests_aborted += 1
        else:
            self.stats.requests_finished += 1
        if self.kv_sync is not None and reason != "abort":
            self.kv_sync.observe(list(request.prompt_ids) + seq.tokens)
        return GenerationResult(
            request_id=request.request_id, prompt_ids=list(request.prompt_ids), token_ids=seq.tokens,
            logprobs=seq.logprobs, finish_reason=reason, start_version=seq.start_version, end_version=self.version,
            token_versions=seq.token_versions(), started_at=seq.started_at, finished_at=time.monotonic(),
            top_logprobs=seq.top, routed_experts=seq.routes, worker="native",
        )

    def _validate(self, request: GenerationRequest) -> None:
        rid, prompt, params = request.request_id, request.prompt_ids, request.params
        problems = []
        if rid in self._ids:
            problems.append(f"request_id {rid!r} is already in the engine (ids must be unique while in flight)")
        if not prompt:
            problems.append("prompt_ids is empty")
        elif len(prompt) >= self.max_seq_len:
            problems.append(f"the prompt has {len(prompt)} tokens; max_seq_len is {self.max_seq_len} "
                            "(raise max_seq_len or shorten the prompt)")
        elif min(prompt) < 0 or max(prompt) >= self.spec.vocab_size:
            problems.append(f"prompt_ids must lie in [0, {self.spec.vocab_size})")
        else:
            final = min(len(prompt) + max(params.max_tokens, 1), self.max_seq_len)
            if final > self.max_num_kv_tokens:
                problems.append(f"prompt + max_tokens needs up to {final} KV tokens; max_num_kv_tokens is "
                                f"{self.max_num_kv_tokens} (raise max_num_kv_tokens or lower max_tokens)")
        if params.max_tokens < 1:
            problems.append(f"params.max_tokens is {params.max_tokens}; it must be >= 1")
        if params.top_logprobs < 0:
            problems.append(f"params.top_logprobs is {params.top_logprobs}; it must be >= 0")
        if params.temperature < 0:
            problems.append(f"params.temperature is {params.temperature}; it must be >= 0 (0 = greedy)")
        if not 0.0 < params.top_p <= 1.0:
            problems.append(f"params.top_p is {params.top_p}; it must be in (0, 1] (1 = off)")
        if params.top_k < 0:
            problems.append(f"params.top_k is {params.top_k}; it must be >= 0 (0 = off)")
        if any(not s for s in params.stop_strings):
            problems.append("params.stop_strings holds an empty string")
        if params.stop_strings and self.decode is None:
            problems.append("params.stop_strings needs a decode function: pass decode= to NativeEngine")
        if problems:
            raise ValueError(f"request {rid!r}: " + "; ".join(problems) + ".")
