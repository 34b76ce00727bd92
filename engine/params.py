"""Per-request generation parameters and every limit on them (plain Python, no torch: ``api/`` imports it).

Each limit is written once, here, and checked by one function, ``SamplingParams.validate``, which building a
``SamplingParams`` runs. The API builds one when a request is final (max_tokens fitted to the context) and
answers a ``ParamError`` with a 400 naming the field; a worker builds one from an untrusted queue entry with
``from_wire`` (the entry's types, then the same validation); an engine checks only its own limits (its
vocabulary: ``check_vocabulary``; lengths; slots).

Names and meanings follow vLLM's ``SamplingParams`` where they overlap, and the OpenAI API for the penalties
(additive presence / frequency penalties).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field, fields

# -- limits ------------------------------------------------------------------------------------------

MAX_TOKEN_ID = 2**31 - 1  # token ids and token counts fit an int32
MAX_SEED = 2**63 - 1  # a seed fits an int64
MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 1024
MAX_STRUCTURED_BYTES = 256 * 1024  # what one constraint may weigh on the wire
STRUCTURED_KINDS = ("json_schema", "json_object", "regex", "choice", "grammar", "structural_tag")
STATE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")  # an initial state's name (``--state NAME=FILE``)


@dataclass(frozen=True)
class Range:
    """The values a field may take: ``low`` to ``high``, ``low`` itself excluded when ``low_open``."""
    low: float
    high: float
    low_open: bool = False

    def __contains__(self, value: float) -> bool:
        return (self.low < value if self.low_open else self.low <= value) and value <= self.high

    def __str__(self) -> str:
        if self.low_open:
            return f"in ({_num(self.low)}, {_num(self.high)}]"
        return f"between {_num(self.low)} and {_num(self.high)}"

    def json_schema(self) -> dict:
        """The bounds as OpenAPI documents them (the API's schema shows them; validate checks them)."""
        return {"exclusiveMinimum" if self.low_open else "minimum": self.low, "maximum": self.high}


RANGES = {  # fields with a fixed range (min_tokens is bounded by max_tokens as well)
    "max_tokens": Range(1, MAX_TOKEN_ID),
    "min_tokens": Range(0, MAX_TOKEN_ID),
    "temperature": Range(0.0, 2.0),
    "top_p": Range(0.0, 1.0, low_open=True),
    "top_k": Range(-1, MAX_TOKEN_ID),  # -1 and 0: the whole vocabulary
    "min_p": Range(0.0, 1.0),
    "presence_penalty": Range(-2.0, 2.0),
    "frequency_penalty": Range(-2.0, 2.0),
    "repetition_penalty": Range(0.0, 2.0, low_open=True),
    "seed": Range(-MAX_SEED - 1, MAX_SEED),
    "logprobs": Range(0, MAX_LOGPROBS),
    "prompt_logprobs": Range(0, MAX_LOGPROBS),
}
LOGIT_BIAS = Range(-100.0, 100.0)  # each value of logit_bias
TOKEN_IDS = Range(0, MAX_TOKEN_ID)  # logit_bias keys and stop_token_ids before a vocabulary bounds them


class ParamError(ValueError):
    """A parameter outside its limit; ``field`` names it (the API's 400 sets ``param`` from it)."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


# -- the parameters ----------------------------------------------------------------------------------

@dataclass
class SamplingParams:
    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1) = whole vocabulary
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    seed: int | None = None
    logprobs: int | None = None  # None = no logprobs; k = chosen token + top k
    prompt_logprobs: int | None = None  # None = none; k = each prompt token's logprob + the top k there
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    structured: dict | None = None  # constrained decoding: {"type", "value"} (engine.grammar)
    state: str | None = None  # start from this named initial state (a tuned state), not the zero state

    def __post_init__(self) -> None:
        if self.top_k == -1:
            self.top_k = 0
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
        self.validate()

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise ParamError naming the field and its limit (building runs it); with ``vocab_size``, the token
        ids against that vocabulary too (``check_vocabulary``)."""
        for name, allowed in RANGES.items():
            value = getattr(self, name)
            _check(value is None or value in allowed, name, f"{name} must be {allowed}, got {value}")
        _check(self.min_tokens <= self.max_tokens, "min_tokens",
               f"min_tokens must be between 0 and max_tokens ({self.max_tokens}), got {self.min_tokens}")
        _check(len(self.stop) <= MAX_STOP_STRINGS, "stop",
               f"stop may hold at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}")
        for s in self.stop:
            _check(isinstance(s, str) and 0 < len(s) <= MAX_STOP_STRING_CHARS, "stop",
                   f"each stop string must have 1 to {MAX_STOP_STRING_CHARS} characters")
        _check(len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS, "stop_token_ids",
               f"stop_token_ids may hold at most {MAX_STOP_TOKEN_IDS} ids, got {len(self.stop_token_ids)}")
        for token_id in self.stop_token_ids:
            _check(token_id in TOKEN_IDS, "stop_token_ids", f"each stop_token_ids entry must be {TOKEN_IDS}, "
                                                            f"got {token_id}")
        for token_id, bias in self.logit_bias.items():
            _check(token_id in TOKEN_IDS, "logit_bias", f"logit_bias keys must be token ids {TOKEN_IDS}, "
                                                        f"got {token_id}")
            _check(bias in LOGIT_BIAS, "logit_bias", f"logit_bias values must be {LOGIT_BIAS}, got {bias}")
        if self.structured is not None:
            validate_structured(self.structured)
        _check(self.state is None or (isinstance(self.state, str) and STATE_NAME.fullmatch(self.state) is not None),
               "state", "state must name an initial state: 1 to 64 letters, digits, '.', '_' or '-'")
        if vocab_size is not None:
            self.check_vocabulary(vocab_size)

    def check_vocabulary(self, vocab_size: int) -> None:
        """The token ids (logit_bias keys, stop_token_ids) against a vocabulary: the API checks the live
        workers' smallest, an engine its own model's."""
        for token_id in self.logit_bias:
            _check(token_id < vocab_size, "logit_bias",
                   f"logit_bias token id {token_id} is outside the vocabulary (0..{vocab_size - 1})")
        for token_id in self.stop_token_ids:
            _check(token_id < vocab_size, "stop_token_ids",
                   f"stop_token_ids entry {token_id} is outside the vocabulary (0..{vocab_size - 1})")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def needs_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in _FIELDS}

    def to_wire(self) -> dict:
        """The parameters as JSON for a queue entry (``from_wire`` reads them back): logit_bias keys as strings,
        fields that are None left out."""
        wire = {f.name: getattr(self, f.name) for f in _FIELDS if getattr(self, f.name) is not None}
        wire["logit_bias"] = {str(k): v for k, v in self.logit_bias.items()}
        return wire

    @classmethod
    def from_wire(cls, d: object) -> "SamplingParams":
        """Parameters as they travel in JSON (a queue entry): each field's type checked before anything is
        built from them (ints are ints, not floats or bools; numbers are finite; lists hold what they should),
        then built, which validates them. Unknown fields are ignored (a newer sender). Raises ValueError
        naming the field."""
        _check(isinstance(d, dict), "params", f"params must be an object, got {type(d).__name__}")
        typed = {}
        for name, value in d.items():
            kind = _WIRE_TYPES.get(name)
            if kind is not None:
                typed[name] = kind(name, value)
        return cls(**typed)


_FIELDS = fields(SamplingParams)


def _check(ok: bool, field_name: str, message: str) -> None:
    if not ok:
        raise ParamError(field_name, message)


_ID_DIGITS = len(str(MAX_TOKEN_ID))


def token_id_of(key: str) -> int | None:
    """A token id written in digits, as a JSON object's keys carry them (logit_bias), or None: ASCII digits
    only ("²".isdigit() too), few enough for an int32 to be possible."""
    return int(key) if key.isascii() and key.isdigit() and len(key) <= _ID_DIGITS else None


def _num(x: float) -> str:
    return str(x) if isinstance(x, int) else f"{x:g}"


def spec_key(spec: dict) -> str:
    """A constraint's identity: its canonical JSON (the grammar cache's key)."""
    return json.dumps(spec, sort_keys=True, separators=(",", ":"))


def validate_structured(spec: object) -> None:
    """A constraint's shape and size (cheap, no xgrammar); compiling it says the rest. ParamError naming the
    problem."""
    _check(isinstance(spec, dict) and spec.get("type") in STRUCTURED_KINDS, "structured",
           f"structured must be an object whose type is one of {', '.join(STRUCTURED_KINDS)}")
    kind, value = spec["type"], spec.get("value")
    if kind == "choice":
        _check(isinstance(value, list) and bool(value) and all(isinstance(v, str) and v for v in value),
               "structured", "structured choice needs a non-empty list of non-empty strings")
    elif kind in ("json_schema", "structural_tag"):
        _check(isinstance(value, (dict, str)), "structured", f"structured {kind} needs an object")
    elif kind != "json_object":
        _check(isinstance(value, str) and bool(value), "structured", f"structured {kind} needs a non-empty string")
    size = len(spec_key(spec))
    _check(size <= MAX_STRUCTURED_BYTES, "structured",
           f"the {kind} constraint is {size} bytes as JSON, more than the limit of {MAX_STRUCTURED_BYTES} bytes")


# -- wire types (see SamplingParams.from_wire): types only, the limits are validate's ----------------------

def _int(name: str, value: object) -> int:
    _check(type(value) is int, name, f"{name} must be an integer, got {type(value).__name__}")
    return value


def _optional_int(name: str, value: object) -> int | None:
    return None if value is None else _int(name, value)


def _number(name: str, value: object) -> float:
    _check(type(value) in (int, float), name, f"{name} must be a number, got {type(value).__name__}")
    _check(math.isfinite(value), name, f"{name} must be finite, got {value}")
    return float(value)


def _bool(name: str, value: object) -> bool:
    _check(type(value) is bool, name, f"{name} must be true or false, got {type(value).__name__}")
    return value


def _token_ids(name: str, value: object) -> list[int]:
    _check(type(value) is list and all(type(t) is int for t in value), name, f"{name} must be a list of token ids")
    return value


def _strings(name: str, value: object) -> list[str]:
    if type(value) is str:
        value = [value]
    _check(type(value) is list and all(type(s) is str for s in value), name, f"{name} must be a list of strings")
    return value


def _logit_bias(name: str, value: object) -> dict[int, float]:
    _check(type(value) is dict, name, f"{name} must be an object mapping token ids to numbers")
    out = {}
    for key, bias in value.items():
        token_id = token_id_of(key) if type(key) is str else None
        _check(token_id is not None, name, f"{name} keys must be token ids written in digits, got {key!r}")
        out[token_id] = _number(f"{name}[{key}]", bias)
    return out


def _optional_str(name: str, value: object) -> str | None:
    _check(value is None or type(value) is str, name, f"{name} must be a string")
    return value


def _structured(name: str, value: object) -> dict | None:
    _check(value is None or type(value) is dict, name, f"{name} must be an object")
    return value


_WIRE_TYPES = {
    "max_tokens": _int, "min_tokens": _int, "top_k": _int,
    "seed": _optional_int, "logprobs": _optional_int, "prompt_logprobs": _optional_int,
    "temperature": _number, "top_p": _number, "min_p": _number, "presence_penalty": _number,
    "frequency_penalty": _number, "repetition_penalty": _number,
    "logit_bias": _logit_bias,
    "stop": _strings,
    "stop_token_ids": _token_ids,
    "include_stop_str_in_output": _bool,
    "ignore_eos": _bool,
    "structured": _structured,
    "state": _optional_str,
}
