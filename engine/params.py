"""Per-request generation parameters (plain Python, no torch).

Names and meanings follow vLLM's ``SamplingParams`` where they overlap, and the
OpenAI API for the penalties (additive presence / frequency penalties).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
STRUCTURED_KINDS = ("json_schema", "json_object", "regex", "choice", "grammar", "structural_tag")
MAX_STRUCTURED_BYTES = 256 * 1024  # what one constraint may weigh on the wire


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

    def __post_init__(self) -> None:
        if self.top_k == -1:
            self.top_k = 0
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
        self.validate()

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise ValueError naming the field and its limit."""
        _check(self.max_tokens >= 1, f"max_tokens must be >= 1, got {self.max_tokens}")
        _check(0 <= self.min_tokens <= self.max_tokens,
               f"min_tokens must be between 0 and max_tokens ({self.max_tokens}), got {self.min_tokens}")
        _check(0.0 <= self.temperature <= 2.0, f"temperature must be between 0 and 2, got {self.temperature}")
        _check(0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}")
        _check(self.top_k >= 0, f"top_k must be -1, 0 or positive, got {self.top_k}")
        _check(0.0 <= self.min_p <= 1.0, f"min_p must be between 0 and 1, got {self.min_p}")
        _check(-2.0 <= self.presence_penalty <= 2.0,
               f"presence_penalty must be between -2 and 2, got {self.presence_penalty}")
        _check(-2.0 <= self.frequency_penalty <= 2.0,
               f"frequency_penalty must be between -2 and 2, got {self.frequency_penalty}")
        _check(0.0 < self.repetition_penalty <= 2.0,
               f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}")
        _check(self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS,
               f"logprobs must be between 0 and {MAX_LOGPROBS}, got {self.logprobs}")
        _check(self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= MAX_LOGPROBS,
               f"prompt_logprobs must be between 0 and {MAX_LOGPROBS}, got {self.prompt_logprobs}")
        _check(len(self.stop) <= MAX_STOP_STRINGS,
               f"stop may hold at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}")
        for s in self.stop:
            _check(isinstance(s, str) and 0 < len(s) <= MAX_STOP_STRING_CHARS,
                   f"each stop string must have 1 to {MAX_STOP_STRING_CHARS} characters")
        for token_id, bias in self.logit_bias.items():
            _check(-100.0 <= bias <= 100.0, f"logit_bias values must be between -100 and 100, got {bias}")
            if vocab_size is not None:
                _check(0 <= token_id < vocab_size,
                       f"logit_bias token id {token_id} is outside the vocabulary (0..{vocab_size - 1})")
        if self.structured is not None:
            validate_structured(self.structured)
        if vocab_size is not None:
            for token_id in self.stop_token_ids:
                _check(0 <= token_id < vocab_size,
                       f"stop_token_ids entry {token_id} is outside the vocabulary (0..{vocab_size - 1})")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def needs_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}

    @classmethod
    def from_dict(cls, d: dict) -> "SamplingParams":
        known = {k: v for k, v in d.items() if k in cls.__dataclass_fields__}
        return cls(**known)

    @classmethod
    def from_wire(cls, d: object) -> "SamplingParams":
        """Parameters as they travel in JSON (a queue entry), type-checked field by field before anything is
        built from them: ints are ints (not floats, not bools), numbers are finite, lists hold what they
        should. Unknown fields are ignored (a newer sender). Raises ValueError naming the field."""
        _check(isinstance(d, dict), f"params must be an object, got {type(d).__name__}")
        typed = {}
        for name, value in d.items():
            kind = _WIRE_KINDS.get(name)
            if kind is not None:
                typed[name] = kind(name, value)
        return cls(**typed)


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def spec_key(spec: dict) -> str:
    """A constraint's identity: its canonical JSON (the grammar cache's key)."""
    return json.dumps(spec, sort_keys=True, separators=(",", ":"))


def validate_structured(spec: object) -> None:
    """A constraint's shape (cheap, no xgrammar); compiling it says the rest. ValueError naming the problem."""
    _check(isinstance(spec, dict) and spec.get("type") in STRUCTURED_KINDS,
           f"structured must be an object whose type is one of {', '.join(STRUCTURED_KINDS)}")
    kind, value = spec["type"], spec.get("value")
    if kind == "choice":
        _check(isinstance(value, list) and bool(value) and all(isinstance(v, str) and v for v in value),
               "structured choice needs a non-empty list of non-empty strings")
    elif kind in ("json_schema", "structural_tag"):
        _check(isinstance(value, (dict, str)), f"structured {kind} needs an object")
    elif kind != "json_object":
        _check(isinstance(value, str) and bool(value), f"structured {kind} needs a non-empty string")
    _check(len(spec_key(spec)) <= MAX_STRUCTURED_BYTES,
           f"structured {kind} is larger than {MAX_STRUCTURED_BYTES} bytes")


# -- wire types (see SamplingParams.from_wire) -----------------------------------------------------

MAX_WIRE_INT = 2**63 - 1
MAX_STOP_TOKEN_IDS = 1024
MAX_TOKEN_ID = 2**31 - 1


def _int(name: str, value: object, low: int = -MAX_WIRE_INT - 1, high: int = MAX_WIRE_INT) -> int:
    _check(type(value) is int, f"{name} must be an integer, got {type(value).__name__}")
    _check(low <= value <= high, f"{name} must be between {low} and {high}, got {value}")
    return value


def _optional_int(name: str, value: object) -> int | None:
    return None if value is None else _int(name, value)


def _number(name: str, value: object) -> float:
    _check(type(value) in (int, float), f"{name} must be a number, got {type(value).__name__}")
    _check(math.isfinite(value), f"{name} must be finite, got {value}")
    return float(value)


def _bool(name: str, value: object) -> bool:
    _check(type(value) is bool, f"{name} must be true or false, got {type(value).__name__}")
    return value


def _token_ids(name: str, value: object) -> list[int]:
    _check(type(value) is list, f"{name} must be a list of token ids, got {type(value).__name__}")
    _check(len(value) <= MAX_STOP_TOKEN_IDS, f"{name} may hold at most {MAX_STOP_TOKEN_IDS} ids, got {len(value)}")
    return [_int(f"each {name} entry", t, 0, MAX_TOKEN_ID) for t in value]


def _strings(name: str, value: object) -> list[str]:
    if type(value) is str:
        value = [value]
    _check(type(value) is list and all(type(s) is str for s in value), f"{name} must be a list of strings")
    return value


def _logit_bias(name: str, value: object) -> dict[int, float]:
    _check(type(value) is dict, f"{name} must be an object mapping token ids to numbers")
    out = {}
    for key, bias in value.items():
        _check(type(key) is str and key.isascii() and key.isdigit() and len(key) <= 10,
               f"{name} keys must be token ids written in digits, got {key!r}")
        out[int(key)] = _number(f"{name}[{key}]", bias)
    return out


def _structured(name: str, value: object) -> dict:
    validate_structured(value)
    return value


_WIRE_KINDS = {
    "max_tokens": lambda n, v: _int(n, v, 1, MAX_TOKEN_ID),
    "min_tokens": lambda n, v: _int(n, v, 0, MAX_TOKEN_ID),
    "top_k": lambda n, v: _int(n, v, -1, MAX_TOKEN_ID),
    "seed": _optional_int,
    "logprobs": _optional_int,
    "prompt_logprobs": _optional_int,
    "temperature": _number, "top_p": _number, "min_p": _number, "presence_penalty": _number,
    "frequency_penalty": _number, "repetition_penalty": _number,
    "logit_bias": _logit_bias,
    "stop": _strings,
    "stop_token_ids": _token_ids,
    "include_stop_str_in_output": _bool,
    "ignore_eos": _bool,
    "structured": lambda n, v: None if v is None else _structured(n, v),
}
