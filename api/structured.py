"""Structured outputs: ``response_format`` (OpenAI) and ``structured_outputs`` (vLLM) → the ``structured``
constraint a worker compiles (``engine.grammar``), checked here first so that a bad schema is a 400 before it
is queued. The API imports no xgrammar (it imports torch): grammars and structural tags are checked by the
worker, which refuses a request it cannot compile as invalid (a 400 too, or a failed batch line)."""

from __future__ import annotations

import re
from dataclasses import dataclass

import jsonschema
import orjson

from api.errors import bad_request
from api.schemas import SamplingFields

ANY_OBJECT = {"type": "json_object"}


@dataclass(frozen=True)
class Constraint:
    spec: dict  # SamplingParams.structured
    param: str  # the request's field it came from: a 400 about it names that field


def constraint_of(body: SamplingFields) -> Constraint | None:
    """The request's constraint, or None for free text; 400 naming the field that is wrong."""
    fmt = body.response_format
    chosen = body.structured_outputs
    from_format = None
    if fmt is not None and fmt.type != "text":
        from_format = _from_response_format(fmt)
    from_vllm = _from_structured_outputs(chosen) if chosen is not None else None
    if from_format is not None and from_vllm is not None:
        raise bad_request("give response_format or structured_outputs, not both", "structured_outputs")
    return from_format or from_vllm


def _from_response_format(fmt) -> Constraint:
    if fmt.type == "json_object":
        return Constraint(ANY_OBJECT, "response_format")
    if fmt.json_schema is None:
        raise bad_request("response_format of type json_schema needs a json_schema object",
                          "response_format.json_schema")
    schema = fmt.json_schema.schema_
    if schema is None:
        return Constraint(ANY_OBJECT, "response_format.json_schema")
    param = "response_format.json_schema.schema"
    check_schema(schema, param)
    return Constraint({"type": "json_schema", "value": schema}, param)


def _from_structured_outputs(so) -> Constraint:
    given = {name: value for name, value in (("json", so.json_), ("regex", so.regex), ("choice", so.choice),
                                              ("grammar", so.grammar), ("json_object", so.json_object or None))
             if value is not None}
    if len(given) != 1:
        raise bad_request("structured_outputs takes exactly one of json, regex, choice, grammar, json_object; got "
                          f"{', '.join(given) or 'none'}", "structured_outputs")
    (name, value), = given.items()
    param = f"structured_outputs.{name}"
    return Constraint(_structured_spec(name, value, param), param)


def _structured_spec(name: str, value, param: str) -> dict:
    if name == "json":
        schema = _parsed_json(value, param) if isinstance(value, str) else value
        check_schema(schema, param)
        return {"type": "json_schema", "value": schema}
    if name == "json_object":
        return ANY_OBJECT
    if name == "regex":
        try:
            re.compile(value)
        except re.error as e:
            raise bad_request(f"{param} is not a regular expression: {e}", param) from None
        return {"type": "regex", "value": value}
    if name == "choice":
        if not all(value):
            raise bad_request(f"{param} may not hold an empty string", param)
        return {"type": "choice", "value": list(value)}
    if not value.strip():
        raise bad_request(f"{param} is empty", param)
    return {"type": "grammar", "value": value}


def _parsed_json(text: str, param: str) -> dict:
    try:
        value = orjson.loads(text)
    except orjson.JSONDecodeError as e:
        raise bad_request(f"{param} is not valid JSON: {e}", param) from None
    if not isinstance(value, dict):
        raise bad_request(f"{param} must be a JSON schema object", param)
    return value


MAX_SCHEMA_DEPTH = 64  # nesting of a schema's objects and arrays (the metaschema check recurses per level)
INT64 = (-(1 << 63), (1 << 64) - 1)  # what a queue entry (orjson) carries


def check_schema(schema: dict, param: str) -> None:
    """400 unless ``schema`` is a JSON schema (checked against its draft's metaschema, 2020-12 by default), at most
    MAX_SCHEMA_DEPTH deep, with integers of 64 bits."""
    _check_shape(schema, param)
    try:
        jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator).check_schema(schema)
    except jsonschema.SchemaError as e:
        where = "/".join(str(p) for p in e.absolute_path)
        raise bad_request(f"{param} is not a valid JSON schema{f' at {where}' if where else ''}: {e.message}",
                          param) from None


def _check_shape(schema, param: str) -> None:
    """Depth and integer range, walked without recursion (a deep schema must not exhaust the stack here)."""
    stack = [(schema, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, (dict, list)):
            if depth > MAX_SCHEMA_DEPTH:
                raise bad_request(f"{param} nests deeper than {MAX_SCHEMA_DEPTH} levels", param)
            stack += [(v, depth + 1) for v in (node.values() if isinstance(node, dict) else node)]
        elif isinstance(node, int) and not isinstance(node, bool) and not INT64[0] <= node <= INT64[1]:
            raise bad_request(f"{param} holds the integer {str(node)[:24]}…, beyond 64 bits", param)
