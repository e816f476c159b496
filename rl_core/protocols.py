"""The seams between rl_core's parts, as small typing Protocols.

Owns: the method names, arguments and meanings each implementation must honour. Each
seam has a real small implementation in the package (native engine, torch trainer, toy
environments, built-in samplers) so the whole loop runs on a CPU; fakes are only for
unit tests of one part. Does not own: any implementation, or the wiring (controller).

Versions: a *weight version* is the number of RL steps the weights have seen. A backend
reports the version it serves; a result records the version at its start and at its end.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Protocol, runtime_checkable

import torch

from rl_core.types import EnvResult, GenerationRequest, GenerationResult, SamplingParams, SyncReport, TrainChunk
from rl_core.columns import GroupResults, GroupScores

# Where new weights come from: an in-process state dict (HF parameter names), or a
# directory of safetensors files (filesystem handoff).
WeightSource = Mapping[str, torch.Tensor] | str | Path


@runtime_checkable
class GenerationBackend(Protocol):
    """Generates completions; all methods are called from the controller's event loop."""

    @property
    def weight_version(self) -> int: ...

    async def start(self) -> None:
        """Bring the backend up (load weights, start worker threads or connect to servers)."""

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        """Generate one sample. An aborted request returns with finish_reason 'abort'.
        `token_ids` and `logprobs` of the result may be Python lists or 1-D NumPy arrays
        (`rl_core.columns.token_array` / `logprob_array`: packed into training tensors by a
        memory copy); consumers never modify them.

        Optional (`GroupGenerationBackend`): `generate_group(key, prompt_ids, params, seeds)`,
        one prompt group in one call with its results as columns, or `generate_many(requests)`,
        the group's N requests in one call. The default for a backend without either (or whose
        `generate` is overridden below the class defining them) is one `generate` call (and
        one asyncio task) per sample (`rl_core.rollout.group`)."""

    async def abort(self, request_id: str) -> None:
        """Stop one in-flight request now and free its capacity."""

    async def update_weights(self, version: int, weights: WeightSource) -> None:
        """Swap in new weights; requests in flight continue on them (their tokens record the version)."""

    async def invalidate_kv_cache(self) -> None:
        """Recompute/drop cached keys and values computed with older weights."""

    def capacity(self) -> int:
        """How many requests the backend can usefully run at once."""

    def metrics(self) -> dict[str, float]:
        """Counters since start (tokens generated, busy time, ...)."""

    async def shutdown(self) -> None: ...


@runtime_checkable
class GroupGenerationBackend(Protocol):
    """The optional group calls of a `GenerationBackend`: a backend implements either, both or
    neither. rl_core.rollout.group uses them for single-turn groups without generation-level
    backpressure, `generate_group` when the backend has it, else `generate_many`; other groups,
    and backends with neither, get a `generate` call per sample. The native backend, the HTTP
    backend on rl_core servers and both vLLM backends (one request a group) have
    `generate_group`.
    A group call counts only when defined by the class that defines `generate` or a subclass
    of it, and an instance can turn one off by setting the attribute to None."""

    async def generate_group(self, key: str, prompt_ids: list[int], params: SamplingParams,
                             seeds: list[int]) -> GroupResults:
        """One prompt group of `len(seeds)` samples, its results as columns (`GroupResults`, in
        sample order): sample i is exactly what `generate(GenerationRequest(f"{key}/{i}",
        prompt_ids, replace(params, seed=seeds[i])))` would give (`types.group_requests` builds
        those requests), the requests entering the backend in sample order. The caller builds
        no request, params copy or result per sample; `prompt_ids` and `params` are shared by
        the samples and never modified. Cancelled: every unfinished sample is aborted (its
        request id `f"{key}/{i}"` can also be aborted with `abort`, where the backend can stop
        one sample of a group: the native and HTTP backends, not vLLM's). One failed
        sample fails the call (the others are aborted). The rollout derives a group's seeds
        consecutively (`rollout.group.seed_last`), as servers seed a request's `n` choices."""

    async def generate_many(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        """The results of `requests`, in their order: each exactly what `generate(request)`
        would give (same ids, seeds, stop rules), the requests entering the backend in order.
        Cancelled: every unfinished request is aborted. One failed request fails the call
        (the others are aborted)."""


@runtime_checkable
class Environment(Protocol):
    """Turns a dataset example into the first observation and a completion into rewards.

    It owns the templating of its observations (chat template or raw text), so the
    controller only ever sees token ids. `rl_core.envs.base.BaseEnv` implements every member
    around two public hooks a user fills in (`prompt_text`, `score_completion`); this is the
    whole contract the rollout code (`rl_core.rollout.group`) relies on.
    """

    name: str
    reward_names: tuple[str, ...]
    """Names of the reward components `score` returns (empty: one scalar reward)."""
    max_turns: int
    """Turns of a rollout (1 = single turn)."""
    end_token_ids: tuple[int, ...]
    """Token ids that end a completion (the first one ends reference completions)."""
    runs_episodes: bool
    """True: an agent drives each episode; the environment is then an `EpisodeEnvironment`."""

    def prompt_ids(self, example: dict[str, Any]) -> list[int]:
        """Token ids of the (templated) prompt for this example."""

    def stop_strings(self) -> tuple[str, ...]:
        """Strings that end a completion for this environment (besides the end token)."""

    def reference_completion_ids(self, example: dict[str, Any]) -> list[int]:
        """The ideal completion as token ids (supervised warm-up)."""

    def parse_completion(self, completion_ids: list[int], completion_text: str, finish_reason: str) -> Any:
        """The completion as the scoring hooks see it (`rl_core.envs.base.Completion`)."""

    def observe(self, example: dict[str, Any], turn: int, completion: Any) -> list[int] | None:
        """Token ids of the observation after turn `turn` (masked out of the loss); None ends the episode."""

    def score(self, example: dict[str, Any], completion_ids: list[int], completion_text: str,
              finish_reason: str) -> EnvResult:
        """Reward(s) for one completion, and whether to mask it out of the loss. The
        environment declares what counts as a correct sample in `info["correct"]` (a bool):
        held-out accuracy, pass@k, `train/accuracy`, the headline, the report and the `best`
        checkpoint count it. Without it a sample is correct when its reward is > 0, right only
        where the reward has no shaping term (docs/environments.md, "What counts as correct")."""

    def score_turns(self, example: dict[str, Any], turns: list[Any]) -> EnvResult:
        """Reward(s) of a multi-turn episode from its parsed turns."""

    async def aclose(self) -> None:
        """Release what the environment started; called once at the end of a run."""


@runtime_checkable
class GroupScoringEnvironment(Protocol):
    """The optional group scoring of an `Environment`. rl_core.rollout.group calls it for each
    single-turn group that a backend generated in one group call (`GroupGenerationBackend`)
    when no `env_timeout_s` applies (scoring on the event loop); every other sample, and every
    environment without it, is scored by a `score` call per sample (`BaseEnv` implements it
    through its `score_columns` hook: addition, math, reasoning_gym). It
    counts only when defined by the class that defines `score` or a subclass of it, and an
    instance can turn it off by setting the attribute to None. Each sample's scoring time
    (`rollout/env_s_*`) is then its share of the call (the call's time over N)."""

    def score_group(self, example: dict[str, Any], completion_ids: list, completion_texts: list[str],
                    finish_reasons: list[str]) -> GroupScores:
        """The scores of one group's N completions (ids as lists or 1-D NumPy arrays), as
        columns (`rl_core.columns.GroupScores`, in sample order): sample i's entries are
        exactly what `score(example, completion_ids[i], completion_texts[i],
        finish_reasons[i])` would return, without an `EnvResult` and two dicts per sample."""


@runtime_checkable
class EpisodeEnvironment(Protocol):
    """The optional agent episodes of an `Environment` whose `runs_episodes` is true (rl_core.envs.agent:
    `env.type: agent` and `http`). rl_core.rollout.group calls it for every sample of such an
    environment: it opens the episode's session on the run's session server (owned by
    rl_core.rollout.session_server) and hands the session's URL and key to `run_agent`, which
    drives the model there and returns the reward; the model calls are the sample's tokens."""

    runs_episodes: bool
    """True (an environment without agent episodes is not an `EpisodeEnvironment`)."""
    episode_timeout_s: float | None
    """Deadline of one episode (`run_agent` and its model calls); None: none."""

    async def run_agent(self, base_url: str, api_key: str, example: dict[str, Any]) -> EnvResult:
        """Run one episode of `example` against the OpenAI-compatible session at `base_url`
        (`api_key` is that session's own key); its reward(s). Raises on a failed episode: a
        `ConnectionError` is an infrastructure failure of the group (retried), anything else a
        data failure."""


@runtime_checkable
class BatchPromptEnvironment(Protocol):
    """The optional batch prompt encode of an `Environment` (`rl_core.envs.base.BaseEnv` has it):
    the rollout pump encodes each batch of prompts it draws in one call; otherwise every group
    encodes its own (`prompt_ids`). Either way the ids are those of `prompt_ids`."""

    def prompt_ids_many(self, examples: list[dict[str, Any]]) -> list[list[int]] | None:
        """`[prompt_ids(e) for e in examples]` in one call, or None where that cannot be guaranteed."""

    def start_prompt_ids_many(self, examples: list[dict[str, Any]]) -> Callable[[], list[list[int]] | None]:
        """`prompt_ids_many(examples)` begun now; the function returned gives its result (or
        raises its error) when called. The rollout pump calls it when it draws a batch and the
        function when the batch's first group starts."""


@dataclass
class LossOutput:
    """A loss over one microbatch, in *sum* form so that chunks can stream into one step.

    The trainer backpropagates `loss_sum`, adds `normalizer` to the step's total, and at
    `finish()` divides the accumulated gradients by that total: exact token-level (or
    sequence-level) averaging over the whole step however the step was chunked.
    `metrics` maps a name to (sum, count) so that means reduce correctly across chunks.
    """

    loss_sum: torch.Tensor
    normalizer: float
    metrics: dict[str, tuple[float, float]] = field(default_factory=dict)


class PolicyLoss(Protocol):
    """A loss function of the trainer's current logprobs and a chunk."""

    needs_reference_logprobs: bool
    needs_prev_logprobs: bool

    def __call__(self, logprobs: torch.Tensor, chunk: TrainChunk) -> LossOutput: ...

    def skipped_normalizer(self, chunk: TrainChunk) -> float:
        """The normaliser of a microbatch the trainer skips because no token of it is trained
        (0 unless the loss counts empty sequences), so that skipping changes nothing."""


@runtime_checkable
class TrainerBackend(Protocol):
    """The training side. One RL step = begin -> train_microbatches (any number of chunks) -> finish."""

    version: int
    """RL steps the weights have seen (the weight version; `finish()` bumps it)."""
    optimizer_steps: int
    """Optimizer steps taken (PPO mini-steps count each; a skipped update does not count)."""
    reference_dir: str | None
    """Directory of the frozen KL reference policy (None: no reference kept); saved in run checkpoints."""

    def begin(self, loss: PolicyLoss) -> None:
        """Open one logical step (raises if one is already open)."""

    def train_microbatches(self, chunk: TrainChunk) -> None:
        """Forward/backward over a chunk in microbatches; gradients accumulate."""

    def finish(self, advance_version: bool = True) -> dict[str, float]:
        """Normalise, clip, take one optimizer step; bump `version` unless this is an inner
        mini-step of an RL step (advance_version=False); returns metrics."""

    def abort(self) -> None:
        """Drop the open step's gradients; no optimizer step is taken."""

    def logprobs(self, chunk: TrainChunk, reference: bool = False) -> torch.Tensor:
        """Per-token logprobs [B, T] of the chunk's tokens under the current (or reference) weights."""

    def export_weights(self, on_device: bool = False) -> dict[str, torch.Tensor]:
        """The current weights under HF parameter names (for refit and checkpoints).

        Data-parallel backends gather them to CPU on rank 0; `on_device=True` leaves them on
        rank 0's device instead (a refit transport that sends from the GPU asks for it)."""

    def state_dict(self) -> dict[str, Any]:
        """Version, optimizer steps and optimizer state (what a run checkpoint stores besides weights)."""

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def save_pretrained(self, out_dir: str | Path) -> None:
        """Write the current policy as a HF model directory (weights + config)."""


@runtime_checkable
class WeightSync(Protocol):
    """A refit transport (`rl_core.weights`): moves a state dict from the trainer to the backends.

    `rl_core.controller.refit.Refitter` calls `push` once per refit, with the weights the
    trainer exported: on the trainer's device when `sends_from_device` is true, else on the CPU.
    """

    kind: str
    """The recipe's `trainer.weight_sync.type` this transport implements (also the report's kind)."""
    sends_from_device: bool
    """True: refit exports the weights onto the trainer's device (`export_weights(on_device=True)`)."""

    async def push(self, version: int, weights: Mapping[str, torch.Tensor],
                   backends: Iterable[GenerationBackend]) -> SyncReport:
        """Make weights `version` current in every backend; returns what moved and how long it took."""


class SetupReport(Protocol):
    """Start-up timing of a run's parts (`rl_core.launch.placement.SetupRecord`), which the
    controller reports once its logger and timeline exist."""

    def report(self, logger: Any, timeline: Any, step: int) -> None:
        """Log `timing/setup/*` at `step` and add the set-up spans to the timeline."""
