"""The fake parts of `bench/controller_scale.py` (its module doc says how they are used).

Owns: `FakeCalls` (the fakes' own work, counted in a run and calibrated after it, so that it
can be taken out of the controller's time), `InstantBackend` (generation answered at once, as
lists or arrays, by group, many or per-sample calls), `TimedEnv` (`FakeEnv` with its work
counted and an optional group scoring), the `--env addition` parts (`AdditionBackend`,
`PrecomputedDecode`, `LoopDecode`, `addition_parts`, `env_scoring_cost`) and `SilentTokenizer`.
Does not own: the controller runs, the timing and the report (`controller_scale.py`).
"""

from __future__ import annotations

import gc
import time
from pathlib import Path

import numpy as np

from tests.helpers.fakes import FakeBackend, FakeEnv, FakeTrainer, make_parts
from rl_core.types import GenerationResult
from rl_core.columns import GroupResults, GroupScores, row_views

ROOT = Path(__file__).resolve().parents[1]
N = 16  # samples per group


class FakeCalls:
    """How often the fakes did their own work (a result built, a completion scored) and what
    one such piece of work costs, so that it can be taken out of the process CPU time. The
    cost is calibrated after the run, in a loop of the same calls (garbage collector off):
    timing each call in the run would need a per-thread CPU clock (a system call of a few
    microseconds here, as much as the work itself), and a wall clock would charge the
    fakes with the time the process was preempted. The loop's warm caches make the
    calibrated cost a lower bound: what is taken out is at most the fakes' real cost."""

    def __init__(self):
        self.answers = 0
        self.scores = 0  # per-sample `score` calls
        self.group_scores = 0  # `score_group` calls
        self.decodes = 0  # `PrecomputedDecode.decode` calls (--env addition)
        self.answer_s = 0.0
        self.score_s = 0.0
        self.group_score_s = 0.0
        self.decode_s = 0.0

    def counts(self) -> tuple[int, int, int, int]:
        return self.answers, self.scores, self.group_scores, self.decodes

    def spent_between(self, a: tuple[int, ...], b: tuple[int, ...]) -> float:
        """The fakes' cost of the work counted between two `counts()`."""
        return ((b[0] - a[0]) * self.answer_s + (b[1] - a[1]) * self.score_s + (b[2] - a[2]) * self.group_score_s
                + (b[3] - a[3]) * self.decode_s)

    def calibrate_addition(self, backend: "AdditionBackend", tok: "PrecomputedDecode", n: int = 20_000) -> None:
        """The fakes' costs of the --env addition run: a group's answer and a decode (the
        environment is real: its scoring is the run's, not taken out)."""
        prompts = list(backend.answers)[:64]
        seeds = list(range(N))
        groups = [backend.answer_group(p, seeds) for p in prompts]
        gc.collect()
        gc.disable()
        try:
            t0 = time.process_time()
            for i in range(n // N):
                backend.answer_group(prompts[i & 63], seeds)
            self.answer_s = (time.process_time() - t0) / (n // N * N)
            t0 = time.process_time()
            for i in range(n // N):
                for ids in groups[i & 63].token_ids:
                    tok.decode(ids, skip_special_tokens=True)
            self.decode_s = (time.process_time() - t0) / (n // N * N)
        finally:
            gc.enable()

    def calibrate(self, backend: "InstantBackend", env: "TimedEnv", n: int = 20_000) -> None:
        from rl_core.types import GenerationRequest, SamplingParams

        requests = [GenerationRequest(f"e0-p{i}-d{i}/a0/{i % 16}", [1, 2, 3], SamplingParams()) for i in range(64)]
        results = [backend._answer(r) for r in requests]
        examples = [{"id": i, "prompt": str(i), "answer": "x"} for i in range(64)]
        keys, seeds = [f"e0-p{i}-d{i}/a0" for i in range(64)], list(range(N))
        gc.collect()
        gc.disable()
        try:
            t0 = time.process_time()
            if backend.calls_mode == "group":  # the fake's work per sample inside its group call
                for i in range(n // N):
                    backend._answer_group(keys[i & 63], seeds)
                self.answer_s = (time.process_time() - t0) / (n // N * N)
            else:
                for i in range(n):
                    backend._answer(requests[i & 63])
                self.answer_s = (time.process_time() - t0) / n
            t0 = time.process_time()
            for i in range(n):
                r = results[i & 63]
                FakeEnv.score(env, examples[i & 63], r.token_ids, "", r.finish_reason)
            self.score_s = (time.process_time() - t0) / n
            ids = [r.token_ids for r in results[:N]]
            t0 = time.process_time()
            for i in range(n // N):
                TimedEnv.scores_of(examples[i & 63], ids)
            self.group_score_s = (time.process_time() - t0) / (n // N)
        finally:
            gc.enable()


CALLS = FakeCalls()


class InstantBackend(FakeBackend):
    """Answers every request at once with `tokens` completion tokens (no await inside).

    `arrays`: the token ids and logprobs come as read-only NumPy arrays (what the native
    backend's `generate_many` hands over); else as fresh Python lists (what the HTTP and vLLM
    backends hand over): building them is the fake's cost, turning them into tensors the
    controller's. `calls`: "group", the backend answers a whole group in one `generate_group`
    call (results as columns); "many", in one `generate_many` call (a request and a result
    per sample); "per-sample", one `generate` per sample. Each sample's answer depends only
    on its request id, so the three give the same samples."""

    def __init__(self, tokens: int, arrays: bool = False, calls: str = "group", fresh: bool = False):
        super().__init__(seed=0, max_latency_s=0.0)
        self.tokens = tokens
        self.arrays = arrays
        self.calls_mode = calls
        self.fresh = fresh  # arrays: a new array per result (the memory measure), else shared read-only ones
        if arrays:
            self._ids = [np.full(tokens - d, 5, dtype=np.int64) for d in (0, 1)]
            self._lps = [np.full(tokens - d, -0.5, dtype=np.float32) for d in (0, 1)]
            for a in self._ids + self._lps:
                a.flags.writeable = False
        else:
            self._ids = [5] * tokens
            self._lps = [-0.5] * tokens
        if calls != "group":
            self.generate_group = None  # the controller falls back to generate_many
        if calls == "per-sample":
            self.generate_many = None  # ... and to a generate call per sample

    def _answer(self, request):
        self.calls += 1
        CALLS.answers += 1
        # one token fewer for odd samples (request id f"{key}/{i}", i odd) so rewards (FakeEnv: a modulo
        # of the length) vary in a group
        d = int(request.request_id[request.request_id.rindex("/") + 1:]) & 1
        if self.arrays:
            ids, lps = self._ids[d], self._lps[d]
            if self.fresh:
                ids, lps = ids.copy(), lps.copy()
        else:
            k = self.tokens - d
            ids, lps = self._ids[:k], self._lps[:k]
        return GenerationResult(request.request_id, request.prompt_ids, ids, lps, "stop", self.version, self.version)

    def _answer_group(self, key, seeds):
        n = len(seeds)
        self.calls += n
        CALLS.answers += n
        ds = [i & 1 for i in range(n)]  # what _answer picks from each request id f"{key}/{i}"
        if self.arrays:
            ids, lps = [self._ids[d] for d in ds], [self._lps[d] for d in ds]
            if self.fresh:
                ids, lps = [a.copy() for a in ids], [a.copy() for a in lps]
        else:
            k = self.tokens
            ids, lps = [self._ids[:k - d] for d in ds], [self._lps[:k - d] for d in ds]
        v = self.version
        return GroupResults(ids, lps, ["stop"] * n, [v] * n, [v] * n)

    async def generate(self, request):
        return self._answer(request)

    async def generate_many(self, requests):
        return [self._answer(r) for r in requests]

    async def generate_group(self, key, prompt_ids, params, seeds):
        return self._answer_group(key, seeds)


class TimedEnv(FakeEnv):
    """`FakeEnv` whose calls are counted, with a group scoring (`score_group`: the same rewards,
    as columns); `group_scoring=False` turns that off (a `score` call per sample)."""

    def __init__(self, group_scoring: bool = True):
        super().__init__()
        if not group_scoring:
            self.score_group = None

    def score(self, example, completion_ids, completion_text, finish_reason):
        CALLS.scores += 1
        return super().score(example, completion_ids, completion_text, finish_reason)

    def score_group(self, example, completion_ids, completion_texts, finish_reasons):
        CALLS.group_scores += 1
        return self.scores_of(example, completion_ids)

    @staticmethod
    def scores_of(example, completion_ids) -> GroupScores:
        """What `FakeEnv.score` gives for each completion, as columns."""
        i = int(example["id"])
        rs = [float((i + len(c)) % 3 == 0) for c in completion_ids]
        return GroupScores(rs, {"r": rs}, None, {"correct": list(map(bool, rs))})


class AdditionBackend(FakeBackend):
    """--env addition: answers a group of the addition task at once (`generate_group`), with
    completions the real addition environment scores: of every 16 samples, two give the right
    answer, one a wrong last digit, one too few digits (each then the end token: 4 or 3 tokens),
    and twelve a long text (a worked sum repeated, `tokens` - i % 6 tokens: even i end on the
    end token, odd i are cut by length). The ids are the tiny tokenizer's; each completion's
    text is decoded once at start (`PrecomputedDecode` looks it up). With `arrays` the ids are
    read-only arrays made once and the logprobs a new array per group, each sample's a view of
    it (what the native backend's group call hands over: `columns.logprob_rows`)."""

    def __init__(self, tokens: int, arrays: bool, tok, examples: list[dict], env):
        super().__init__(seed=0, max_latency_s=0.0)
        self.tokens, self.arrays, self.calls_mode = tokens, arrays, "group"
        eos = tok.eos_token_id
        filler = tok.encode("so 07 + 45 = 52, reversed 250. ", add_special_tokens=False)
        filler = (filler * (tokens // len(filler) + 1))[:tokens]
        self.answers: dict[tuple, list] = {}  # prompt ids -> the group's (ids, finish reason) of its short answers
        self.examples: dict[tuple, dict] = {}  # prompt ids -> an example with that prompt
        self.texts: dict = {}  # (length, last id) of a long completion / a short one's ids -> its text
        self.long = []
        for i in range(4, N):
            k = tokens - i % 6
            ids = filler[:k - 1] + [eos] if i % 2 == 0 else filler[:k]
            self.long.append((self._ids(ids), "stop" if i % 2 == 0 else "length"))
            self.texts[(len(ids), ids[-1])] = tok.decode(ids, skip_special_tokens=True)
        for ex in examples:
            key = tuple(env.prompt_ids(ex))
            if key in self.answers:
                continue
            self.examples[key] = ex
            answer = str(ex["answer"])
            wrong = answer[:-1] + str((int(answer[-1]) + 1) % 10)
            short = []
            for text in (answer, answer, wrong, answer[:-1]):
                ids = tok.encode(text, add_special_tokens=False) + [eos]
                self.texts[tuple(ids)] = tok.decode(ids, skip_special_tokens=True)
                short.append((self._ids(ids), "stop"))
            self.answers[key] = short

    def _ids(self, ids: list[int]):
        if not self.arrays:
            return ids
        a = np.array(ids, dtype=np.int64)
        a.flags.writeable = False
        return a

    def answer_group(self, prompt_ids, seeds) -> GroupResults:
        n = len(seeds)
        self.calls += n
        CALLS.answers += n
        picked = (self.answers[tuple(prompt_ids)] + self.long)[:n]
        if self.arrays:
            ids = [p[0] for p in picked]
            lens = list(map(len, ids))  # one logprob array per group, a view per sample (the native group call's)
            lps = row_views(np.full(sum(lens), -0.5, dtype=np.float32), lens)
        else:
            ids = [list(p[0]) for p in picked]
            lps = [[-0.5] * len(i) for i in ids]
        v = self.version
        return GroupResults(ids, lps, [p[1] for p in picked], [v] * n, [v] * n)

    async def generate_group(self, key, prompt_ids, params, seeds):
        return self.answer_group(prompt_ids, seeds)


class PrecomputedDecode:
    """The tiny tokenizer's ids and special tokens; `decode` looks up the text decoded at start
    (counted as the fakes' work: a real decode of 256 tokens costs ~75 us here)."""

    def __init__(self, tok, texts: dict):
        self.eos_token_id, self.pad_token_id, self.texts = tok.eos_token_id, tok.pad_token_id, texts

    def decode(self, ids, skip_special_tokens=True):
        CALLS.decodes += 1
        n = len(ids)
        return self.texts[(n, int(ids[-1]))] if n > 5 else self.texts[tuple(map(int, ids))]


class LoopDecode:
    """--decode loop: the real tokenizer's `decode`, called per completion on the event loop (a
    class of its own, so `rollout.decode.group_decoder` does not apply: the path before the
    eighth round)."""

    def __init__(self, tok):
        self.tok, self.eos_token_id, self.pad_token_id = tok, tok.eos_token_id, tok.pad_token_id

    def decode(self, ids, skip_special_tokens=True):
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)


def addition_parts(cfg, tokens: int, arrays: bool, scoring: str, num_examples: int, decode: str = "looked-up"):
    """The controller's parts for --env addition: the real addition environment (recipe
    defaults) over the tiny tokenizer and the task's examples, `AdditionBackend`."""
    from rl_core.config.schema import AdditionEnvConfig
    from rl_core.data.addition import all_examples
    from rl_core.data.dataset import PromptSource, load_jsonl
    from rl_core.envs import make_env
    from rl_core.model.tokenizer import build_tokenizer

    tok = build_tokenizer(load_jsonl(str(ROOT / "data/addition/val.jsonl")), 300)
    env = make_env(AdditionEnvConfig(), tok)
    if scoring != "group":
        env.score_group = None  # a score call per sample
    pairs = all_examples()
    examples = [dict(pairs[i % len(pairs)], id=i) for i in range(num_examples)]
    backend = AdditionBackend(tokens, arrays, tok, examples, env)
    parts = make_parts(cfg, backend=backend, trainer=FakeTrainer(), num_examples=cfg.grpo.num_prompts_per_step)
    parts.env = env
    backend.looked_up = PrecomputedDecode(tok, backend.texts)  # also the calibration's
    parts.tokenizer = {"looked-up": backend.looked_up, "loop": LoopDecode(tok), "thread": tok}[decode]
    parts.stop_token_ids, parts.pad_id = (tok.eos_token_id,), tok.pad_token_id
    parts.source = PromptSource(examples, cfg.grpo.num_prompts_per_step, shuffle=True, seed=cfg.grpo.seed,
                                max_num_epochs=cfg.grpo.max_num_epochs)
    return parts


def env_scoring_cost(env, backend: "AdditionBackend", tok: "PrecomputedDecode", scoring: str, n: int = 200) -> float:
    """The addition environment's own CPU time per group (a loop of its scoring calls on the
    bench's groups: `score_group`, or `score` per sample), for the report (not taken out)."""
    prompts = list(backend.answers)[:64]
    groups = [(backend.examples[p], backend.answer_group(p, list(range(N)))) for p in prompts]
    groups = [(ex, r.token_ids, [tok.decode(i) for i in r.token_ids], r.finish_reasons) for ex, r in groups]
    gc.collect()
    gc.disable()
    try:
        t0 = time.process_time()
        for i in range(n):
            ex, ids, texts, fins = groups[i & 63]
            if scoring == "group":
                env.score_group(ex, ids, texts, fins)
            else:
                for c, t, f in zip(ids, texts, fins):
                    env.score(ex, c, t, f)
        return (time.process_time() - t0) / n
    finally:
        gc.enable()


class SilentTokenizer:
    eos_token_id = 0
    pad_token_id = 0

    def decode(self, ids, skip_special_tokens=True):
        return ""
