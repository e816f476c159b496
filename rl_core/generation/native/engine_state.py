"""The records NativeEngine keeps: a request inside the engine, a launched step, per-step
timings and the engine's counters.

Owns: `StepRecord`, `EngineStats` (public: `NativeEngine.stats`), `EngineSequence` (a request's
state from queue to finish) and `LaunchedStep` (a step whose forward is launched and whose
tokens are not applied yet). Does not own: what the engine does with them (engine.py).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch

from rl_core.generation.native.kv_cache import KVCache
from rl_core.generation.native.sampling import is_plain, new_generator
from rl_core.types import GenerationRequest


@dataclass
class StepRecord:
    """Timing of one step (kept in a bounded deque: `NativeEngine.stats.trace`)."""

    started_at: float  # time.monotonic()
    duration_s: float
    num_rows: int  # sequences fed
    num_tokens: int  # tokens fed (prefill chunks + decode tokens)
    num_sampled: int  # tokens generated
    num_finished: int


@dataclass
class EngineStats:
    """Counters since the engine was built."""

    steps: int = 0
    tokens_generated: int = 0
    tokens_fed: int = 0  # all tokens run through the model (prompts, re-prefills, decodes)
    busy_s: float = 0.0
    requests_added: int = 0
    requests_finished: int = 0  # stop or length
    requests_aborted: int = 0
    weight_updates: int = 0
    kv_invalidations: int = 0
    preemptions: int = 0  # sequences sent back to the queue by the KV token budget
    kv_calibrations: int = 0  # FP8 scale calibration passes
    static_decode_steps: int = 0  # steps run by the DecodeRunner (graph replays or static eager)
    ahead_steps: int = 0  # steps launched before the previous step's tokens were read (overlap_steps)
    last_batch_size: int = 0
    kv_tokens: int = 0  # tokens in the KV cache (running sequences) after the last step
    trace: deque = field(default_factory=lambda: deque(maxlen=1024))


@dataclass
class LaunchedStep:
    """A step whose forward is launched and whose tokens are not applied yet."""

    rows: list  # (sequence, tokens fed)
    sampling: list  # sequences that sample a token in this step
    num_fed: int
    started: float  # time.monotonic() at launch
    version: int  # weight version the step ran with
    out: Any  # logits to sample, or [2, S] tokens/logprobs by slot when `packed`
    packed: bool  # sampled in the decode step (DecodeRunner.run with plain rows)
    host: torch.Tensor | None = None  # pinned copy of `out` on its way back (overlap on CUDA)
    event: Any = None  # CUDA event after that copy


class EngineSequence:
    """A request inside the engine."""

    __slots__ = ("request", "slot", "pending", "tokens", "logprobs", "version", "version_marks", "generator",
                 "stop_ids", "start_version", "started_at", "top", "routes", "fed_ahead", "length_limit", "plain",
                 "stop_strings")

    def __init__(self, request: GenerationRequest, stop_ids: frozenset[int], version: int,
                 record_routes: bool = False, max_seq_len: int | None = None):
        self.request = request
        self.slot = -1  # -1: waiting for a slot
        self.pending = list(request.prompt_ids)
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        # The weight version of each token, recorded where it changes: (token index, version)
        # marks, expanded by `token_versions()`; `version` is the last token's (-1: none yet).
        self.version = -1
        self.version_marks: list[tuple[int, int]] = []
        seed = request.params.seed
        self.generator = None if seed is None else new_generator(seed)
        self.stop_ids = stop_ids
        self.start_version = version
        self.started_at = time.monotonic()
        self.top: list[list[tuple[int, float]]] | None = [] if request.params.top_logprobs else None
        self.routes: list[list[int]] | None = [] if record_routes else None  # per position: layers x k ids
        self.fed_ahead = False  # a step launched ahead already feeds the token still to be read
        # Read once here, per step by the engine: the completion length that ends it ("length":
        # max_tokens, or the sequence reaching max_seq_len), and (logprob temperature, greedy)
        # when the request samples plainly (`sampling.is_plain`), else None.
        params = request.params
        room = params.max_tokens if max_seq_len is None else max_seq_len - len(request.prompt_ids)
        self.length_limit = min(params.max_tokens, room)
        self.plain = (params.logprob_temperature, params.is_greedy) if is_plain([params]) else None
        self.stop_strings = bool(params.stop_strings)

    def token_versions(self) -> list[int]:
        """The weight version each generated token was sampled with."""
        out: list[int] = []
        marks = self.version_marks
        for j, (start, version) in enumerate(marks):
            end = marks[j + 1][0] if j + 1 < len(marks) else len(self.tokens)
            out += [version] * (end - start)
        return out

    def held(self, cache: KVCache) -> int:
        """KV tokens this running sequence holds once its pending tokens are fed."""
        return cache.lengths[self.slot] + len(self.pending)
