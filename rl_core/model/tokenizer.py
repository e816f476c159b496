"""The tiny model's tokenizer: a byte-level BPE trained on the fly, wrapped for transformers.

Owns: the training corpus (the task's text plus `GENERIC_CORPUS`), the tokenizer pipeline
(BPE over bytes with the pre-tokenizer regex transformers ships for Qwen2, so that
**every digit is always one token**, which the addition task depends on and
`digits_are_single_tokens` checks), the special tokens and ChatML-style chat template, and
the `transformers.PreTrainedTokenizerFast` wrapper. Training is deterministic (same corpus
and vocabulary size, same vocabulary and merges); `len(tokenizer)` is authoritative.

Does not own: the model (`tiny.py`) or how an environment templates prompts (`rl_core.envs`).

See docs/model.md, "The tokenizer": the pipeline, the special tokens and why this
pre-tokenizer.
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast
from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

EOS_TOKEN = "<|endoftext|>"
IM_START_TOKEN = "<|im_start|>"
IM_END_TOKEN = "<|im_end|>"
SPECIAL_TOKENS = (EOS_TOKEN, IM_START_TOKEN, IM_END_TOKEN)

# ChatML: <|im_start|>{role}\n{content}<|im_end|>\n per message; the generation prompt
# opens an assistant turn.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# A fixed bit of generic English (written for this module) so that the trainer finds
# merges: common words, punctuation, numbers in prose. Changing it changes the vocabulary.
GENERIC_CORPUS: tuple[str, ...] = (
    "The quick brown fox jumps over the lazy dog, and the dog does not seem to mind.",
    "A language model reads a sequence of tokens and predicts the next one.",
    "When the answer is right, the reward is one; when it is wrong, the reward is zero.",
    "Reinforcement learning improves a policy by trying actions and keeping what works.",
    "There are seven days in a week, twelve months in a year, and about 365 days in all.",
    "She wrote the numbers down: 3, 14, 159, and then she added them together.",
    "Please answer the question below. Think step by step, then give the final answer.",
    "The train left the station at 9:45 in the morning and arrived before noon.",
    "What is the sum of two numbers? It is what you get when you put them together.",
    "Water boils at one hundred degrees and freezes at zero, at the level of the sea.",
    "Good code is easy to read, easy to test, and easy to change when the need arises.",
    "The weather today is sunny with a light wind from the west and a few clouds.",
    "He counted the apples in the basket: there were 27 red ones and 15 green ones.",
    "In the beginning the model knows nothing; after training it can add and subtract.",
    "Every student in the class learned to write the alphabet and to count to ninety.",
    "The library opens at eight o'clock and closes at six, except on the weekend.",
    "If you are not sure, check your work twice and write the result in the box.",
    "This is a short story about a small robot who wanted to learn arithmetic.",
    "They walked along the river, talking about music, books, mountains and the sea.",
    "Thank you for your help! I could not have finished the project without you.",
)


def task_corpus(examples: Iterable[dict[str, Any]]) -> list[str]:
    """The task's training text: each example's prompt followed by its answer."""
    return [f"{ex['prompt']}{ex['answer']}" for ex in examples]


def train_bpe(texts: Sequence[str], vocab_size: int) -> Tokenizer:
    """Train the byte-level BPE on `texts` (special tokens take the first ids)."""
    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size must be at least {256 + len(SPECIAL_TOKENS)} "
                         f"(256 bytes + {len(SPECIAL_TOKENS)} special tokens), got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=list(SPECIAL_TOKENS),
        show_progress=False,
    )
    tok.train_from_iterator(list(texts), trainer=trainer)
    return tok


def wrap_tokenizer(tok: Tokenizer, model_max_length: int | None = None) -> PreTrainedTokenizerFast:
    """The transformers tokenizer around a trained `tokenizers.Tokenizer` (eos = pad, chat template)."""
    kwargs: dict[str, Any] = {}
    if model_max_length is not None:
        kwargs["model_max_length"] = int(model_max_length)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        additional_special_tokens=[IM_START_TOKEN, IM_END_TOKEN],
        padding_side="right",
        **kwargs,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_tokenizer(examples: Iterable[dict[str, Any]], vocab_size: int,
                    model_max_length: int | None = None) -> PreTrainedTokenizerFast:
    """Train the tiny model's tokenizer on the task's training examples plus `GENERIC_CORPUS`."""
    texts = task_corpus(examples) + list(GENERIC_CORPUS)
    fast = wrap_tokenizer(train_bpe(texts, vocab_size), model_max_length)
    if not digits_are_single_tokens(fast):
        raise AssertionError("the trained tokenizer split a digit or merged digits; "
                             "the pre-tokenizer regex should make this impossible")
    return fast


def digits_are_single_tokens(tokenizer: Any) -> bool:
    """True when each digit 0-9 is one token, in every context we probe (digit runs, after text
    and operators, after a space), so a number of n digits is always n tokens."""
    digit_ids = []
    for d in "0123456789":
        ids = tokenizer.encode(d, add_special_tokens=False)
        if len(ids) != 1:
            return False
        digit_ids.append(ids[0])
    probes = ["0123456789", "9876543210", "07+45=250", "x12", " 34", "=56", "a7b8c9", "100000"]
    for text in probes:
        ids = tokenizer.encode(text, add_special_tokens=False)
        digits_in_text = [c for c in text if c.isdigit()]
        digit_tokens = [i for i in ids if i in digit_ids]
        if [digit_ids[int(c)] for c in digits_in_text] != digit_tokens:
            return False
        if tokenizer.decode(ids) != text:
            return False
    return True
