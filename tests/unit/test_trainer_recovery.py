"""`RecoveringTrainer` (rl_core/train/recovery.py): the journal since the base, its replay on a
replacement trainer, the retried call, the budget and the deadline; and the command channel's
armed watchdog, which kills a hung worker of this host instead of rank 0 (rl_core/train/spmd.py).

The trainer here is a small deterministic one (a running hash of what it trained), so that
"trained twice" or "lost" shows in its state; the multi-process trainer is
tests/integration/test_trainer_group_recovery.py."""

from __future__ import annotations

import hashlib
import os
import signal
import time

import pytest
import torch

from rl_core.train.recovery import RecoveringTrainer, RecoveryFailed
from rl_core.train.spmd import INIT, CommandChannel, WorkerError, WorkerLostError
from rl_core.types import TrainChunk
from tests.helpers.trainers import Collective, channel_worker


def chunk(i: int) -> TrainChunk:
    z = torch.zeros(2, 3)
    return TrainChunk(input_ids=torch.full((2, 3), i), attention_mask=torch.ones(2, 3, dtype=torch.long),
                      loss_mask=z, gen_logprobs=z, advantages=z, sample_mask=torch.ones(2),
                      start_versions=torch.zeros(2, dtype=torch.long))


class HashTrainer:
    """State = (version, a hash of every chunk trained into it, in order); `fail_at`: raise
    WorkerLostError at that call number (counted over this trainer's calls)."""

    def __init__(self, version: int = 0, state: str = "", fail_at: dict | None = None):
        self.version, self.state, self.calls, self.fail_at = version, state, 0, fail_at or {}
        self.open = False

    def _tick(self, name: str) -> None:
        self.calls += 1
        if self.fail_at.get(self.calls):
            raise self.fail_at[self.calls](f"trainer worker rank 1 (host h, pid 7) stopped answering during {name}")

    def begin(self, loss) -> None:
        self._tick("begin")
        assert not self.open
        self.open = True

    def train_microbatches(self, c: TrainChunk) -> None:
        self._tick("train_microbatches")
        assert self.open
        self.state = hashlib.sha256((self.state + str(c.input_ids[0, 0].item())).encode()).hexdigest()

    def finish(self, advance_version: bool = True) -> dict:
        self._tick("finish")
        self.open = False
        self.version += int(advance_version)
        return {"loss": 1.0}

    def abort(self) -> None:
        self._tick("abort")
        self.open = False

    def logprobs(self, c, reference=False):
        self._tick("logprobs")
        return torch.zeros(2, 3)

    def state_dict(self) -> dict:
        self._tick("state_dict")
        return {"version": self.version, "state": self.state}


def run_steps(trainer, steps: range, checkpoints: dict | None = None) -> list[dict]:
    """RL steps as the train pump runs them; returns each finish()'s metrics."""
    outs = []
    for s in steps:
        trainer.logprobs(chunk(100 + s))
        trainer.begin(None)
        trainer.train_microbatches(chunk(2 * s))
        trainer.train_microbatches(chunk(2 * s + 1))
        outs.append(trainer.finish())
        if checkpoints is not None and s % 2 == 1:  # a step checkpoint after steps 1, 3, ...
            checkpoints[trainer.version] = trainer.state_dict()
            trainer.rebase(trainer.version, trainer.version)
    return outs


def recovering(first: HashTrainer, checkpoints: dict, restarts: list, max_restarts: int = 2, deadline_s: float = 60,
               replacement_fails: dict | None = None, slow_s: float = 0.0) -> RecoveringTrainer:
    def restart(base, old, deadline):
        assert old.pop() is not None and not old  # the failed trainer handed over, no reference left here
        restarts.append(base)
        time.sleep(slow_s)
        saved = checkpoints.get(base, {"version": 0, "state": ""})
        fails = (replacement_fails or {}).get(len(restarts), {})
        return HashTrainer(saved["version"], saved["state"], fail_at=fails)

    return RecoveringTrainer(first, restart, base=0, base_version=0, max_restarts=max_restarts,
                             deadline_s=deadline_s, log=lambda line: None)


def test_a_lost_worker_mid_step_is_replaced_and_the_steps_since_the_checkpoint_replayed():
    plain = HashTrainer()
    for s in range(6):
        plain.begin(None)
        plain.train_microbatches(chunk(2 * s))
        plain.train_microbatches(chunk(2 * s + 1))
        plain.finish()
    checkpoints, restarts = {}, []
    # 5 calls a step (logprobs, begin, 2 x train, finish) + state_dict after steps 1 and 3: call 26 is the
    # second train_microbatches of step 4 (0-based), in the step after the checkpoint at version 4
    first = HashTrainer(fail_at={26: WorkerLostError})
    t = recovering(first, checkpoints, restarts)
    run_steps(t, range(6), checkpoints)
    assert restarts == [4]  # the newest checkpoint's base
    assert (t.version, t.state) == (plain.version, plain.state)  # nothing lost, nothing trained twice
    (rec,) = t.recoveries
    assert rec.during == "train_microbatches" and rec.version == 4 and rec.restored_version == 4
    assert rec.replayed_steps == [] and rec.replayed_calls == 2 and rec.replayed_samples == 2
    assert "rank 1" in rec.lost


def test_finished_steps_after_the_checkpoint_are_replayed_and_reported():
    plain = HashTrainer()
    run_steps(plain, range(5))
    checkpoints, restarts = {}, []
    first = HashTrainer(fail_at={17: WorkerLostError})  # in step 3's logprobs, step 2 finished since version 2
    t = recovering(first, checkpoints, restarts)
    steps = run_steps(t, range(5), checkpoints)
    assert (t.version, t.state) == (plain.version, plain.state)
    (rec,) = t.recoveries
    assert rec.during == "logprobs" and rec.replayed_steps == [3] and rec.restored_version == 2
    assert [m["recovery/count_total"] for m in steps] == [0, 0, 0, 1, 1]
    assert steps[3]["recovery/replayed_steps"] == 1 and steps[3]["recovery/seconds_lost"] > 0
    assert steps[4]["recovery/replayed_steps"] == 0


def test_a_worker_lost_during_the_replay_counts_as_another_replacement():
    plain = HashTrainer()
    run_steps(plain, range(4))
    checkpoints, restarts = {}, []
    t = recovering(HashTrainer(fail_at={17: WorkerLostError}), checkpoints, restarts,
                   replacement_fails={1: {2: WorkerLostError}})  # step 3's logprobs, then the replay's first train
    run_steps(t, range(4), checkpoints)
    assert (t.version, t.state) == (plain.version, plain.state)
    assert restarts == [2, 2] and len(t.recoveries) == 2


def test_past_the_budget_the_run_fails_naming_the_rank_and_the_budget():
    t = recovering(HashTrainer(fail_at={3: WorkerLostError}), {}, [], max_restarts=1,
                   replacement_fails={1: {3: WorkerLostError}})
    with pytest.raises(RecoveryFailed, match=r"rank 1 \(host h, pid 7\).*trainer.recovery.max_restarts = 1 "
                                             r"\(1 replacement\(s\) already made\)"):
        run_steps(t, range(2))


def test_a_replacement_past_the_deadline_fails_the_run():
    t = recovering(HashTrainer(fail_at={2: WorkerLostError}), {}, [], deadline_s=0.2, slow_s=0.4)
    with pytest.raises(RecoveryFailed, match="trainer.recovery.restart_deadline_s = 0.2"):
        run_steps(t, range(1))


def test_a_worker_that_raised_is_not_replaced():
    """A worker's own exception (not a lost worker) would fail again the same way: no replacement."""
    restarts = []
    t = recovering(HashTrainer(fail_at={3: WorkerError}), {}, restarts)
    with pytest.raises(WorkerError):
        run_steps(t, range(1))
    assert restarts == [] and t.recoveries == []


def test_the_armed_watchdog_kills_a_hung_worker_instead_of_rank_0():
    with channel_worker() as (store, worker):
        driver = CommandChannel(0, 2, store=store, timeout_s=600, heartbeat_timeout_s=3.0)
        driver.recoverable = True
        driver.complete(driver.publish(INIT))
        driver.call(Collective(), "noop")  # a working group (its heartbeat started)
        os.kill(worker.pid, signal.SIGSTOP)  # hung: no heartbeat, the collective waits for it
        t0 = time.monotonic()
        with pytest.raises(WorkerLostError, match=r"trainer worker rank 1 \(host .*, pid %d\)" % worker.pid):
            driver.call(Collective(), "wait", worker.pid)
        took = time.monotonic() - t0
        assert worker.wait(10) == -signal.SIGKILL  # the watchdog killed the worker; this process lives on
        assert 3.0 <= took < 3.0 + 8, took
        driver.abandon()
