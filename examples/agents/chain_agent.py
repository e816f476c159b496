"""A two-turn agent for rl_core's tiny model, written only against the `openai` package.

Episode: ask the model for a + b (the task's prompt, e.g. "07+45="), then, as a second user
turn, for "+c=" (the running total plus c); the tiny model answers each sum as its three
digits in reversed order ("250" for 52). The reward is the share of turns answered right (or, with `partial_credit`, of digits right).

rl_core calls `chain_agent(client, example)` once per episode with an `openai.AsyncOpenAI`
client bound to the episode's session: every model call is recorded token for token and
trained on; the agent never imports rl_core.

    env: {type: agent, target: "examples.agents.chain_agent:chain_agent"}
"""

from __future__ import annotations


def third_operand(example: dict) -> int:
    return (int(example["id"]) * 37 + 11) % 100


def reversed_digits(total: int) -> str:
    return f"{total:03d}"[::-1]


def digits_right(answer: str, expected: str) -> float:
    """Partial credit: the share of the expected digits the answer has in the right place."""
    return sum(a == e for a, e in zip(answer, expected)) / len(expected)


async def chain_agent(client, example: dict, turns: int = 2, partial_credit: bool = False) -> dict:
    """Reward per turn: 1/turns for an exact answer that ended the turn; with `partial_credit`,
    the share of digits right instead (a denser signal)."""
    a, b, c = int(example["a"]), int(example["b"]), third_operand(example)
    messages = [{"role": "user", "content": example["prompt"]}]
    expected = [reversed_digits(a + b), reversed_digits(a + b + c)]
    right = {}
    for turn in range(turns):
        reply = await client.chat.completions.create(model="policy", messages=messages)
        answer = reply.choices[0].message.content or ""  # sent back as it came: the session keeps its tokens
        ended = reply.choices[0].finish_reason == "stop"
        exact = float(answer.strip() == expected[turn] and ended)
        right[f"turn{turn + 1}"] = digits_right(answer.strip(), expected[turn]) if partial_credit and ended else exact
        messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": f"+{c:02d}="}]
    return {k: v / turns for k, v in right.items()}
