"""Tool calls: how tools, calls and results are written into the RWKV chat prompt, the constraint that makes the
model's calls valid, and reading calls back out of the generated text (whole, or as it streams).

The format (README, "Tool calls"): the functions are listed in a system turn; a call is a block

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

(one per call, several for parallel calls), an assistant turn's calls are written back the same way, and a tool's
result is a ``Tool:`` turn. ``tool_choice``: ``auto`` lets the model write text or calls, and once it opens a
block the call is constrained to a listed function's parameter schema (an xgrammar structural tag); ``required``
and a named function constrain the whole answer to calls (to that function); ``none`` leaves the tools out.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

from api.errors import bad_request
from api.prompts import CLOSE, OPEN
from api.schemas import NamedToolChoice, Tool
from api.structured import check_schema

CALL_PREFIX = OPEN + '\n{"name": '
ANY_ARGUMENTS = {"type": "object"}


@dataclass
class ToolPlan:
    """What a chat request's tools mean for its prompt, its constraint and its output."""
    prompt: str | None  # the system turn's text listing the functions (None: no tools in the prompt)
    constraint: dict | None  # the structural tag, or None
    parse: bool  # read calls out of the output


NO_TOOLS = ToolPlan(None, None, False)


MAX_TOOLS = 128  # as OpenAI's chat API (each tool's schema is checked, on the event loop)


def plan(tools: list[Tool] | None, choice, parallel: bool | None) -> ToolPlan:
    """400 naming the field for a tool_choice that names no listed function, or a bad parameter schema."""
    if not tools:
        if choice not in (None, "none"):
            raise bad_request("tool_choice needs tools", "tool_choice")
        return NO_TOOLS
    if len(tools) > MAX_TOOLS:
        raise bad_request(f"at most {MAX_TOOLS} tools, got {len(tools)}", "tools")
    for i, tool in enumerate(tools):
        if tool.function.parameters is not None:
            check_schema(tool.function.parameters, f"tools[{i}].function.parameters")
    choice = choice or "auto"
    if choice == "none":
        return NO_TOOLS
    functions = tools
    if isinstance(choice, NamedToolChoice):
        functions = [t for t in tools if t.function.name == choice.function.name]
        if not functions:
            raise bad_request(f"tool_choice names {choice.function.name!r}, which is not among the tools",
                              "tool_choice")
    single = parallel is False or isinstance(choice, NamedToolChoice)
    tags = [_tag(t) for t in functions]
    if choice == "auto":
        fmt = {"type": "triggered_tags", "triggers": [OPEN], "tags": tags, "at_least_one": False,
               "stop_after_first": single}
    else:
        fmt = {"type": "tags_with_separator", "tags": tags, "separator": "\n", "at_least_one": True,
               "stop_after_first": single}
    return ToolPlan(tools_prompt(tools), {"type": "structural_tag", "value": {"type": "structural_tag",
                                                                               "format": fmt}}, True)


def _tag(tool: Tool) -> dict:
    schema = tool.function.parameters or ANY_ARGUMENTS
    return {"type": "tag", "begin": f"{CALL_PREFIX}{json.dumps(tool.function.name)}, \"arguments\": ",
            "content": {"type": "json_schema", "json_schema": schema}, "end": "}\n" + CLOSE}


def tools_prompt(tools: list[Tool]) -> str:
    listed = "\n".join(json.dumps({"name": t.function.name, "description": t.function.description or "",
                                   "parameters": t.function.parameters or ANY_ARGUMENTS}, ensure_ascii=False)
                       for t in tools)
    return ("You can call these functions:\n" + listed + "\nTo call a function, answer with one block per call:\n"
            + OPEN + '\n{"name": "<function name>", "arguments": <the arguments as a JSON object>}\n' + CLOSE)


# -- reading calls back -----------------------------------------------------------------------------

def call_id(request_id: str, choice: int, number: int) -> str:
    """Stable for a request's choice and call: an async request formatted twice shows the same ids."""
    digest = hashlib.sha256(f"{request_id}/{choice}/{number}".encode()).hexdigest()[:24]
    return f"call_{digest}"


def parse_block(body: str) -> tuple[str, str] | None:
    """A block's ``{"name", "arguments"}`` → (name, arguments as a JSON string); None if it is not one."""
    try:
        call = json.loads(body)
    except ValueError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or "arguments" not in call:
        return None
    args = call["arguments"]
    return call["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)


Piece = str | tuple[str, str]  # text, or a call (name, arguments as a JSON string)


def split_calls(text: str, cut: bool = False) -> tuple[str | None, list[tuple[str, str]]]:
    """Generated text → (the text outside the call blocks, or None if there is none; the calls in order), as a
    stream of it assembles, however it is chunked. ``cut``: the text ended at max_tokens."""
    content, calls = CallStream().feed(text, final=True, cut=cut)
    return (content or None), calls


def split_pieces(text: str, cut: bool = False) -> list[Piece]:
    """Generated text → its text and calls in order, adjacent text joined (the Responses API's output items)."""
    pieces: list[Piece] = []
    for piece in CallStream().pieces(text, final=True, cut=cut):
        if isinstance(piece, str) and pieces and isinstance(pieces[-1], str):
            pieces[-1] += piece
        else:
            pieces.append(piece)
    return pieces


class CallStream:
    """Splits streamed text into content and complete calls, so that the stream assembles to exactly the
    split of the whole text however it is chunked. Text that may be the start of a block is held back until it
    is known not to be one; a block's call is passed on once the block closes. Whitespace is held back too: at
    the start, before a call and at the end it is dropped (the separators between parallel calls are not
    content), elsewhere it is passed on with the text that follows it."""

    def __init__(self) -> None:
        self.buffer = ""
        self.in_block = False
        self.started = False  # text has been passed on (until then whitespace is dropped)
        self.space = ""  # whitespace held back

    def feed(self, text: str, final: bool = False, cut: bool = False) -> tuple[str, list[tuple[str, str]]]:
        """(the content to pass on, the calls completed) after ``text``; ``final``: the text ended there
        (``cut``: at max_tokens, so an unfinished block is dropped rather than shown as text)."""
        pieces = self.pieces(text, final, cut)
        return "".join(p for p in pieces if isinstance(p, str)), [p for p in pieces if not isinstance(p, str)]

    def pieces(self, text: str, final: bool = False, cut: bool = False) -> list[Piece]:
        self.buffer += text
        out: list[Piece] = []
        while True:
            if self.in_block:
                end = self.buffer.find(CLOSE)
                if end < 0:
                    break
                body, self.buffer = self.buffer[:end], self.buffer[end + len(CLOSE):]
                self.in_block = False
                parsed = parse_block(body.strip())
                if parsed is not None:
                    self.space = ""
                    out.append(parsed)
                else:  # not a call after all: it stays text
                    self._text(OPEN + body + CLOSE, out)
                continue
            start = self.buffer.find(OPEN)
            if start >= 0:
                self._text(self.buffer[:start], out)
                self.buffer = self.buffer[start + len(OPEN):]
                self.in_block = True
                continue
            held = _partial_suffix(self.buffer, OPEN)
            if final:  # what was held back is text, unless max_tokens cut off a block's start
                if cut:
                    self.buffer = self.buffer[:len(self.buffer) - held]
                held = 0
            self._text(self.buffer[:len(self.buffer) - held], out)
            self.buffer = self.buffer[len(self.buffer) - held:]
            break
        if final:
            if self.in_block and not cut:  # an unclosed block the model ended itself is text after all
                self._text(OPEN + self.buffer, out)
            self.buffer, self.in_block, self.space = "", False, ""
        return out

    def _text(self, text: str, out: list[Piece]) -> None:
        text = self.space + text
        if not self.started:
            text = text.lstrip()
        body = text.rstrip()
        self.space = text[len(body):]
        if body:
            self.started = True
            out.append(body)


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0
