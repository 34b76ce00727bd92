"""Stored responses: the Responses API's ``store`` and ``previous_response_id``.

A stored response keeps, under ``response:<id>`` with a TTL, its tenant, the response object (``GET
/v1/responses/{id}``) and the conversation so far as chat messages (every turn's input and answer, without the
instructions, which OpenAI does not carry over). A request naming it as ``previous_response_id`` continues that
conversation: its prompt is the stored one's followed by its answer and the new input, so the worker's prefix
cache starts it where the last turn ended instead of prefilling the history again. Another tenant's id, an
expired or deleted one, reads as not found.
"""

from __future__ import annotations

import orjson
from redis.asyncio import Redis

from api.errors import OpenAIError
from worker import contract as c


async def save(redis: Redis, tenant: str, response: dict, messages: list[dict], ttl_s: int) -> None:
    record = {"tenant": tenant, "response": response, "messages": messages}
    await redis.set(c.response_key(response["id"]), orjson.dumps(record), ex=ttl_s)


async def load(redis: Redis, tenant: str, response_id: str, param: str | None = None) -> dict:
    """The stored record; a 404 (naming ``param``) where there is none this tenant may read."""
    data = await redis.get(c.response_key(response_id))
    record = orjson.loads(data) if data else None
    if record is None or record.get("tenant") != tenant:
        raise OpenAIError(404, f"no stored response {response_id!r}: it was not stored (store false), has expired "
                               "or been deleted, or belongs to another key", param=param, code="response_not_found")
    return record


async def delete(redis: Redis, tenant: str, response_id: str) -> None:
    await load(redis, tenant, response_id)
    await redis.delete(c.response_key(response_id))


def output_messages(output: list[dict]) -> list[dict]:
    """A response's output items as the chat messages that re-send them (text, then the tool calls)."""
    text = "".join(part["text"] for item in output if item["type"] == "message" for part in item["content"])
    calls = [{"id": item["call_id"], "type": "function",
              "function": {"name": item["name"], "arguments": item["arguments"]}}
             for item in output if item["type"] == "function_call"]
    if calls:
        return [{"role": "assistant", "content": text or None, "tool_calls": calls}]
    return [{"role": "assistant", "content": text}]
