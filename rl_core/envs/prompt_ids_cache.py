"""The ids a tokenizer gave each prompt text, kept for the next time the text is drawn.

Owns: `PromptIdsCache`, a bounded map from a prompt text to the ids one tokenizer encoded it
to, for `BaseEnv.prompt_ids_many` (the rollout pump's batch encode: `encode_many`, or `start`
and `finish` with the encode between them on another thread). A dataset's prompts come back
every epoch, and a lookup is far cheaper than an encode. Memory: at most `max_ids` ids
(`array('q')`, 32 MiB at the default 2**22) and `max_prompts` entries, oldest first out; a
text longer than `max_ids` is never held. Exactness: it applies only while the tokenizer is
the same object with the same vocabulary size (added tokens empty it); a tokenizer changed
in place otherwise is not detected, so an environment doing that encodes per prompt.

Does not own: when a batch may be encoded at all (`BaseEnv.prompt_ids_many`), or the tokenizer.

Read more: docs/environments.md (`prompt_ids_many`), docs/benchmarks.md.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable


class PromptIdsCache:
    """text -> its ids (see the module docstring); `encode_many` is the one entry point."""

    def __init__(self, max_ids: int = 1 << 22, max_prompts: int = 1 << 17):
        self.max_ids = max_ids
        self.max_prompts = max_prompts
        self._ids: dict[str, array] = {}
        self.held_ids = 0  # token ids held in all entries
        self._tokenizer = None
        self._vocab = -1
        self.hits = self.misses = 0  # texts found / encoded so far (tests, benches)

    def encode_many(self, tokenizer, texts: list[str], encode: Callable[[list[str]], list[list[int]]]
                    ) -> list[list[int]]:
        """Each text's ids as a fresh list, in order: held texts from the cache, the others
        (each distinct one once) by one `encode(texts)` call, then held. `encode` must be the
        tokenizer's batch encode; an error of it propagates and nothing is held from that call."""
        pending = self.start(tokenizer, texts)
        return self.finish(pending, encode(pending.missing) if pending.missing else [])

    def start(self, tokenizer, texts: list[str]) -> "PendingIds":
        """`encode_many` in two parts: the texts looked up now; `missing` (each distinct text
        not held, in order of first appearance) for the caller to encode, possibly on another
        thread, and hand to `finish` on this one, which holds them and gives what `encode_many`
        gives. A text another batch held meanwhile is held once."""
        vocab = len(tokenizer)
        if tokenizer is not self._tokenizer or vocab != self._vocab:
            self._ids.clear()
            self.held_ids, self._tokenizer, self._vocab = 0, tokenizer, vocab
        found = list(map(self._ids.get, texts))
        missing = list(dict.fromkeys(t for t, a in zip(texts, found) if a is None))
        self.misses += len(missing)
        self.hits += len(texts) - len(missing)
        return PendingIds(texts, found, missing, tokenizer, vocab)

    def finish(self, pending: "PendingIds", encoded: list[list[int]]) -> list[list[int]]:
        """Each text of `pending` as a fresh list of its ids, in order (`encoded`: the ids of
        `pending.missing`, in order), the encoded texts held unless the cache was emptied for
        another tokenizer since `start`."""
        found = pending.found
        if not pending.missing:
            return [a.tolist() for a in found]
        fresh = dict(zip(pending.missing, encoded))
        out, given = [], set()
        for t, a in zip(pending.texts, found):
            if a is not None:
                out.append(a.tolist())
            elif t in given:  # a text twice in the batch: a list of its own each time
                out.append(list(fresh[t]))
            else:
                given.add(t)
                out.append(fresh[t])
        if self._tokenizer is pending.tokenizer and self._vocab == pending.vocab:
            for t, ids in fresh.items():
                self._hold(t, ids)
        return out

    def _hold(self, text: str, ids: list[int]) -> None:
        n = len(ids)
        held = self._ids
        if n > self.max_ids or text in held:  # (held by another batch since this one was looked up)
            return
        held[text] = array("q", ids)
        self.held_ids += n
        while self.held_ids > self.max_ids or len(held) > self.max_prompts:
            oldest = next(iter(held))
            self.held_ids -= len(held.pop(oldest))


class PendingIds:
    """A batch looked up by `PromptIdsCache.start`: `missing` to encode, then the cache's `finish`."""

    __slots__ = ("texts", "found", "missing", "tokenizer", "vocab")

    def __init__(self, texts: list[str], found: list, missing: list[str], tokenizer, vocab: int):
        self.texts, self.found, self.missing, self.tokenizer, self.vocab = texts, found, missing, tokenizer, vocab
