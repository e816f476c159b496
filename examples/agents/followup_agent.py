"""A two-turn calculator agent for SmolLM2-135M-Instruct, written only against the `openai` package.

Episode: the system message asks for bare results; turn 1 is the example's question
("3 + 4"); turn 2 is a follow-up that only makes sense with the first answer: "Add 5 to
that." The model has to take its own first answer (what the conversation feeds back) and
reply with the new total, again as a bare number. Reward per turn: 1 for the right number
alone, `verbose_reward` for the right number at the end of a longer reply ("3 + 4 = 7"), 0
otherwise (a wrong number pays nothing, bare or not); each turn counts half (components
`turn1`, `turn2`). Success (`env.success: {component: turn2, threshold: 0.5}`):
the follow-up answered right.

rl_core calls `followup_agent(client, example)` once per episode with an `openai.AsyncOpenAI`
client bound to the episode's session; every model call is recorded token for token.

    env: {type: agent, target: "examples.agents.followup_agent:followup_agent"}
"""

from __future__ import annotations

import re

SYSTEM = "You are a calculator. Reply with the result only."
BARE = re.compile(r"^\s*(-?\d+)\s*\.?\s*$")
NUMBER = re.compile(r"-?\d+")


def follow_operand(example: dict) -> int:
    """The follow-up's operand, fixed per example (1..9)."""
    return (int(example["id"]) * 7 + 3) % 9 + 1


def score(reply: str, expected: int, verbose_reward: float) -> float:
    m = BARE.match(reply or "")
    if m is not None:
        return float(int(m.group(1)) == expected)
    numbers = NUMBER.findall(reply or "")
    return verbose_reward if numbers and int(numbers[-1]) == expected else 0.0


async def followup_agent(client, example: dict, verbose_reward: float = 0.2) -> dict:
    """Rewards `turn1` and `turn2`, each at most 0.5 (see the module doc)."""
    total = int(example["a"]) + int(example["b"])
    c = follow_operand(example)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": example["prompt"]}]
    first = await client.chat.completions.create(model="policy", messages=messages)
    answer = first.choices[0].message.content or ""  # sent back as it came: the session keeps its tokens
    messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": f"Add {c} to that."}]
    second = await client.chat.completions.create(model="policy", messages=messages)
    reply = second.choices[0].message.content or ""
    return {"turn1": score(answer, total, verbose_reward) / 2, "turn2": score(reply, total + c, verbose_reward) / 2}
