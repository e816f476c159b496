"""A checker agent for SmolLM2-135M-Instruct, written only against the `openai` package.

Episode: the system message asks for bare results; turn 1 is the example's question
("3 + 4"). The right number alone ends the episode; otherwise the agent sends its verdict and
the model gets a second try: "Reply with the number only." when the right number stands in a
longer reply ("3 + 4 = 7"), else "That is not right. Try again.". Rewards: 1 for the right
number alone that ended its turn (`first`, or `retry` on the second try); `hint_bonus`
(`hint`) for the right number in a longer first reply, the step the verdict builds on (a bonus
for any bare number instead collapsed onto wrong bare numbers). Success (`env.success:
{threshold: 1.0}`): the right number alone within the episode.

rl_core calls `checker_agent(client, example)` once per episode with an `openai.AsyncOpenAI`
client bound to the episode's session; every model call is recorded token for token.

    env: {type: agent, target: "examples.agents.checker_agent:checker_agent"}
"""

from __future__ import annotations

import re

SYSTEM = "You are a calculator. Reply with the result only."
NUMBER_ONLY, WRONG = "Reply with the number only.", "That is not right. Try again."  # the verdicts
NUMBER = re.compile(r"-?\d+")


def right_alone(choice, expected: int) -> bool:
    """The right number alone, in a reply that ended (not cut off by the token limit)."""
    alone = NUMBER.fullmatch((choice.message.content or "").strip().removesuffix(".").strip())
    return choice.finish_reason == "stop" and alone is not None and int(alone.group()) == expected


def verdict(reply: str, expected: int) -> str:
    """The checker's answer to a reply that was not the right number alone."""
    return NUMBER_ONLY if str(expected) in NUMBER.findall(reply or "") else WRONG


async def checker_agent(client, example: dict, hint_bonus: float = 0.1) -> dict:
    """Rewards `first`, `hint` and `retry` (see the module doc)."""
    expected = int(example["a"]) + int(example["b"])
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": example["prompt"]}]
    first = (await client.chat.completions.create(model="policy", messages=messages)).choices[0]
    if right_alone(first, expected):
        return {"first": 1.0, "hint": 0.0, "retry": 0.0}
    answer = first.message.content or ""  # sent back as it came: the session keeps its tokens
    said = verdict(answer, expected)
    messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": said}]
    second = (await client.chat.completions.create(model="policy", messages=messages)).choices[0]
    return {"first": 0.0, "hint": hint_bonus * (said == NUMBER_ONLY), "retry": float(right_alone(second, expected))}
