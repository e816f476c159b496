"""Server text handling with a real byte-level BPE tokenizer: streamed text never contains a
half character or text that a stop string later cuts, and equals the non-streamed text;
stop strings are cut at their earliest occurrence; logprob layouts line up with tokens."""

from __future__ import annotations

import pytest
from tests.helpers.serving import make_tokenizer

from rl_core.serve.protocol import ChatCompletionRequest, CompletionRequest
from rl_core.serve.text import TextCodec, TextStream, chat_logprobs, completion_logprobs, cut_at_stop


@pytest.fixture(scope="module")
def codec():
    return TextCodec(make_tokenizer())


def stream_all(codec, ids, stops):
    stream = TextStream(codec, stops)
    deltas = [stream.push([t]) for t in ids]
    return deltas, stream.finish()


def test_streamed_text_equals_the_whole_text_and_never_splits_a_character(codec):
    text = "Héllo wörld, ünïcode ✓ works."
    ids = codec.encode(text)
    assert len(ids) > len(text) // 2  # byte-level: the accented characters span several tokens
    deltas, rest = stream_all(codec, ids, ())
    assert "".join(deltas) + rest == codec.decode(ids) == text
    assert all("\ufffd" not in d for d in deltas)
    assert any(d == "" for d in deltas)  # some tokens ended inside a character and waited


def test_stop_strings_are_held_back_and_cut(codec):
    text = "The quick brown fox. STOP and more text STOP again"
    ids = codec.encode(text)
    deltas, rest = stream_all(codec, ids, ["STOP", "zzz"])
    assert "".join(deltas) + rest == "The quick brown fox. "
    sent = ""
    for d in deltas:  # nothing sent was ever part of the stop string
        sent += d
        assert "ST" not in sent
    assert cut_at_stop("a xx b yy c", ["yy", "xx"]) == ("a ", True)
    assert cut_at_stop("abc", ["x"]) == ("abc", False)


def test_logprob_layouts_line_up_with_tokens(codec):
    ids = codec.encode("Hi there")
    lps = [-0.5 * (i + 1) for i in range(len(ids))]
    top = [[(t, lp), (ids[0], lp - 1.0)] for t, lp in zip(ids, lps)]
    legacy = completion_logprobs(codec, ids, lps, top, text_offset=3)
    assert legacy["tokens"] == [codec.token_str(t) for t in ids] and legacy["token_logprobs"] == lps
    assert legacy["text_offset"][0] == 3
    assert all(b - a == len(s) for a, b, s in zip(legacy["text_offset"], legacy["text_offset"][1:], legacy["tokens"]))
    assert legacy["top_logprobs"][0] == {codec.token_str(ids[0]): lps[0]}  # same text: the larger one is kept
    chat = chat_logprobs(codec, ids, lps, top)
    assert [r["token"] for r in chat] == legacy["tokens"]
    assert bytes(chat[1]["bytes"]).decode() == chat[1]["token"] and len(chat[1]["top_logprobs"]) == 2


def test_request_bodies_refuse_what_the_engine_cannot_honour():
    with pytest.raises(ValueError, match="echo"):
        CompletionRequest(prompt="x", echo=True)
    with pytest.raises(ValueError, match="best_of"):
        CompletionRequest(prompt="x", n=2, best_of=3)
    with pytest.raises(ValueError, match="frequency_penalty"):
        CompletionRequest(prompt="x", frequency_penalty=0.1)
    with pytest.raises(ValueError, match="top_logprobs needs logprobs"):
        ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], top_logprobs=2)
    req = CompletionRequest(prompt=[[1, 2], [3]], temperature=0, top_k=-1, seed=5, stop="!")
    assert req.prompts() == [[1, 2], [3]]
    p = req.sampling_params(7, choice=2, top_logprobs=1)
    assert (p.greedy, p.top_k, p.seed, p.stop_strings, p.max_tokens) == (True, 0, 7, ("!",), 7)
    parts = ChatCompletionRequest(messages=[{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                         {"type": "text", "text": "b"}]}])
    assert parts.messages[0].for_template() == {"role": "user", "content": "ab"}
