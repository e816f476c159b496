"""Example reward functions (docs/environments.md): each is `fn(prompt, completion, example) -> float`.

- `prompt`: the prompt text (or, with `env.use_chat_template: true`, the chat messages);
- `completion`: the model's completion text, end token removed;
- `example`: every field of the data row (`prompt`, `answer`, and any other column).

The recipe beside this file weighs them: reward = 1.0 * exact_answer + 0.2 * digits_only.
"""

from __future__ import annotations


def exact_answer(prompt, completion, example) -> float:
    """1 when the completion is exactly the reference answer."""
    return float(completion.strip() == example["answer"])


def digits_only(prompt, completion, example) -> float:
    """1 for an answer of the right length made of digits only (a format reward)."""
    text = completion.strip()
    return float(text.isdigit() and len(text) == len(example["answer"]))
