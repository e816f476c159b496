"""Decoding a group's completions to texts, off the event loop where the tokenizer allows it.

Owns: `decode_text` (one completion, `tokenizer.decode(ids, skip_special_tokens=True)`),
`group_decoder` (one Rust `decode_batch` call for a group, where it reproduces `decode`
exactly: an unmodified transformers tokenizer over a Rust `tokenizers.Tokenizer` that does
not clean up tokenization spaces), `decode_group` (a group's texts: on a decode thread through
`group_decoder`, else on the loop), and `_GroupDecodes` (the groups that ask in one turn of the
event loop go to the decode threads as one job).

Does not own: generating or scoring a group (`rollout.group`), or the tokenizer.
"""

from __future__ import annotations

import asyncio
import functools
import weakref
from concurrent.futures import ThreadPoolExecutor

import numpy as np


def decode_text(tokenizer, ids: list[int]) -> str:
    """One completion's text, as every path of a group reads it."""
    return tokenizer.decode(ids, skip_special_tokens=True)


# A group call's completions are decoded here, off the event loop, where the tokenizer is a
# transformers tokenizer over a Rust `tokenizers.Tokenizer` (`group_decoder`): its
# `decode_batch` releases the interpreter lock while it decodes (docs/controller.md, "What we
# learned"), so the loop keeps running. Two threads; `rl-core train` sets
# TOKENIZERS_PARALLELISM=false (launch/train.py), so each call decodes its sequences in turn
# (with parallelism on, the Rust call spreads them over its own thread pool).
_DECODE_POOL = ThreadPoolExecutor(max_workers=2, thread_name_prefix="rl_core-decode")


@functools.lru_cache(maxsize=64)
def _plain_decode_class(cls: type) -> bool:
    """Whether `cls.decode` is transformers' own `decode` over the Rust-backed `_decode` (no
    subclass overrides either), the case where `group_decoder` reproduces it."""
    try:
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:  # another transformers layout: decode on the loop, as always
        return False
    return (issubclass(cls, TokenizersBackend) and cls.decode is PreTrainedTokenizerBase.decode
            and cls._decode is TokenizersBackend._decode)


def group_decoder(tokenizer):
    """A function decoding a group's completions (a list of token id lists or 1-D arrays) to
    the texts `tokenizer.decode(ids, skip_special_tokens=True)` gives each, in one
    `decode_batch` call of the tokenizer's Rust backend, or None where that cannot be
    guaranteed: a tokenizer that is not an unmodified transformers tokenizer over a Rust
    `tokenizers.Tokenizer`, or one that cleans up tokenization spaces (a Python step after the
    Rust decode). transformers' `decode` is the Rust `decode` of the ids as Python ints,
    then that clean-up; `decode_batch` is the same Rust decode per sequence."""
    if not _plain_decode_class(type(tokenizer)) or getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return None
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decode_batch = getattr(backend, "decode_batch", None)
    if decode_batch is None:
        return None

    def decode(ids: list) -> list[str]:
        return decode_batch([t.tolist() if isinstance(t, np.ndarray) else t for t in ids], skip_special_tokens=True)

    return decode


async def decode_group(tokenizer, ids: list) -> list[str]:
    """A group's texts, each `tokenizer.decode(ids, skip_special_tokens=True)`: in one batch
    call on a decode thread (`_DECODE_POOL`, with the other groups that ask in the same turn of
    the loop: `_GroupDecodes`) where `group_decoder` applies, so the event loop goes on while
    the Rust decoder runs; else on the loop, one `decode` per completion (fakes,
    slow tokenizers, a subclass with its own `decode`). An error of either propagates."""
    batch = group_decoder(tokenizer)
    if batch is None:
        decode = tokenizer.decode
        return [decode(t, skip_special_tokens=True) for t in ids]
    return await _DECODES.submit(asyncio.get_running_loop(), batch, ids)


class _GroupDecodes:
    """Hands the groups' decodes to the decode pool together: the groups that ask for their texts
    in one turn of the event loop go to the pool as one job, whose texts come back in one call
    on the loop (`call_soon_threadsafe`). A pool call per group cost the loop thread more than
    the decode itself saved (measured with the decode replaced by a lookup: docs/benchmarks.md),
    most of it while the decode threads ran beside the loop's own work; one job per turn costs
    one hand-off. Each group is still decoded by its
    own call (`group_decoder`), in the order asked, and gets its own texts or its own error,
    as before; a group whose task was cancelled meanwhile gets nothing."""

    def __init__(self):
        self._pending: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # loop -> [(decode, ids, future)]
        self.jobs = 0  # jobs handed to the pool so far (tests)

    def submit(self, loop: asyncio.AbstractEventLoop, decode, ids: list) -> asyncio.Future:
        fut = loop.create_future()
        pending = self._pending.get(loop)
        if pending is None:  # the first group since the last job: the job goes out after this turn of the loop
            pending = self._pending[loop] = []
            loop.call_soon(self._flush, loop)
        pending.append((decode, ids, fut))
        return fut

    def _flush(self, loop: asyncio.AbstractEventLoop) -> None:
        self.jobs += 1
        _DECODE_POOL.submit(self._run, loop, self._pending.pop(loop))

    def _run(self, loop: asyncio.AbstractEventLoop, jobs: list) -> None:
        out = []
        for decode, ids, fut in jobs:
            try:
                out.append((fut, decode(ids), None))
            except BaseException as exc:  # noqa: BLE001 - handed to its group, as the pool's future did
                out.append((fut, None, exc))
        try:
            loop.call_soon_threadsafe(self._deliver, out)
        except RuntimeError:  # the loop closed meanwhile: nobody waits for these texts
            if not loop.is_closed():
                raise

    @staticmethod
    def _deliver(out: list) -> None:
        for fut, texts, exc in out:
            if fut.done():  # its group was cancelled
                continue
            if exc is None:
                fut.set_result(texts)
            else:
                fut.set_exception(exc)


_DECODES = _GroupDecodes()
