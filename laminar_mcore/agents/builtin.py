"""Agents that ship with laminar_mcore, written as a user writes one: plain OpenAI-client code.

``calculator`` is the agent demo's (``experiment=cpu_agent``): it sends the problem, runs every
tool call the model makes in the sandbox (agents/sandbox.py) and sends back its answer,
until the model answers without a tool call; that answer is scored by ``data.reward_fn``.
Used with ``data.agent=laminar_mcore.agents.builtin:calculator``.
"""

from __future__ import annotations

import json

from ..data.agent_task import TOOLS
from .sandbox import calculator as run_calculator


async def calculator(client, row: dict) -> str:
    messages = [{"role": "user", "content": row["prompt"]}]
    while True:  # the gateway's rollout.max_turns ends an agent that never stops
        answer = await client.chat.completions.create(model="policy", messages=messages,
                                                      tools=TOOLS)
        message = answer.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            return message.content or ""
        for call in message.tool_calls:
            try:
                expression = json.loads(call.function.arguments)["expression"]
            except (ValueError, KeyError, TypeError):
                text = 'Error: the arguments must be {"expression": "..."}'
            else:
                text = (await run_calculator(expression)).as_tool_message()
            messages.append({"role": "tool", "tool_call_id": call.id, "content": text})
