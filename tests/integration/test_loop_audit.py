"""The rest of issue 19's knobs proven in the real loop (native engine, torch trainer and critic,
both pumps, the warmed-up tiny policy; two or three RL steps each). Each test asserts the
behaviour (counts, bounds, metrics), not only that the run finishes:

- rollout metrics: trajectory age is the time a group waited between its commit and its
  selection (not the training and refit after it); generated tokens per generation worker;
- `env.mask_flagged_samples`: environment-flagged samples leave the loss with the knob on and
  are trained with it off;
- a multi-turn chat environment: the base class templates its text observation as a chat user
  turn (tokens checked against ChatML written out by hand);
- validation's pass@k (every k in 1..n) against brute force over the samples it scored;
- PPO with a critic under other samplers and the drop budgets (a dropped group shrinks an
  in_order step; windowed replaces it by demand), with PPO epochs;
- FLOPs and MFU at trainer level with PPO mini-steps: every mini-step's training and the
  previous-policy forward pass counted once per RL step, their time in the MFU's seconds;
- `train_pump.needs_reference_logprobs` is the gate that decides whether the trainer keeps
  the frozen reference.

Fakes only where timing or hardware must be controlled: a trainer wrapper that sleeps in its
update, a backend wrapper that fails chosen groups, a known peak FLOP/s on the CPU."""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import time
from fractions import Fraction

import pytest

import rl_core.controller.train_pump as train_pump
import rl_core.train.torch_trainer as torch_trainer
from rl_core.launch.preflight import load_recipe
from rl_core.controller.controller import Controller
from rl_core.envs.addition import AdditionEnv
from rl_core.envs.chain import ChainAdditionEnv, third_operand
from rl_core.launch.train import build_parts
from rl_core.rollout.group import is_correct
from rl_core.types import EnvResult

from tests.helpers.paths import ROOT, TINY_RECIPE as RECIPE
from tests.integration.test_loop_knobs import N, P, SMALL, TRAINING_REQUEST


class Delegate:
    """Base of the wrappers: everything else goes to the real part."""

    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, name):
        return getattr(self.inner, name)


def run_loop(tmp_path, warm_policy, monkeypatch, *overrides: str, steps: int = 2, name: str = "run", prepare=None,
             spool: bool = False):
    """The tiny recipe on the real loop; `prepare(parts)` may replace parts. -> (ctl, train records, step records)."""
    monkeypatch.chdir(ROOT)
    cfg = load_recipe(RECIPE, [f"output_dir={tmp_path}", f"run_name={name}", f"grpo.max_num_steps={steps}",
                               *SMALL, *overrides])
    parts = build_parts(cfg, warm_policy)
    if prepare is not None:
        prepare(parts)
    ctl = Controller(cfg, parts, tmp_path / name, total_steps=steps,
                     spool_dir=tmp_path / name / "spool" if spool else None)
    steps_seen = []
    ctl.step_observers.append(steps_seen.append)
    summary = asyncio.run(ctl.run())
    assert summary["rl_steps"] == steps
    records = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    return ctl, [r for r in records if r["kind"] == "train"], steps_seen


def gen_tokens(sample) -> int:
    return len(sample.completion_ids) if sample.completion_mask is None else sum(sample.completion_mask)


# ---------------------------------------------------------------- rollout metrics


class SlowUpdate(Delegate):
    """The real trainer whose optimizer update takes `delay_s` longer (timing the test controls)."""

    def __init__(self, inner, delay_s: float):
        super().__init__(inner)
        self.delay_s = delay_s

    @property
    def version(self):
        return self.inner.version

    def finish(self, advance_version: bool = True):
        time.sleep(self.delay_s)
        return self.inner.finish(advance_version)


def overlong_by_hand(length: int, l_max: int = 8, l_cache: int = 6, penalty: float = 0.5) -> float:
    """DAPO's soft overlong punishment (Yu et al. 2025, arXiv:2503.14476, eq. 13), written out."""
    if length <= l_max - l_cache:
        return 0.0
    if length <= l_max:
        return -penalty * (length - (l_max - l_cache)) / l_cache
    return -penalty


def test_trajectory_age_worker_tokens_and_overlong_shaping_in_a_run(tmp_path, warm_policy, monkeypatch):
    # lookahead 0: a step's groups are generated after the previous refit, and every group is
    # selected before the step's (slowed) update. Measured after training, every age would
    # exceed the update's delay; measured at selection, none comes near it
    delay = 2.0

    def prepare(parts):
        parts.trainer = SlowUpdate(parts.trainer, delay)

    # reward shaping in the same run: the overlong penalty (L_max = generation.max_tokens = 8,
    # L_cache 6: every completion longer than 2 tokens pays) and overlong filtering
    ctl, recs, steps = run_loop(tmp_path, warm_policy, monkeypatch, "async_rl.sampler.max_lookahead_versions=0",
                                "reward_shaping.overlong_penalty.enabled=true",
                                "reward_shaping.overlong_penalty.buffer_tokens=6",
                                "reward_shaping.overlong_penalty.penalty=0.5", "reward_shaping.overlong_filtering=true",
                                prepare=prepare, name="age")
    penalised = 0
    for rec, step in zip(recs, steps, strict=True):
        for s in (s for t in step.trained for s in t.group.samples):
            pen = overlong_by_hand(len(s.completion_ids))
            penalised += pen < 0
            assert s.reward == pytest.approx(s.info["unshaped_reward"] + pen, abs=1e-12)
            assert s.rewards["overlong_penalty"] == pytest.approx(pen, abs=1e-12)
            assert s.env_mask == s.truncated == bool(s.info.get("overlong_filtered"))  # truncated: out of the loss
        assert rec["shaping/reward_shaped_mean"] == pytest.approx(rec["train/reward_mean"])
        assert rec["timing/step_s"] > delay
        assert 0.0 <= rec["staleness/age_s_mean"] <= rec["staleness/age_s_max"] < delay / 2
        ages = [t.slot.selected_at - t.slot.ready_at for t in step.trained]
        assert rec["staleness/age_s_max"] == pytest.approx(max(ages))
        # every generated token of the step's trained samples, all from the one in-process engine
        workers = {k: v for k, v in rec.items() if k.startswith("rollout/worker_gen_tokens/")}
        samples = [s for t in step.trained for s in t.group.samples]
        assert workers == {"rollout/worker_gen_tokens/native": float(sum(gen_tokens(s) for s in samples))}
        assert len(samples) == P * N and workers["rollout/worker_gen_tokens/native"] > 0
    assert penalised > 0


# ---------------------------------------------------------------- env-flagged masking


class FlaggingAddition(AdditionEnv):
    """Addition that flags (EnvResult.mask) every sample of prompts with an even first operand."""

    def score_completion(self, example, completion) -> EnvResult:
        out = super().score_completion(example, completion)
        flag = int(example["a"]) % 2 == 0
        return EnvResult(out.reward, out.rewards, mask=flag, info={**out.info, "flagged": flag})


@pytest.mark.parametrize("knob", [True, False])
def test_env_flagged_samples_leave_the_loss_only_with_the_knob_on(tmp_path, warm_policy, monkeypatch, knob):
    def prepare(parts):
        parts.env = FlaggingAddition(parts.env.config, parts.tokenizer)

    ctl, recs, steps = run_loop(tmp_path, warm_policy, monkeypatch, f"env.mask_flagged_samples={str(knob).lower()}",
                                prepare=prepare, name=f"mask_{knob}")
    flagged_seen = 0
    for rec, step in zip(recs, steps, strict=True):
        samples = [s for t in step.trained for s in t.group.samples]
        flagged = [s.info["flagged"] for s in samples]
        flagged_seen += sum(flagged)
        assert [s.env_mask for s in samples] == [f and knob for f in flagged]
        trained = sum(gen_tokens(s) for s, f in zip(samples, flagged) if not (f and knob))
        assert rec["train/num_tokens"] == trained  # the trainer's count of tokens in the loss
        if knob:  # flagged samples are out of the loss: their tokens are not in the count
            assert rec["train/num_tokens"] < sum(gen_tokens(s) for s in samples) or not any(flagged)
    assert 0 < flagged_seen < 2 * P * N  # both kinds of sample were trained


# ---------------------------------------------------------------- multi-turn chat observations


class ChatChain(ChainAdditionEnv):
    """Chained addition through the chat template: the observation is text, templated by BaseEnv."""

    use_chat_template = True


def test_multi_turn_chat_observations_are_templated_as_user_turns(tmp_path, warm_policy, monkeypatch):
    built = {}

    def prepare(parts):
        env = built["env"] = ChatChain(parts.env.config, parts.tokenizer)
        parts.env = env
        tok = parts.tokenizer
        parts.stop_token_ids = tuple(dict.fromkeys((*env.end_token_ids, tok.eos_token_id)))

    ctl, recs, steps = run_loop(tmp_path, warm_policy, monkeypatch, "env.type=chain_addition",
                                "generation.max_tokens=5", prepare=prepare, name="chat_mt")
    env = built["env"]
    tok = env.tokenizer
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    two_turn = 0
    for step in steps:
        for t in step.trained:
            ex = t.group.example
            for s in t.group.samples:
                assert tok.decode(s.prompt_ids).startswith("<|im_start|>user\n") and \
                    tok.decode(s.prompt_ids).endswith("<|im_end|>\n<|im_start|>assistant\n")
                mask = s.completion_mask
                starts = s.info["turn_starts"]
                if len(starts) < 2:
                    assert all(mask)
                    continue
                two_turn += 1
                obs = [i for i, m in zip(s.completion_ids, mask) if m == 0]
                first = s.completion_ids[:starts[1] - len(obs)]
                assert first[-1] in env.end_token_ids  # a turn that stopped on an end token continues
                c = int(tok.decode(obs).split("+", 1)[1][:2])
                # ChatML, written out: the end token the policy generated closes its turn already
                text = f"\n<|im_start|>user\n+{c:02d}=<|im_end|>\n<|im_start|>assistant\n"
                assert obs == tok.encode(text, add_special_tokens=False)
                assert obs.count(im_end) == 1 and s.gen_logprobs[starts[1] - 1] == 0.0
                assert c == third_operand(ex)
    assert two_turn > 0, "no episode reached its second turn"


# ---------------------------------------------------------------- validation pass@k


def brute_pass_at_k(row: list[bool], k: int) -> Fraction:
    """The share of the k-subsets of the n samples holding a correct one (enumerated)."""
    subsets = list(itertools.combinations(row, k))
    return Fraction(sum(any(s) for s in subsets), len(subsets))


class RecordingEnv(Delegate):
    """The real environment, recording the correctness of every validation sample it scores."""

    def __init__(self, inner, val_examples):
        super().__init__(inner)
        self.val_ids = {id(ex): i for i, ex in enumerate(val_examples)}
        self.correct: dict[int, list[bool]] = {}

    def score(self, example, completion_ids, completion_text, finish_reason):
        out = self.inner.score(example, completion_ids, completion_text, finish_reason)
        i = self.val_ids.get(id(example))
        if i is not None:
            self.correct.setdefault(i, []).append(bool(out.info.get("correct", out.reward > 0)))
        return out


def test_validation_pass_at_k_against_brute_force(tmp_path, warm_policy, monkeypatch):
    n, prompts = 4, 24
    built = {}

    def prepare(parts):
        parts.env = built["env"] = RecordingEnv(parts.env, parts.val_examples)

    ctl, recs, steps = run_loop(tmp_path, warm_policy, monkeypatch, "validation.val_at_start=true",
                                f"validation.max_val_samples={prompts}",
                                f"validation.num_val_generations_per_prompt={n}", "validation.sampling.greedy=false",
                                "validation.sampling.temperature=1.0", steps=1, prepare=prepare, name="passk")
    rows = built["env"].correct
    assert sorted(rows) == list(range(prompts)) and all(len(r) == n for r in rows.values())
    val = ctl.validations[0]
    assert val["label"] == "start" and val["weight_version"] == 0
    for k in range(1, n + 1):
        want = sum(brute_pass_at_k(r, k) for r in rows.values()) / prompts
        assert val["pass_at_k"][str(k)] == pytest.approx(float(want), abs=1e-12), k
    assert val["pass_at_k"]["1"] == pytest.approx(val["accuracy"])
    assert val[f"pass@{n}"] == pytest.approx(val["pass_at_k"][str(n)])
    # a prompt with some but not all samples correct makes 1 < k < n differ from both ends
    assert any(0 < sum(r) < n for r in rows.values()), "no prompt with mixed samples: pass@k for 1<k<n untested"


# ---------------------------------------------------------------- PPO critic: samplers and drop budgets


class FailingGroups(Delegate):
    """The real backend, except that the training requests of the chosen dispatch indices raise a
    data error (the environment or the prompt is at fault) on every attempt."""

    def __init__(self, inner, failing: set[int]):
        super().__init__(inner)
        self.failing = failing
        self.failed: set[int] = set()

    async def generate(self, request):
        m = TRAINING_REQUEST.match(request.request_id)
        if m is not None and int(m.group(1)) in self.failing:
            self.failed.add(int(m.group(1)))
            raise ValueError(f"injected: bad input in {request.request_id}")
        return await self.inner.generate(request)


@pytest.mark.parametrize("sampler", ["in_order", "windowed"])
def test_ppo_critic_with_a_dropped_group_under_each_sampler(tmp_path, warm_policy, monkeypatch, sampler):
    built = {}

    def prepare(parts):
        parts.backend = built["backend"] = FailingGroups(parts.backend, {1})

    knobs = ["critic.enabled=true", "advantage.estimator=gae", "grpo.ppo_epochs=2",
             "async_rl.failure.max_dropped_groups=1", "async_rl.failure.on_dropped_group=shrink"]
    if sampler == "windowed":
        knobs += ["async_rl.sampler.type=windowed", "async_rl.sampler.max_staleness_versions=1"]
    ctl, recs, steps = run_loop(tmp_path, warm_policy, monkeypatch, *knobs, prepare=prepare, name=f"critic_{sampler}")
    assert built["backend"].failed == {1}
    assert recs[-1]["rollout/dropped_groups"] == 1.0
    groups = [len(s.trained) for s in steps]
    if sampler == "in_order":  # dispatch 1 was stamped for step 0: that step shrinks (floor ceil(0.75 * 4) = 3)
        assert groups == [P - 1, P]
    else:  # unstamped: demand-driven dispatch replaces the dropped group
        assert groups == [P, P]
        assert all(t.staleness <= 1 for s in steps for t in s.trained)
    assert not any(t.slot.dispatch_index == 1 for s in steps for t in s.trained)
    # two PPO epochs: two optimizer steps of the policy and of the critic per RL step
    assert ctl.p.trainer.optimizer_steps == 4 and ctl.p.critic.optimizer_steps == 4
    for r in recs:
        assert r["train/optimizer_steps_in_rl_step"] == 2.0
        assert math.isfinite(r["critic/value_loss"])
        # zero only where the zero-initialised head already predicts every return (an all-wrong step)
        assert r["critic/grad_norm"] > 0 or r["critic/value_abs_error"] == 0
        assert r["train/num_groups"] in (P - 1, P)
    assert any(r["critic/grad_norm"] > 0 for r in recs)


# ---------------------------------------------------------------- FLOPs / MFU with PPO mini-steps


class TimedLogprobs(Delegate):
    """The real trainer; records how long each forward-only logprob pass took, seen from outside."""

    def __init__(self, inner):
        super().__init__(inner)
        self.pass_s: list[float] = []

    @property
    def version(self):
        return self.inner.version

    def logprobs(self, chunk, reference: bool = False):
        t0 = time.perf_counter()
        try:
            return self.inner.logprobs(chunk, reference)
        finally:
            self.pass_s.append(time.perf_counter() - t0)


def test_flops_and_mfu_count_every_ppo_mini_step_once_per_rl_step(tmp_path, warm_policy, monkeypatch):
    peak = 1e12  # a known peak on the CPU (the table has none): MFU = FLOP/s / peak
    monkeypatch.setattr(torch_trainer, "peak_flops_per_s", lambda name=None: peak)
    built = {}

    def prepare(parts):
        parts.trainer = built["trainer"] = TimedLogprobs(parts.trainer)

    ctl, recs, steps = run_loop(tmp_path, warm_policy, monkeypatch, "grpo.ppo_epochs=2", "grpo.num_minibatches=2",
                                prepare=prepare, name="flops")
    model = built["trainer"].inner.model
    c = model.config
    # N: every parameter but the untied input embedding (a lookup); L layers; d_attn = heads x head dim
    emb = model.get_input_embeddings().weight
    tied = model.get_output_embeddings().weight is emb
    n_params = sum(p.numel() for p in model.parameters()) - (0 if tied else emb.numel())
    d_attn = c.num_attention_heads * (c.hidden_size // c.num_attention_heads)
    passes = built["trainer"].pass_s
    assert len(passes) == len(steps)  # one previous-policy pass per RL step, no reference pass
    for rec, step, pass_s in zip(recs, steps, passes, strict=True):
        lengths = [len(s.prompt_ids) + len(s.completion_ids) for t in step.trained for s in t.group.samples]
        one_pass = sum(6 * n_params * t + 12 * c.num_hidden_layers * d_attn * t * t for t in lengths)
        # 2 epochs x 2 minibatches: every sample trained twice; the previous-policy forward once (a third)
        assert rec["flops/train"] == pytest.approx(2 * one_pass, rel=1e-9)
        assert rec["flops/forward_only"] == pytest.approx(one_pass / 3, rel=1e-9)
        assert rec["flops/total"] == pytest.approx(rec["flops/train"] + rec["flops/forward_only"], rel=1e-12)
        assert rec["train/optimizer_steps_in_rl_step"] == 4.0
        # seconds: the four mini-steps' compute (train/compute_s is their mean) plus the forward pass
        seconds = rec["flops/total"] / rec["flops/per_s"]
        train_s = 4 * rec["train/compute_s"]
        assert 0.5 * pass_s < seconds - train_s <= pass_s + 1e-6
        assert rec["perf/mfu"] == pytest.approx(rec["flops/total"] / seconds / peak, rel=1e-9)


# ---------------------------------------------------------------- the reference-policy gate


@pytest.mark.parametrize("gate", [True, False])
def test_needs_reference_logprobs_is_the_gate_of_the_kept_reference(tmp_path, warm_policy, monkeypatch, gate):
    # the recipe says the opposite of the gate: the trainer follows the gate
    monkeypatch.chdir(ROOT)
    cfg = load_recipe(RECIPE, [f"output_dir={tmp_path}", *SMALL, f"loss.kl_coef={0.0 if gate else 0.01}"])
    assert train_pump.needs_reference_logprobs(cfg) is not gate
    calls = []

    def patched(c):
        calls.append(c)
        return gate

    monkeypatch.setattr(train_pump, "needs_reference_logprobs", patched)
    parts = build_parts(cfg, warm_policy)  # the backend is built, not started: nothing to shut down
    assert calls == [cfg]
    assert (parts.trainer.reference is not None) is gate
    assert (parts.trainer.reference_dir is not None) is gate
