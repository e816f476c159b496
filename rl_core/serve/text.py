"""Text for the server: prompts in, completion text and logprob records out.

Owns: turning a completion's token ids into the text the OpenAI API returns (special
tokens skipped, cut before the first stop string: the API never returns the stop
sequence), streaming that text without ever sending something that is later cut
(`TextStream` holds back an incomplete UTF-8 character and the last len(stop) - 1
characters until the choice ends), chat templating, and the two logprob layouts
(`/v1/completions`' tokens / token_logprobs / top_logprobs / text_offset, and chat's
per-token records with UTF-8 bytes).

Token strings are `decode([id])` of each token alone (a byte-level token that splits a
UTF-8 character shows as U+FFFD, as in other OpenAI-compatible servers).

Does not own: generation (the engine) or the response envelopes (app.py).
"""

from __future__ import annotations

from typing import Any, Sequence

INCOMPLETE = "\ufffd"


class TextCodec:
    """The tokenizer's decode/encode as the server uses them."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def token_str(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def chat_prompt(self, messages: list[dict], add_generation_prompt: bool, continue_final_message: bool) -> list[int]:
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("this model's tokenizer has no chat_template; use /v1/completions, or add a chat "
                             "template to the tokenizer (tokenizer_config.json or chat_template.jinja)")
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                 continue_final_message=continue_final_message, tokenize=True,
                                                 return_dict=False)
        return [int(i) for i in ids]


def cut_at_stop(text: str, stops: Sequence[str]) -> tuple[str, bool]:
    """`text` up to (excluding) its earliest stop string, and whether one was found."""
    cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
    return (text, False) if cut < 0 else (text[:cut], True)


class TextStream:
    """Incremental text of one choice: feed token ids, get the text that is safe to send."""

    def __init__(self, codec: TextCodec, stops: Sequence[str]):
        self.codec = codec
        self.stops = tuple(stops)
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.ids: list[int] = []
        self.sent = 0  # characters of the (cut) text already sent
        self.stopped = False

    def push(self, ids: Sequence[int]) -> str:
        """New text that can be sent now."""
        self.ids.extend(ids)
        if self.stopped:
            return ""
        text, found = cut_at_stop(self.codec.decode(self.ids), self.stops)
        if found:
            self.stopped = True
            end = len(text)
        else:
            end = len(text) - self.hold
            while end > self.sent and text[end - 1] == INCOMPLETE:  # wait for the rest of the character
                end -= 1
        delta = text[self.sent:end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        return delta

    def finish(self) -> str:
        """The rest of the text, once the choice has ended."""
        if self.stopped:
            return ""
        text, _ = cut_at_stop(self.codec.decode(self.ids), self.stops)
        delta = text[self.sent:]
        self.sent = len(text)
        return delta


def completion_logprobs(codec: TextCodec, token_ids: Sequence[int], logprobs: Sequence[float],
                        top: Sequence[Sequence[tuple[int, float]]] | None, text_offset: int = 0) -> dict:
    """The `/v1/completions` layout: parallel lists per token."""
    tokens = [codec.token_str(t) for t in token_ids]
    offsets, pos = [], text_offset
    for s in tokens:
        offsets.append(pos)
        pos += len(s)
    top_dicts = None
    if top is not None:  # a dict keyed by text: tokens that print alike keep the most likely one
        top_dicts = []
        for row in top:
            d: dict[str, float] = {}
            for t, lp in row:  # rows are sorted, most likely first
                d.setdefault(codec.token_str(t), lp)
            top_dicts.append(d)
    return {"tokens": tokens, "token_logprobs": list(logprobs), "top_logprobs": top_dicts, "text_offset": offsets}


def chat_logprobs(codec: TextCodec, token_ids: Sequence[int], logprobs: Sequence[float],
                  top: Sequence[Sequence[tuple[int, float]]] | None) -> list[dict]:
    """The chat layout: one record per token, with its UTF-8 bytes and its alternatives."""

    def record(token_id: int, logprob: float) -> dict:
        s = codec.token_str(token_id)
        return {"token": s, "logprob": logprob, "bytes": list(s.encode("utf-8"))}

    out = []
    for i, (t, lp) in enumerate(zip(token_ids, logprobs)):
        rec = record(t, lp)
        rec["top_logprobs"] = [record(a, alp) for a, alp in top[i]] if top is not None else []
        out.append(rec)
    return out
