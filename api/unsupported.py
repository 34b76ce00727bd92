"""Nothing silently ignored: request fields OpenAI defines that Gaggle does not implement are a 400 naming the
field; fields OpenAI does not define are ignored (as its SDK expects of a server) and logged once per process.

A field counts as used when it carries a value that would change the answer: ``null`` (what an SDK echoes back
from a response object), ``false``, an empty list and the documented default are not uses. Hints that cannot
change an answer (``user``, ``metadata``, ``prompt_cache_key`` …) are accepted; README lists them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from pydantic import BaseModel

from api.errors import bad_request

log = logging.getLogger(__name__)

Rule = Callable[[object], str | None]  # the field's value -> why it is refused, or None


def _absent(value: object) -> bool:
    return value is None or value is False or value == [] or value == {} or value == ""


def refuse(reason: str) -> Rule:
    return lambda value: None if _absent(value) else reason


def only(allowed: tuple, reason: str) -> Rule:
    return lambda value: None if _absent(value) or value in allowed else reason


NOT_TEXT = "Gaggle generates text only"
CHAT_RULES: dict[str, Rule] = {
    "audio": refuse(NOT_TEXT),
    "modalities": only((["text"],), NOT_TEXT),
    "prediction": refuse("predicted outputs are not implemented"),
    "web_search_options": refuse("web search is not available"),
    "functions": refuse("the deprecated functions field is not implemented: use tools"),
    "function_call": refuse("the deprecated function_call field is not implemented: use tool_choice"),
    "reasoning_effort": refuse("the model does not reason before answering"),
    "verbosity": only(("medium",), "verbosity is not implemented"),
    "store": refuse("completions are not stored: store must be false"),
    "service_tier": only(("auto", "default"), "one service tier: auto (or default)"),
}
COMPLETION_RULES: dict[str, Rule] = {
    "suffix": refuse("suffix (insertion) is not implemented"),
}
MESSAGE_RULES: dict[str, Rule] = {
    "audio": refuse(NOT_TEXT),
    "refusal": refuse("assistant refusals are not part of the chat format"),
    "function_call": refuse("the deprecated function_call field is not implemented: use tool_calls"),
}


def check_fields(body: BaseModel, rules: dict[str, Rule], endpoint: str, prefix: str = "") -> None:
    """400 naming the first field in ``rules`` that carries a value; unknown fields logged (once each)."""
    for name, rule in rules.items():
        reason = rule(getattr(body, name, None))
        if reason is not None:
            raise bad_request(f"{prefix}{name} is not supported: {reason}", f"{prefix}{name}", "unsupported_field")
    log_unknown(body, endpoint, prefix)


_logged: set[tuple[str, str]] = set()


def log_unknown(body: BaseModel, endpoint: str, prefix: str = "") -> None:
    for name in body.model_extra or ():
        key = (endpoint, prefix.split("[")[0] + name)
        if key not in _logged:
            _logged.add(key)
            log.warning("request field not in the API, ignored (logged once)",
                        extra={"endpoint": endpoint, "field": f"{prefix}{name}"})
