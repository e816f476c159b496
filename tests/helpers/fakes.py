"""Fakes for unit-testing the controller's coordination in isolation (samplers, buffer,
pumps): a generation backend with scripted latencies, an instant trainer, a trivial
environment and tokenizer. The real parts are exercised by the integration tier.

Each fake satisfies its protocol in `rl_core.protocols` (FakeEnv: Environment, FakeBackend:
GenerationBackend, FakeTrainer: TrainerBackend, FakeWeightSync: WeightSync); the test
`tests/unit/test_protocol_conformance.py` checks them member by member."""

from __future__ import annotations

import asyncio
import random

from rl_core.types import EnvResult, GenerationResult, SyncReport


class FakeTokenizer:
    eos_token_id = 0
    pad_token_id = 0

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(97 + (i % 26)) for i in ids)

    def save_pretrained(self, path):
        pass


class FakeChatTokenizer:
    """Just what `BaseEnv.__init__` reads of a chat tokenizer: an eos token, a chat template and
    `<|im_end|>` (so an environment that uses the chat template builds; end tokens (2, 0))."""

    eos_token_id = 0
    unk_token_id = 1
    chat_template = "{{ messages }}"

    def convert_tokens_to_ids(self, t):
        return 2

    def convert_ids_to_tokens(self, i):
        return {0: "<eos>", 2: "<|im_end|>"}[i]


class FakeEnv:
    """Single-turn; the reward is a fixed function of the example id and the completion length."""

    name = "fake"
    reward_names = ("r",)
    max_turns = 1
    end_token_ids = (0,)
    runs_episodes = False

    async def aclose(self):
        pass

    def prompt_ids(self, example):
        return [1, 2, int(example["id"]) % 50 + 3]

    def stop_strings(self):
        return ()

    def reference_completion_ids(self, example):
        return [5, self.end_token_ids[0]]

    def parse_completion(self, completion_ids, completion_text, finish_reason):
        from rl_core.envs.base import Completion

        ids = [int(i) for i in completion_ids]
        ended = finish_reason == "stop" and bool(ids) and ids[-1] in self.end_token_ids
        return Completion(ids=ids, text=completion_text, ended=ended, finish_reason=finish_reason)

    def observe(self, example, turn, completion):
        return None

    def score_turns(self, example, turns):
        last = turns[-1]
        return self.score(example, last.ids, last.text, last.finish_reason)

    def score(self, example, completion_ids, completion_text, finish_reason):
        r = float((int(example["id"]) + len(completion_ids)) % 3 == 0)
        return EnvResult(reward=r, rewards={"r": r}, info={"correct": bool(r)})


class FakeBackend:
    """Answers after a random latency (seeded); tracks the served version like a real engine."""

    def __init__(self, seed: int = 0, max_latency_s: float = 0.004, fail=None):
        self.rng = random.Random(seed)
        self.max_latency_s = max_latency_s
        self.version = 0
        self.fail = fail  # optional callable(request) -> Exception | None
        self.calls = 0

    @property
    def weight_version(self):
        return self.version

    async def start(self):
        pass

    async def shutdown(self):
        pass

    async def generate(self, request):
        self.calls += 1
        v0 = self.version
        await asyncio.sleep(self.rng.random() * self.max_latency_s)
        if self.fail is not None:
            err = self.fail(request)
            if err is not None:
                raise err
        n = 1 + self.rng.randrange(3)
        return GenerationResult(request.request_id, request.prompt_ids, [5] * n, [-0.5] * n, "stop", v0,
                                self.version)

    async def abort(self, request_id):
        pass

    async def update_weights(self, version, weights):
        self.version = version

    async def invalidate_kv_cache(self):
        pass

    def capacity(self):
        return 64

    def metrics(self):
        return {"running": 0.0}


class FakeTrainer:
    """Takes no real step: counts versions, optimizer steps and chunks; `fail_at` versions
    raise once in `train_microbatches`."""

    reference_dir = None

    def __init__(self, fail_at: set | None = None):
        self.version = 0
        self.optimizer_steps = 0
        self.fail_at = set(fail_at or ())
        self.chunks = 0

    def begin(self, loss):
        pass

    def train_microbatches(self, chunk):
        self.chunks += 1
        if self.version in self.fail_at:
            self.fail_at.discard(self.version)
            raise RuntimeError("injected microbatch failure")

    def finish(self, advance_version=True):
        self.optimizer_steps += 1
        if advance_version:
            self.version += 1
        return {"loss": 0.0}

    def abort(self):
        pass

    def export_weights(self, on_device=False):
        return {}

    def logprobs(self, chunk, reference=False):
        return chunk.gen_logprobs.clone()

    def state_dict(self):
        return {"version": self.version, "optimizer_steps": self.optimizer_steps, "optimizer": {}}

    def load_state_dict(self, state):
        self.version = state["version"]

    def save_pretrained(self, out_dir):
        """No model: writes the version and optimizer steps as `fake_trainer.json`."""
        import json
        from pathlib import Path

        Path(out_dir).mkdir(parents=True, exist_ok=True)
        (Path(out_dir) / "fake_trainer.json").write_text(
            json.dumps({"version": self.version, "optimizer_steps": self.optimizer_steps}))


class FakeWeightSync:
    """Hands the weights to each backend's `update_weights` and reports 0 bytes; `pushes`
    records (version, number of tensors)."""

    kind = "fake"
    sends_from_device = False

    def __init__(self):
        self.pushes: list[tuple[int, int]] = []

    async def push(self, version, weights, backends):
        self.pushes.append((version, len(weights)))
        for backend in backends:
            await backend.update_weights(version, weights)
        return SyncReport(self.kind, version, 0, 0.0)


def make_parts(cfg, backend=None, trainer=None, num_examples=64):
    from rl_core.controller.controller import Parts
    from rl_core.data.dataset import PromptSource
    from rl_core.samplers import make_sampler

    examples = [{"id": i, "prompt": str(i), "answer": "x"} for i in range(num_examples)]
    source = PromptSource(examples, cfg.grpo.num_prompts_per_step, shuffle=True, seed=cfg.grpo.seed,
                          max_num_epochs=cfg.grpo.max_num_epochs)
    return Parts(tokenizer=FakeTokenizer(), env=FakeEnv(), source=source, backend=backend or FakeBackend(),
                 trainer=trainer or FakeTrainer(), loss=None, sampler=make_sampler(cfg), val_examples=[],
                 stop_token_ids=(0,), pad_id=0)
