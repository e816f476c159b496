"""The single controller: wires the parts and runs the two pumps on one asyncio event loop.

Owns: building the run (`setup()`: logger, buffer, `PumpLedger`, pumps, refitter, watchdog, an
agent environment's session server, the restored state) and driving it (`run()`: the first
failure of either pump stops both): validation pinned to one weight version and checkpoints
at quiescent points (both at the train pump's step boundary), metrics, spool, summary.
Does not own: building the parts (rl_core.launch), either pump's policy, the checkpoint format.

| pump    | waits for                                                   | unblocked by                         |
| rollout | sampler gate, a buffer slot, in-flight caps, dispatch gate  | version published, slot or cap freed |
| train   | ready groups of its step; its ledger requests served        | a group committed; the rollout pump  |
| refit   | barrier: its steps' groups committed; drain: none in flight | groups committed (buffer, ledger)    |
The pumps meet only at the buffer, the version clock and the ledger: docs/architecture.md, "Data flow".
"""

from __future__ import annotations

import asyncio
import gc
import inspect
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from rl_core.buffer.replay_buffer import OpenStep, ReplayBuffer, TrainedGroup
from rl_core.config.schema import RecipeConfig
from rl_core.controller.events import Timeline, VersionClock, overlap_seconds
from rl_core.controller.ledger import PumpLedger
from rl_core.controller.refit import Refitter
from rl_core.controller.rollout_pump import RolloutPump
from rl_core.controller.train_pump import TrainPump
from rl_core.controller.watchdog import Watchdog
from rl_core.errors import RecipeError
from rl_core.fsutil import atomic_write_json
from rl_core.metrics.gc_pauses import GcClock, freeze_setup_objects, run_thresholds, unfreeze
from rl_core.metrics.logger import MetricsLogger
from rl_core.metrics.progress import Progress
from rl_core.resilience import FailureKind, retry_notice
from rl_core.rollout.group import sampling_params
from rl_core.rollout.spool import RolloutSpool
from rl_core.rollout.validation import Validator

if TYPE_CHECKING:
    from rl_core.data.dataset import PromptSource
    from rl_core.protocols import Environment, GenerationBackend, PolicyLoss, SetupReport, TrainerBackend
    from rl_core.rollout.session_server import SessionServer
    from rl_core.samplers.base import Sampler
    from rl_core.train.critic import Critic


@dataclass
class Parts:
    """Everything the controller drives, already built."""

    tokenizer: Any  # a HF tokenizer (PreTrainedTokenizerBase); tests pass a small fake
    env: Environment
    source: PromptSource
    backend: GenerationBackend
    trainer: TrainerBackend
    loss: PolicyLoss | None
    sampler: Sampler
    val_examples: list[dict]
    stop_token_ids: tuple[int, ...]
    pad_id: int
    setup: SetupReport | None = None  # start-up timing of generation and trainer (launch's SetupRecord)
    critic: Critic | None = None  # when critic.enabled (PPO)


# save(version, controller_state) -> None; called at quiescent step boundaries
CheckpointFn = Callable[[int, dict], Any]


@dataclass
class RLStepRecord:
    """One finished RL step, as step observers see it (`Controller.step_observers`)."""

    step: int  # the RL step (0-based; the policy is now at weight version step + 1)
    metrics: dict  # the step's metrics as logged (metrics.jsonl row `step + 1`)
    trained: list[TrainedGroup]  # the groups it trained, with their advantages


class Controller:
    def __init__(self, cfg: RecipeConfig, parts: Parts, run_dir: str | Path, total_steps: int, *,
                 stop_step: int | None = None, restore: dict | None = None, checkpoint_fn: CheckpointFn | None = None,
                 checkpoint_every: int = 0, spool_dir: str | Path | None = None,
                 val_at_start: bool | None = None, val_at_end: bool | None = None):
        self.cfg = cfg
        self.p = parts
        self.run_dir = Path(run_dir)
        self.total_steps = total_steps
        self.stop_step = total_steps if stop_step is None else min(stop_step, total_steps)
        self.restore = restore
        self.checkpoint_fn = checkpoint_fn
        self.checkpoint_every = checkpoint_every
        self.spool = RolloutSpool(spool_dir) if spool_dir else None
        self.val_at_start = cfg.validation.val_at_start if val_at_start is None else val_at_start
        self.val_at_end = cfg.validation.val_at_end if val_at_end is None else val_at_end
        self.start_step = parts.trainer.version
        self.timeline = Timeline()
        self.validations: list[dict] = []
        self.logger: MetricsLogger | None = None
        self.progress: Progress | None = None
        self.rollout: RolloutPump | None = None
        self.train: TrainPump | None = None
        self.buffer: ReplayBuffer | None = None
        self.ledger: PumpLedger | None = None
        self.sessions: SessionServer | None = None  # agent environments: the run's episode session server
        self.watchdog: Watchdog | None = None
        # called after each RL step (after its metrics are logged and any periodic validation) with
        # the step's record; an observer may return an awaitable (awaited before the step ends)
        self.step_observers: list[Callable[[RLStepRecord], Any]] = []
        self._t_pumps = time.monotonic()
        self._gen_tokens_at_start = 0  # restored counters count earlier processes' tokens too
        self.checkpoints_written: list[int] = []
        self.val_retries = 0  # infra retries of validation groups (this process)
        self._retries_logged = self._data_retries_logged = 0  # the totals at the last step's metrics
        self._retries_at_start = 0

    # ------------------------------------------------------------------ state

    def capture_state(self, open_step: OpenStep | None = None) -> dict:
        """The controller's quiescent state (call only with nothing in flight)."""
        extra = {} if open_step is None else {"open_step": open_step}
        return {**extra,
            "rl_step": self.p.trainer.version,
            "epoch": self.p.source.epoch,
            "total_steps": self.total_steps,
            "source": self.p.source.state_dict(),
            "sampler": self.p.sampler.state_dict(),
            "rollout": self.rollout.state_dict(),
            "buffer": self.buffer.state_dict(),
            # partial rollouts' moves and the samples of evicted / set-aside groups in the whole run
            "train": {"carried_groups": self.train.carried_groups,
                      "wasted_samples": self.ledger.train_stats.wasted_samples},
            # earlier validations (before RL, periodic), so a resumed run's summary keeps them
            "validations": [{k: v for k, v in r.items() if k != "examples"} for r in self.validations],
        }

    def _apply_restore(self) -> None:
        st = self.restore
        self.p.source.load_state_dict(st["source"])
        self.p.sampler.load_state_dict(st["sampler"])
        self.rollout.load_state_dict(st["rollout"])
        self.buffer.load_state_dict(st["buffer"])
        train = st.get("train") or {}  # older checkpoints: none (their rollout stats count every wasted sample)
        self.train.carried_groups = int(train.get("carried_groups", 0))
        self.ledger.train_stats.wasted_samples = int(train.get("wasted_samples", 0))
        self.validations = [dict(r) for r in st.get("validations") or []]  # checkpoints before this field: none
        if st.get("open_step") is not None:
            self.train.resume_open_step = st["open_step"]

    # ------------------------------------------------------------------ hooks

    async def _validate(self, label: str) -> dict:
        val = Validator(self.cfg.validation, self.p.env, self.p.tokenizer, self.p.val_examples, self.cfg.grpo.seed,
                        self.p.stop_token_ids, failure=self.cfg.async_rl.failure,
                        on_retry=lambda kind, exc: self._on_retry(kind, exc, f"validation {label}"),
                        sessions=self.sessions)
        pause = self.cfg.validation.pause_rollouts and self.rollout is not None
        if pause:
            await self.rollout.set_dispatch_open(False)
        t0 = time.monotonic()
        try:
            res = await val.run(self.p.backend, label)
        finally:
            if pause:
                await self.rollout.set_dispatch_open(True)
        self.timeline.add("validate", res["weight_version"], t0, time.monotonic(), res["weight_version"])
        res["label"] = label
        self.validations.append(res)
        k = self.cfg.validation.num_val_generations_per_prompt
        self.val_retries += res["infra_retries"]
        self.logger.log(res["weight_version"], {**{f"val/{m}": res[m] for m in
                                                   ("accuracy", f"pass@{k}", "reward_mean", "mean_length",
                                                    "truncation_rate", "seconds", "dropped_prompts", "infra_retries",
                                                    "data_retries")},
                                                **{f"val/reward/{name}": v for name, v in
                                                   res["reward_components"].items()}}, kind="val")
        self.progress.message(f"[validate:{label}] weight version {res['weight_version']}: accuracy "
                              f"{res['accuracy']:.3f}, pass@{k} {res[f'pass@{k}']:.3f} on {res['num_prompts']} "
                              f"prompts ({res['seconds']:.1f}s)")
        return res

    def _on_retry(self, kind: FailureKind, exc: BaseException, where: str) -> None:
        """A group's failure is retried: a console notice (the first at once, then at most one
        every few seconds per kind, counting the ones between)."""
        self.progress.notice(f"{where}-{kind.value}", retry_notice(kind, exc, where, self.cfg.async_rl.failure))

    def infra_retries(self, backend_metrics: dict | None = None) -> int:
        """Infrastructure retries of the run so far: failed training and validation groups retried,
        and the generation backend's own request retries (HTTP servers; `backend_metrics`: its
        metrics() when already read)."""
        tm = self.p.backend.metrics() if backend_metrics is None else backend_metrics
        return self.rollout.stats.infra_retries + self.val_retries + int(tm.get("retries", 0))

    async def _on_step(self, step: int, metrics: dict, trained: list[TrainedGroup]) -> None:
        tm = self.p.backend.metrics()
        elapsed = time.monotonic() - self._t_pumps
        gen_tok = self.rollout.stats.generated_tokens
        metrics["throughput/generated_tokens_total"] = float(gen_tok)
        # this process's rate: a resumed run's restored total includes tokens of earlier processes
        new_tok = gen_tok - self._gen_tokens_at_start
        metrics["throughput/generated_tokens_per_s"] = new_tok / elapsed if elapsed > 0 else 0.0
        for k, v in tm.items():
            metrics[f"generation/{k}"] = v
        retries = self.infra_retries(tm)
        metrics["failures/infra_retries"] = float(retries - self._retries_logged)  # in this step
        metrics["failures/data_retries"] = float(self.rollout.stats.data_retries - self._data_retries_logged)
        self._retries_logged, self._data_retries_logged = retries, self.rollout.stats.data_retries
        self.logger.log(step + 1, metrics)
        if self.spool is not None:
            await asyncio.to_thread(self.spool.write, step + 1, step, trained)  # RL step numbered as in metrics.jsonl
        self.progress.update(step + 1, reward=metrics["train/reward_mean"],
                             acc=metrics["train/accuracy"], stale=metrics["staleness/max"],
                             tok_s=metrics["throughput/generated_tokens_per_s"],
                             retries=(retries - self._retries_at_start) or None)  # infra retries, this process
        vcfg = self.cfg.validation
        done = step + 1
        if vcfg.val_period and done % vcfg.val_period == 0 and done >= vcfg.val_start_at and done < self.total_steps:
            await self._validate(f"step{done}")
        record = RLStepRecord(step, metrics, trained)
        for observer in self.step_observers:
            out = observer(record)
            if inspect.isawaitable(out):
                await out

    async def _checkpoint_on_failure(self, exc: BaseException) -> None:
        """After a failed train step: save the last good state (its groups back in the buffer; or,
        when PPO mini-steps of the step had already updated the policy, the step open after the
        last completed mini-step) so the run can resume once the cause is fixed."""
        from rl_core.controller.train_pump import TrainStepFailed

        if not isinstance(exc, TrainStepFailed) or self.checkpoint_fn is None:
            return
        await self.rollout.set_dispatch_open(False)
        await self.rollout.wait_idle()
        open_step = self.train.open_step_after_failure()  # PPO: mini-steps already updated the policy
        if open_step is None:
            await self.train.return_open_step()
        state = self.capture_state(open_step)
        await asyncio.to_thread(self.checkpoint_fn, self.p.trainer.version, state)
        self.progress.message(f"[checkpoint] saved RL step {self.p.trainer.version} before stopping: {exc}")

    async def _on_checkpoint(self, version: int) -> None:
        due = version == self.stop_step or (self.checkpoint_every and version % self.checkpoint_every == 0)
        if self.checkpoint_fn is None or not due:
            return
        await self._save(version, None, f"RL step {version}")

    async def _on_ministep(self, open_step: OpenStep) -> None:
        every = self.cfg.checkpoint.save_every_optimizer_steps
        opt = self.p.trainer.optimizer_steps
        if self.checkpoint_fn is None or not every or opt % every:
            return
        await self._save(self.p.trainer.version, open_step,
                         f"RL step {open_step.step} before mini-step {open_step.next_ministep}")

    async def _save(self, version: int, open_step: OpenStep | None, label: str) -> None:
        """A quiescent checkpoint: dispatch closed, every in-flight group committed."""
        await self.rollout.set_dispatch_open(False)
        try:
            await self.rollout.wait_idle()
            t0 = time.monotonic()
            state = self.capture_state(open_step)
            await asyncio.to_thread(self.checkpoint_fn, version, state)
            self.checkpoints_written.append(version)
            self.progress.message(f"[checkpoint] {label} saved ({time.monotonic() - t0:.1f}s)")
        finally:
            await self.rollout.set_dispatch_open(True)

    # ------------------------------------------------------------------ run

    def setup(self) -> None:
        """Build what the run drives: the metric logger, progress, the replay buffer, both pumps
        and the refitter, then apply the restored state. `run()` calls it when not called yet."""
        cfg = self.cfg
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.logger = MetricsLogger.for_run(cfg, self.run_dir)
        self.progress = Progress(self.total_steps, cfg.logging.progress, start=self.start_step, stop=self.stop_step)
        sampler = self.p.sampler
        capacity, need = cfg.async_rl.max_buffered_groups, sampler.required_capacity()
        if capacity < need:  # built-in samplers: refused at recipe load already (required_buffer_capacity)
            raise RecipeError.single("async_rl.max_buffered_groups", capacity,
                                     f">= {need} (the '{sampler.name}' sampler's required_capacity(); fewer "
                                     "slots would deadlock the pumps)",
                                     f"set async_rl.max_buffered_groups to {need} or more.")
        cond = asyncio.Condition()
        clock = VersionClock(cond, self.p.trainer.version)
        self.buffer = ReplayBuffer(capacity, cond)
        # stamped samplers dispatch no group for a step past stop_step + the largest lookahead ever used
        self.ledger = PumpLedger(dispatch_limit=min(self.total_steps, self.stop_step + sampler.lookahead))
        if self.p.env.runs_episodes:  # agent episodes: the run's session server, started at the first one
            from rl_core.rollout.session_server import SessionServer
            from rl_core.rollout.sessions import SessionRegistry

            self.sessions = SessionServer(SessionRegistry(), self.p.tokenizer, backend=self.p.backend)
        params = sampling_params(cfg.generation, self.p.stop_token_ids, self.p.env.stop_strings())
        self.rollout = RolloutPump(
            cfg=cfg, source=self.p.source, sampler=sampler, buffer=self.buffer, backend=self.p.backend,
            env=self.p.env, tokenizer=self.p.tokenizer, clock=clock, cond=cond, timeline=self.timeline, params=params,
            ledger=self.ledger, sessions=self.sessions,
            on_retry=lambda kind, exc: self._on_retry(kind, exc, "training"))
        mode = "barrier" if cfg.async_rl.reproducible else (cfg.async_rl.refit_mode or "in_flight")
        from rl_core.weights import make_weight_sync

        refitter = Refitter([self.p.backend], self.p.trainer, mode, ledger=self.ledger, buffer=self.buffer,
                            sampler=sampler, recompute_kv=cfg.async_rl.recompute_kv_cache_after_weight_updates,
                            sync=make_weight_sync(cfg, self.run_dir))
        self.train = TrainPump(
            cfg=cfg, sampler=sampler, buffer=self.buffer, trainer=self.p.trainer, loss=self.p.loss,
            refitter=refitter, clock=clock, cond=cond, timeline=self.timeline, ledger=self.ledger,
            stop_step=self.stop_step, pad_id=self.p.pad_id, on_step=self._on_step,
            on_checkpoint=self._on_checkpoint, on_ministep=self._on_ministep, critic=self.p.critic)
        self.watchdog = Watchdog(cfg.async_rl.watchdog, self.rollout, self.train, self.buffer, self.p.backend,
                                 self.p.trainer)
        if self.restore is not None:
            self._apply_restore()

    async def run(self) -> dict:
        """Drive the run: start generation, validate, run both pumps to `stop_step`, validate,
        shut down; returns (and writes) the run summary."""
        cfg = self.cfg
        if self.train is None:
            self.setup()
        t0 = time.monotonic()
        pump_s = 0.0
        if self.p.setup is not None:  # timing/setup/* metrics and setup_* timeline spans
            self.p.setup.report(self.logger, self.timeline, self.start_step)
        gc_thresholds = None
        await self.p.backend.start()
        reopened: OpenStep | None = (self.restore or {}).get("open_step")
        if reopened is not None and reopened.served_weights is not None:
            # resumed between mini-steps: serve the step's start weights
            await self.p.backend.update_weights(self.p.trainer.version, reopened.served_weights)
        # per-step retry counts start from here (restored counters hold earlier processes' too)
        self._retries_logged, self._data_retries_logged = self.infra_retries(), self.rollout.stats.data_retries
        self._retries_at_start = self._retries_logged
        # the watchdog watches the whole run (a blocked loop in validation too), progress only while the pumps run
        watch_task = asyncio.create_task(self.watchdog.run(), name="watchdog")
        try:
            if self.val_at_start:
                await self._watched(self._validate("start"), watch_task)
            freeze_setup_objects()  # full collections then scan only what the run allocates
            # fewer re-scans of the buffered and in-flight groups (metrics.gc_pauses)
            gc_thresholds = run_thresholds(cfg.async_rl.max_inflight_groups)
            self.train.gc_clock = GcClock().start()  # timing/gc_* per step
            t_pumps = self._t_pumps = self.progress.t0 = time.monotonic()
            self._gen_tokens_at_start = self.rollout.stats.generated_tokens
            rollout_task = asyncio.create_task(self.rollout.run(), name="rollout_pump")
            train_task = asyncio.create_task(self.train.run(), name="train_pump")
            self.watchdog.watch_progress(True)
            tasks = {rollout_task, train_task, watch_task}
            while not train_task.done():
                done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
                failed = [t for t in done if not t.cancelled() and t.exception() is not None]
                if failed:
                    await self._checkpoint_on_failure(failed[0].exception())
                    for other in tasks:
                        other.cancel()
                    await asyncio.gather(*tasks, return_exceptions=True)
                    raise failed[0].exception()
                tasks -= done
            self.watchdog.watch_progress(False)
            # the rollout pump stops by itself at its dispatch limit; groups it ran ahead for the
            # next steps are already committed (they were in the final checkpoint); groups still
            # generating now no step will train (over-sampling, or no final checkpoint): aborted
            await self.rollout.stop()
            await rollout_task
            pump_s = time.monotonic() - t_pumps
            self.progress.close()
            if self.val_at_end:
                await self._watched(self._validate("end"), watch_task)
        finally:
            watch_task.cancel()
            await asyncio.gather(watch_task, return_exceptions=True)
            if self.train.gc_clock is not None:
                self.train.gc_clock.stop()
            unfreeze()
            if gc_thresholds is not None:
                gc.set_threshold(*gc_thresholds)
            self.progress.close()
            await self.p.backend.shutdown()
            if self.sessions is not None:
                await self.sessions.stop()
            await self.p.env.aclose()
            self.logger.close()
            self.timeline.write(self.run_dir / "timeline.jsonl")
        return self._summary(time.monotonic() - t0, pump_s)

    @staticmethod
    async def _watched(coro, watch_task: asyncio.Task):
        """Await `coro` unless the watchdog stops the run first (its error is raised, `coro` cancelled)."""
        task = asyncio.ensure_future(coro)
        try:
            await asyncio.wait({task, watch_task}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        if task.cancelled() and watch_task.done() and not watch_task.cancelled():
            watch_task.result()  # raises the watchdog's error
        return task.result()

    def _summary(self, wall_s: float, pump_s: float) -> dict:
        gen = self.timeline.of("generate")
        train = self.timeline.of("train")
        start = next((v for v in self.validations if v["label"] == "start"), None)
        end = next((v for v in self.validations if v["label"] == "end"), None)
        summary = {
            "run_name": self.cfg.run_name,
            "rl_steps": self.p.trainer.version,
            "start_step": self.start_step,
            "stop_step": self.stop_step,
            "total_steps": self.total_steps,
            "optimizer_steps": self.p.trainer.optimizer_steps,
            "epoch": self.p.source.epoch,
            "wall_s": wall_s,
            "pumps_s": pump_s,
            "generation_train_overlap_s": overlap_seconds(gen, train),
            "train_busy_s": sum(s.end - s.start for s in train),
            "train_idle_s": self.train.idle_s,
            "rollout_idle_s": self.rollout.stats.idle_s,
            "generated_tokens": self.rollout.stats.generated_tokens,
            "generated_tokens_this_process": self.rollout.stats.generated_tokens - self._gen_tokens_at_start,
            "max_staleness": max(self.train.staleness_log) if self.train.staleness_log else 0,
            "staleness_bound": self.p.sampler.staleness_bound,
            "carried_groups": self.train.carried_groups,
            "checkpoints": self.checkpoints_written,
            "val_start": {k: start[k] for k in ("accuracy", "weight_version")} if start else None,
            "val_end": {k: end[k] for k in ("accuracy", "weight_version")} if end else None,
            "validations": [{k: v for k, v in r.items() if k != "examples"} for r in self.validations],
        }
        atomic_write_json(self.run_dir / "summary.json", summary)
        return summary
