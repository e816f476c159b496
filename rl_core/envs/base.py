"""Environments: the base classes the built-in environments extend.

Owns: `BaseEnv`, the `Environment` protocol (`rl_core.protocols`) around two hooks a subclass
fills in, `prompt_text(example)` and `score_completion(example, completion)`, with the guards
in its public methods: `prompt_ids` (raw text, or the chat template with the assistant turn
opened), `prompt_ids_many` / `start_prompt_ids_many` (a batch in one encode, cached texts
looked up, the Rust encode on its own thread), `score` (finish reasons checked, aborted
samples masked, the end token stripped), `score_group` (a group in one call through the
optional `score_columns`), `reference_completion_ids` (what the warm-up trains on) and
`observe` (multi-turn observations as text or chat turns); `FinalAnswerEnv` (math, reasoning_gym).
End tokens: eos, plus `<|im_end|>` with the chat template; *ended*: "stop" with an end token last.

Does not own: the registry (`rl_core.envs`: `@register_env`, `make_env`), generation, the
dataset, or what a reward means for training. Read more: docs/environments.md.
"""

from __future__ import annotations

import functools
import operator
from abc import ABC, abstractmethod
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from rl_core.envs import make_env, register_env, registered_envs  # noqa: F401  (the registry; also importable from here)
from rl_core.columns import GroupScores
from rl_core.envs.prompt_ids_cache import PromptIdsCache
from rl_core.types import EnvResult

FINISH_REASONS = ("stop", "length", "abort")
CHAT_END_TOKEN = "<|im_end|>"


@dataclass(frozen=True)
class Completion:
    """A completion as `score_completion` sees it."""

    ids: list[int]
    text: str  # the completion text with trailing end-token strings removed
    ended: bool  # finish_reason == "stop" and the last id is an end token
    finish_reason: str


class BaseEnv(ABC):
    """A single-turn environment over a HF tokenizer; subclasses implement `score_completion`."""

    name: str = "base"
    use_chat_template: bool = False
    """Render prompts through the tokenizer's chat template (else: raw text, no special tokens)."""
    system_prompt: str | None = None
    """System message prepended to the chat (only with `use_chat_template`)."""
    reward_names: tuple[str, ...] = ()
    """Names of the reward components `score_completion` returns (aborted samples get zeros for each)."""
    max_turns: int = 1
    """Turns of a multi-turn rollout (generate -> `observe` -> generate ...); 1 = single turn."""
    runs_episodes: bool = False
    """True for environments whose episodes an agent drives (`protocols.EpisodeEnvironment`: rl_core.envs.agent)."""

    async def aclose(self) -> None:
        """Release what the environment started (servers, clients); called once at the end of a run."""

    def __init__(self, config: Any, tokenizer: Any):
        self.config = config
        self.tokenizer = tokenizer
        eos = tokenizer.eos_token_id
        if eos is None:
            raise ValueError(f"{type(self).__name__} needs a tokenizer with an eos token "
                             f"(it ends every completion)")
        end_ids = [eos]
        if self.use_chat_template:
            if not getattr(tokenizer, "chat_template", None):
                raise ValueError(f"{type(self).__name__} renders prompts with a chat template, "
                                 f"but the tokenizer has none")
            im_end = tokenizer.convert_tokens_to_ids(CHAT_END_TOKEN)
            if im_end is not None and im_end != tokenizer.unk_token_id:
                end_ids.insert(0, im_end)
        self.end_token_ids: tuple[int, ...] = tuple(end_ids)
        self._end_strings = tuple(tokenizer.convert_ids_to_tokens(i) for i in end_ids)
        self._end_suffixes = tuple(e for e in self._end_strings if e)  # for str.endswith: any of them
        if not _scores_columns(type(self)) and getattr(type(self), "score_group", None) is BaseEnv.score_group:
            # no vectorised scoring of its own: a `score` call per sample (a loop over `score` inside
            # one call measured no faster), so the rollout keeps its per-sample path
            self.score_group = None

    # ------------------------------------------------------------------ observations

    def prompt_text(self, example: dict[str, Any]) -> str:
        """The observation as text (hook; default: the example's `prompt`)."""
        if "prompt" not in example and "messages" in example:
            raise ValueError(f"environment {self.name}: this example is a chat (data.messages_key) without a "
                             f"text prompt; it needs an environment that uses the chat template")
        return str(example["prompt"])

    def messages(self, example: dict[str, Any]) -> list[dict[str, str]]:
        """The chat messages of the observation (used with `use_chat_template`; hook): the example's
        `messages` when the data has chats (`data.messages_key`), else one user turn of
        `prompt_text`; `system_prompt`, if set, goes first unless the chat starts with its own."""
        chat = example.get("messages")
        if isinstance(chat, list) and chat:
            msgs = [dict(m) for m in chat]
        else:
            msgs = [{"role": "user", "content": self.prompt_text(example)}]
        if self.system_prompt and msgs[0].get("role") != "system":
            msgs.insert(0, {"role": "system", "content": self.system_prompt})
        return msgs

    def prompt_ids(self, example: dict[str, Any]) -> list[int]:
        """Token ids of the (templated) prompt."""
        if self.use_chat_template:
            ids = self.tokenizer.apply_chat_template(self.messages(example), add_generation_prompt=True,
                                                     tokenize=True, return_dict=False)
            return [int(i) for i in ids]
        return list(self.tokenizer.encode(self.prompt_text(example), add_special_tokens=False))

    def prompt_ids_many(self, examples: list[dict[str, Any]]) -> list[list[int]] | None:
        """`[self.prompt_ids(e) for e in examples]` in one batched tokenizer call, or None where
        that cannot be guaranteed (then each group encodes its own prompt): for the rollout pump,
        which draws a step's prompts at once. Applies where the class keeps this `prompt_ids`
        (raw text, no chat template) and the tokenizer is an unmodified transformers tokenizer
        over a Rust `tokenizers.Tokenizer` (`_plain_encode_class`): its `encode(text)` is
        `_encode_plus` of the one text, `tokenizer(texts)` is `_encode_plus` of the list, the same
        Rust `encode_batch` per text with the same settings; one Python call per batch instead of
        one per prompt (docs/controller.md, "What we learned"). A text encoded before (by
        this environment, with the same tokenizer) is looked up instead (`PromptIdsCache`:
        bounded, its memory documented there). An error of `prompt_text`
        or the tokenizer propagates (the pump then lets each group encode, and fail, on its own)."""
        if not self._batch_encodes():
            return None
        texts = [self.prompt_text(e) for e in examples]
        if not texts:
            return []
        return self._ids_cache().encode_many(self.tokenizer, texts, self._encode_texts)

    def start_prompt_ids_many(self, examples: list[dict[str, Any]]) -> Callable[[], list[list[int]] | None]:
        """`prompt_ids_many(examples)` begun now and ended by the function returned, which gives
        what `prompt_ids_many` gives (or raises what it raises): for the rollout pump, which
        draws a batch, dispatches its groups and asks for the ids when the first group starts.
        Where the class keeps BaseEnv's `prompt_ids_many` and the texts the cache does not hold
        go to the Rust backend (`backend_prompt_ids`), their encode (`_encode_texts`) runs on the
        encode thread (`_ENCODE_POOL`, one thread: the Rust call releases the interpreter lock,
        so the event loop goes on meanwhile) and the function waits for it; the texts, the
        cache and every other encode run here and now."""
        if type(self).prompt_ids_many is not BaseEnv.prompt_ids_many:
            ids = self.prompt_ids_many(examples)  # a subclass's own batch encode: as it is, now
            return lambda: ids
        if not self._batch_encodes():
            return lambda: None
        texts = [self.prompt_text(e) for e in examples]
        cache = self._ids_cache()
        pending = cache.start(self.tokenizer, texts)
        missing = pending.missing
        if not missing or not _backend_ready(self.tokenizer, missing):
            ids = cache.finish(pending, self._encode_texts(missing) if missing else [])
            return lambda: ids
        job = _ENCODE_POOL.submit(self._encode_texts, missing)  # `backend_prompt_ids` applies: the Rust call

        def result() -> list[list[int]]:
            return cache.finish(pending, job.result())

        return result

    def _batch_encodes(self) -> bool:
        """Whether a batch encode gives each example's `prompt_ids` (`prompt_ids_many`)."""
        return not (self.use_chat_template or type(self).prompt_ids is not BaseEnv.prompt_ids
                    or not _plain_encode_class(type(self.tokenizer)))

    def _ids_cache(self) -> PromptIdsCache:
        cache = self.__dict__.get("_prompt_ids_cache")
        if cache is None:
            cache = self._prompt_ids_cache = PromptIdsCache()
        return cache

    def _encode_texts(self, texts: list[str]) -> list[list[int]]:
        """The texts' ids in one call of the tokenizer (`prompt_ids_many`'s encode): the Rust
        backend's `encode_batch_fast` where that gives exactly what transformers' call gives
        (`backend_prompt_ids`), else transformers' call."""
        ids = backend_prompt_ids(self.tokenizer, texts)
        if ids is not None:
            return ids
        return self.tokenizer(texts, add_special_tokens=False, return_attention_mask=False,
                              return_token_type_ids=False)["input_ids"]

    def stop_strings(self) -> tuple[str, ...]:
        """Strings that end a completion besides the end token (none by default)."""
        return ()

    def reference_text(self, example: dict[str, Any]) -> str:
        """The ideal completion text without the end token (hook; default: the example's `answer`)."""
        return str(example["answer"])

    def reference_completion_ids(self, example: dict[str, Any]) -> list[int]:
        """The ideal completion as token ids: reference text, then the end token."""
        text_ids = self.tokenizer.encode(self.reference_text(example), add_special_tokens=False)
        return list(text_ids) + [self.end_token_ids[0]]

    def observation_text(self, example: dict[str, Any], turn: int, completion: "Completion") -> str | None:
        """Multi-turn hook: the environment's answer to turn `turn`'s completion as text (a user
        message under `use_chat_template`); None ends the episode (the default: single turn)."""
        return None

    def observe(self, example: dict[str, Any], turn: int, completion: "Completion") -> list[int] | None:
        """Token ids of the observation that follows turn `turn`'s completion (fed to the policy as
        they are, masked out of the loss); None ends the episode. The default templates
        `observation_text`: raw text without special tokens, or a chat user turn
        (`chat_turn_ids`) when the environment uses the chat template. An environment may
        override it to produce tokens itself."""
        text = self.observation_text(example, turn, completion)
        if text is None:
            return None
        if self.use_chat_template:
            return self.chat_turn_ids(text, completion)
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    _PROBE = "\x00rl_core-probe\x00"

    def chat_turn_ids(self, text: str, completion: "Completion") -> list[int]:
        """Tokens between an assistant turn the policy generated and the next one, as the
        tokenizer's chat template writes them: what closes the assistant turn (the template's
        end-of-turn text, less the end token when the completion ended on one: a completion cut
        by a stop string gets it here), then `text` as a user message, then the opened
        assistant turn. Found by
        rendering a probe conversation with and without the user message (the template is the
        only source of the format: ChatML, Llama, ... alike)."""
        tok = self.tokenizer
        probe = [{"role": "user", "content": "?"}, {"role": "assistant", "content": self._PROBE}]
        before = tok.apply_chat_template(probe, tokenize=False)
        after = tok.apply_chat_template(probe + [{"role": "user", "content": text}], tokenize=False,
                                        add_generation_prompt=True)
        cut = before.find(self._PROBE)
        if cut < 0 or not after.startswith(before[:cut + len(self._PROBE)]):
            raise ValueError(f"environment {self.name}: the tokenizer's chat template does not render an assistant "
                             "turn as a prefix of the conversation that follows it, so an observation cannot be "
                             "templated as a user turn; override `observe` to build its tokens")
        cut += len(self._PROBE)
        if completion.ended:  # the policy generated the turn's end token already: the template's is not repeated
            end = next((e for e in self._end_strings if e and after.startswith(e, cut)), "")
            cut += len(end)
        return list(tok.encode(after[cut:], add_special_tokens=False))

    # ------------------------------------------------------------------ scoring

    def score_turns(self, example: dict[str, Any], turns: list["Completion"]) -> EnvResult:
        """Rewards of a multi-turn episode (hook; default: score the last turn alone)."""
        last = turns[-1]
        return self.score(example, last.ids, last.text, last.finish_reason)

    def score(self, example: dict[str, Any], completion_ids: list[int], completion_text: str,
              finish_reason: str) -> EnvResult:
        """Reward(s) of one completion; an aborted sample scores 0 and is masked out of the loss."""
        if finish_reason not in FINISH_REASONS:
            raise ValueError(f"finish_reason must be one of {FINISH_REASONS}, got {finish_reason!r}")
        if finish_reason == "abort":
            return EnvResult(reward=0.0, rewards={k: 0.0 for k in self.reward_names}, mask=True,
                             info={"aborted": True})
        result = self.score_completion(example, self.parse_completion(completion_ids, completion_text, finish_reason))
        if isinstance(result, EnvResult) and list(result.rewards) != self._names_seen:
            self._check_reward_names(result)
        return result

    _names_seen: list[str] | None = None  # the components of the last result checked
    _names_first: list[str] | None = None  # without reward_names: the first result's components

    def _check_reward_names(self, result: EnvResult) -> None:
        """The result's components are the class's `reward_names` (any order), or without them
        the same on every sample (the first result's); a ValueError naming both otherwise."""
        names = sorted(result.rewards)
        expected = sorted(self.reward_names) if self.reward_names else self._names_first
        if expected is None:
            self._names_first = names
        elif names != expected:
            said = f"{type(self).__name__}.reward_names says" if self.reward_names else "an earlier sample returned"
            raise ValueError(f"environment {self.name}: score_completion returned reward components {names}; {said} "
                             f"{expected}. Fix: return exactly the components the class declares in reward_names, "
                             "the same on every sample.")
        self._names_seen = list(result.rewards)

    def parse_completion(self, completion_ids: list[int], completion_text: str, finish_reason: str) -> Completion:
        """Strip trailing end-token strings from the text and decide whether the sample ended."""
        # a backend may hand the ids over as a NumPy array (`columns.token_array`): the same ints
        ids = completion_ids.tolist() if isinstance(completion_ids, np.ndarray) else [int(i) for i in completion_ids]
        ended = finish_reason == "stop" and bool(ids) and ids[-1] in self.end_token_ids
        return Completion(ids=ids, text=self._strip_end_strings(completion_text), ended=ended,
                          finish_reason=finish_reason)

    def _strip_end_strings(self, text: str) -> str:
        """`text` without trailing end-token strings (repeatedly, in any order)."""
        if not (self._end_suffixes and text.endswith(self._end_suffixes)):
            return text  # the usual case: the decoder skipped the special tokens
        stripped = True
        while stripped:
            stripped = False
            for end in self._end_suffixes:
                if text.endswith(end):
                    text, stripped = text[: -len(end)], True
        return text

    # ------------------------------------------------------------------ group scoring

    score_columns = None
    """Hook for the group scoring (`score_group`), None where the environment has none:
    `score_columns(example, texts, ended, finish_reasons) -> columns.GroupScores`, the scores of a
    group's N stopped or truncated completions (texts with the end-token strings removed, and
    whether each ended, as `parse_completion` gives them) exactly as `score_completion` gives
    each, as columns: what a subclass vectorises (an answer parsed or checked once per
    distinct completion, the example's target once per group)."""

    def score_group(self, example: dict[str, Any], completion_ids: list, completion_texts: list[str],
                    finish_reasons: list[str]) -> GroupScores:
        """The scores of one single-turn group (`protocols.GroupScoringEnvironment`): exactly
        what `score` gives each sample, as columns. Through the class's `score_columns` where it
        is the class's own (defined with or below its `score_completion` and `parse_completion`:
        a subclass that overrides either is never bypassed); else, and for a group with an
        aborted sample (whose info differs from the others'), a `score` call per sample. Rollout
        uses it only where `score_columns` applies (`group_scoring`: `__init__` turns it off
        otherwise)."""
        if not _FINISH_SET.issuperset(finish_reasons):
            bad = next(f for f in finish_reasons if f not in _FINISH_SET)
            raise ValueError(f"finish_reason must be one of {FINISH_REASONS}, got {bad!r}")
        if "abort" in finish_reasons or not _scores_columns(type(self)):
            return GroupScores.of_results([self.score(example, c, t, f)
                                           for c, t, f in zip(completion_ids, completion_texts, finish_reasons)])
        ends, strip = self.end_token_ids, self._strip_end_strings
        # `parse_completion`'s `ended` without a list per completion: the last id read once
        ended = [f == "stop" and len(c) > 0 and int(c[-1]) in ends for c, f in zip(completion_ids, finish_reasons)]
        sfx = self._end_suffixes  # the usual group has no end-token string left: one C-level test per text
        ends_on_one = bool(sfx) and any(map(operator.methodcaller("endswith", sfx), completion_texts))
        texts = list(map(strip, completion_texts)) if ends_on_one else list(completion_texts)
        return self.score_columns(example, texts, ended, finish_reasons)

    @abstractmethod
    def score_completion(self, example: dict[str, Any], completion: Completion) -> EnvResult:
        """Rewards of a stopped or truncated completion (hook). Its `info["correct"]` says whether
        the sample is right (what accuracy counts); without it reward > 0 counts, so set it
        where the reward has a shaping term (a format bonus, partial credit)."""


class FinalAnswerEnv(BaseEnv):
    """A single-turn environment scored on the final answer it reads from each completion, with
    reward components `correct` and `format` (`MathEnv`, `ReasoningGymEnv`). Its config section
    chooses `use_chat_template`, `system_prompt`, where the answer is (`answer_format`), the
    `instruction` added to each prompt and the `format_reward`."""

    reward_names = ("correct", "format")

    def __init__(self, config: Any, tokenizer: Any):
        self.use_chat_template = bool(config.use_chat_template)
        self.system_prompt = config.system_prompt
        super().__init__(config, tokenizer)
        self.answer_format = config.answer_format
        self.instruction = config.instruction
        self.format_reward = float(config.format_reward)


_FINISH_SET = frozenset(FINISH_REASONS)


@functools.lru_cache(maxsize=64)
def _plain_encode_class(cls: type) -> bool:
    """Whether `cls(texts)` and `cls.encode(text)` are transformers' own over the Rust-backed
    `_encode_plus` (no subclass overrides `__call__`, `encode`, `_encode_plus` or
    `_convert_encoding`, and none switches input modes, which only `__call__` does): then a
    batch's ids are each text's `encode` ids (`BaseEnv.prompt_ids_many`)."""
    try:
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:  # another transformers layout: one encode per prompt, as always
        return False
    mro = cls.__mro__
    if TokenizersBackend not in mro:
        return False
    below = mro[:mro.index(TokenizersBackend)]  # the subclasses between `cls` and transformers' class
    return (cls.__call__ is PreTrainedTokenizerBase.__call__ and cls.encode is PreTrainedTokenizerBase.encode
            and not any(name in vars(c) for c in below for name in ("_encode_plus", "_convert_encoding"))
            and not hasattr(cls, "_switch_to_input_mode"))


def backend_prompt_ids(tokenizer, texts: list[str]) -> list[list[int]] | None:
    """The ids `tokenizer(texts, add_special_tokens=False)["input_ids"]` gives (a tokenizer
    of a class `_plain_encode_class` accepts), from one `encode_batch_fast` of its Rust
    backend (the ids of `encode_batch`, without the character offsets, which transformers'
    call computes and this encode never reads: faster, docs/benchmarks.md); None where that is not guaranteed: a
    backend without `encode_batch_fast`, an empty batch, a backend with truncation or padding
    set or special-token splitting other than the tokenizer's (transformers' call would change
    them first), a text that is not a `str`, or an id list longer than `model_max_length`
    (transformers' call logs its warning about it)."""
    if not _backend_ready(tokenizer, texts):
        return None
    ids = [e.ids for e in tokenizer.backend_tokenizer.encode_batch_fast(texts, add_special_tokens=False)]
    limit = getattr(tokenizer, "model_max_length", None)
    if ids and isinstance(limit, int) and max(map(len, ids)) > limit:
        return None
    return ids


def _backend_ready(tokenizer, texts: list[str]) -> bool:
    """`backend_prompt_ids`'s test before it encodes: a backend with `encode_batch_fast`, no
    truncation or padding set, the tokenizer's special-token splitting, a non-empty batch of
    `str`s."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return (getattr(backend, "encode_batch_fast", None) is not None and bool(texts)
            and backend.truncation is None and backend.padding is None
            and backend.encode_special_tokens == getattr(tokenizer, "split_special_tokens", False)
            and list(map(type, texts)).count(str) == len(texts))


# The batch encode of a drawn batch's prompts (`BaseEnv.start_prompt_ids_many`): one thread, so
# batches are encoded in the order drawn and their caches are only filled on the loop.
_ENCODE_POOL = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rl_core-encode")


@functools.lru_cache(maxsize=64)
def _scores_columns(cls: type) -> bool:
    """Whether `cls` has a `score_columns` of its own: defined (not None) in the class that
    defines its `score_completion` and `parse_completion`, or below both in the MRO."""
    mro = cls.__mro__

    def owner(name: str) -> int:
        return next(i for i, c in enumerate(mro) if name in vars(c))

    if getattr(cls, "score_columns", None) is None:
        return False
    return owner("score_columns") <= min(owner("score_completion"), owner("parse_completion"))


def distinct_scored(texts: list[str], ended: list[bool], score, width: int) -> list[list]:
    """`score(text, ended)` (a tuple of `width` fields) called once per distinct (text, ended)
    pair of a group, in order of first appearance, and its fields as `width` columns in sample
    order: for a `score_columns` whose per-completion score is a function of those two alone
    (a group's samples often give the same answer)."""
    memo: dict = {}
    rows = []
    for key in zip(texts, ended):
        row = memo.get(key)
        if row is None:
            row = memo[key] = score(*key)
        rows.append(row)
    return [list(c) for c in zip(*rows)] if rows else [[] for _ in range(width)]
