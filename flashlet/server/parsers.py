"""Reply parsers: tool calls (`--tool-call-parser`) and reasoning (`--reasoning-parser`) taken
out of a chat reply's text, whole (`extract`) or as it streams (`ToolCallStream`,
`ReasoningStream`). vLLM's parser names: `hermes` (Qwen2.5 / Qwen3's
`<tool_call>{...}</tool_call>`), `llama3_json` (Llama 3.x's JSON call), `mistral` (`[TOOL_CALLS][...]`); `qwen3` and
`deepseek_r1` for `<think>...</think>`.

A streamed reply gives the same message as the whole one: content streams as it comes until
a tool call may have begun (text that could be the start of a marker is held back); each call
goes out whole in OpenAI's chunk shape (index, id, type, function) as soon as it is closed
(hermes' `</tool_call>`), or once the reply ends (the syntaxes with no closing marker).
"""

from __future__ import annotations

import json
import re
import secrets
import string
import uuid
from dataclasses import dataclass


# ---- tool calls ------------------------------------------------------------------------------
def _call(name: str, arguments, call_id: str | None = None) -> dict:
    """One OpenAI tool call; arguments as JSON text, as OpenAI sends them."""
    return {"id": call_id or f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": arguments if isinstance(arguments, str)
                         else json.dumps(arguments, ensure_ascii=False)}}


def _json_values(text: str) -> list | None:
    """The JSON values written one after another in `text` (separated by whitespace or `;`,
    Llama 3's separator), or None if anything else is there."""
    decoder, values, pos = json.JSONDecoder(), [], 0
    while True:
        while pos < len(text) and (text[pos].isspace() or text[pos] == ";"):
            pos += 1
        if pos == len(text):
            return values
        try:
            value, pos = decoder.raw_decode(text, pos)
        except ValueError:
            return None
        values.append(value)


def _named_calls(objects: list, arguments_keys: tuple[str, ...], make_id=None) -> list[dict]:
    """{"name": ..., "arguments": {...}} objects -> tool calls; [] unless every one is such."""
    calls = []
    for obj in objects:
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
            return []
        arguments = next((obj[k] for k in arguments_keys if k in obj), {})
        if not isinstance(arguments, (dict, str)):
            return []
        calls.append(_call(obj["name"], arguments, make_id() if make_id else None))
    return calls


class ToolParser:
    """One model family's tool-call syntax. `extract` parses a whole reply; the markers say
    where a call may begin, for streaming: `markers` anywhere, `start_markers` only as the
    reply's first non-blank text."""

    name: str
    markers: tuple[str, ...] = ()
    start_markers: tuple[str, ...] = ()
    closing_marker: str | None = None  # ends each call, where the syntax has one

    def extract(self, text: str) -> tuple[str | None, list[dict]]:
        """(the content left, the calls); the whole text as content when it holds no
        well-formed call (a malformed one is never half-parsed)."""
        raise NotImplementedError

    def closed_calls(self, text: str) -> list[dict]:
        """The calls a reply still streaming has finished writing, for syntaxes that close
        each call (none here: the others are parsed once the reply ends)."""
        return []


class HermesToolParser(ToolParser):
    name = "hermes"
    markers = ("<tool_call>",)
    closing_marker = "</tool_call>"
    BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)

    def extract(self, text):
        calls = self.closed_calls(text)
        if not calls:
            return text, []
        return self.BLOCK.sub("", text).strip() or None, calls

    def closed_calls(self, text):
        """Every closed `<tool_call>` block's call ([] if any is malformed)."""
        values = [_json_values(b) for b in self.BLOCK.findall(text)]
        if any(v is None or len(v) != 1 for v in values):
            return []
        return _named_calls([v[0] for v in values], ("arguments",))


class Llama3JsonToolParser(ToolParser):
    """Llama 3.1-3.3's JSON tool calls: the reply is `{"name": ..., "parameters": {...}}`
    (several separated by `;`), maybe after `<|python_tag|>` (a special token, so usually
    already dropped from the text)."""

    name = "llama3_json"
    start_markers = ("<|python_tag|>", "{")

    def extract(self, text):
        body = text.strip().removeprefix("<|python_tag|>")
        values = _json_values(body) if body.startswith("{") else None
        calls = _named_calls(values, ("parameters", "arguments")) if values else []
        return (None, calls) if calls else (text, [])


def _mistral_id() -> str:
    # Mistral's chat templates require 9 alphanumeric characters.
    return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))


class MistralToolParser(ToolParser):
    """Mistral's `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`, and the newer
    `[TOOL_CALLS]name[ARGS]{...}`. `[TOOL_CALLS]` is a special token in most Mistral tokenizers,
    which decoding drops: a reply that *starts* with such a JSON list is taken as calls too."""

    name = "mistral"
    markers = ("[TOOL_CALLS]",)
    start_markers = ("[",)
    NAMED = re.compile(r"([A-Za-z0-9_-]+)\[ARGS\]")

    def extract(self, text):
        head, marker, tail = text.partition("[TOOL_CALLS]")
        if not marker:
            head, tail = "", text.strip()
            if not tail.startswith("["):
                return text, []
        calls = self._calls(tail.strip())
        return ((head.strip() or None), calls) if calls else (text, [])

    def _calls(self, text: str) -> list[dict]:
        values = _json_values(text)
        if values is not None:
            return _named_calls([o for v in values for o in (v if isinstance(v, list) else [v])],
                                ("arguments",), _mistral_id)
        calls, pos = [], 0  # name[ARGS]{...} repeated
        while pos < len(text):
            m = self.NAMED.match(text, pos)
            if not m:
                return []
            try:
                arguments, pos = json.JSONDecoder().raw_decode(text, m.end())
            except ValueError:
                return []
            if not isinstance(arguments, dict):
                return []
            calls.append(_call(m.group(1), arguments, _mistral_id()))
            pos = len(text) - len(text[pos:].lstrip().removeprefix("[TOOL_CALLS]").lstrip())
        return calls


TOOL_PARSERS = {p.name: p for p in (HermesToolParser, Llama3JsonToolParser, MistralToolParser)}


def _build(registry: dict, kind: str, name: str):
    """A new parser of `registry` by name; a ValueError naming the known ones otherwise."""
    try:
        return registry[name]()
    except KeyError:
        raise ValueError(f"unknown {kind} {name!r}; known: {', '.join(registry)}") from None


def tool_parser(name: str) -> ToolParser:
    return _build(TOOL_PARSERS, "tool-call parser", name)


def default_tool_parser(chat_template: str | None) -> str:
    """The parser a chat template's own syntax calls for: Llama 3's `<|python_tag|>` /
    header-id templates, Mistral's `[TOOL_CALLS]`, else hermes (Qwen2.5 / Qwen3's tags, and
    the syntax forced tool calls are made in)."""
    template = chat_template or ""
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<tool_call>" not in template and ("<|python_tag|>" in template
                                          or "<|start_header_id|>" in template):
        return "llama3_json"
    return "hermes"


def _partial_suffix(text: str, markers: tuple[str, ...]) -> int:
    """The length of the longest end of `text` that a marker starts with (to hold back)."""
    best = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(text)), best, -1):
            if text.endswith(marker[:n]):
                best = n
                break
    return best


@dataclass
class ToolCallStream:
    """Streams a reply's content until a tool call may have begun, then holds the rest, and
    each call as soon as it is closed (hermes' blocks); at the end (`finish`) the whole reply
    is parsed as `extract` does, and what is left is sent."""

    parser: ToolParser
    text: str = ""
    sent: int = 0  # characters of `text` sent as content
    started: bool = False
    calls_sent: int = 0
    sent_calls_end: int = 0  # where the last call sent ends in `text`

    def push(self, delta: str) -> tuple[str, list[dict]]:
        """(new content that is safe to send now, calls closed since the last push)."""
        self.text += delta
        out = ""
        if not self.started:
            end = self._safe_end()
            out, self.sent = self.text[self.sent:end], max(self.sent, end)
        end = self.parser.closing_marker
        # Parse again only when a call may just have closed (not once per token).
        if not self.started or end is None or end not in self.text[-(len(delta) + len(end)):]:
            return out, []
        new = self._indexed(self.parser.closed_calls(self.text))
        for _ in new:
            self.sent_calls_end = self.text.index(end, self.sent_calls_end) + len(end)
        return out, new

    def _indexed(self, calls: list[dict]) -> list[dict]:
        """The calls not sent yet, each with its index in the reply (OpenAI's chunk shape)."""
        new = [{"index": k, **c} for k, c in enumerate(calls) if k >= self.calls_sent]
        self.calls_sent = max(self.calls_sent, len(calls))
        return new

    def _safe_end(self) -> int:
        text, p = self.text, self.parser
        if self.sent == 0 and p.start_markers:  # nothing sent yet: a call may open the reply
            stripped = text.lstrip()
            if any(stripped.startswith(m) for m in p.start_markers):
                self.started = True
                return 0
            if not stripped or any(m.startswith(stripped) for m in p.start_markers):
                return 0
        found = [i for i in (text.find(m, self.sent) for m in p.markers) if i >= 0]
        if found:
            self.started = True
            return min(found)
        return len(text) - _partial_suffix(text, p.markers)

    def finish(self) -> tuple[str, list[dict]]:
        """(the content not sent yet, the calls not sent yet)."""
        content, calls = self.parser.extract(self.text)
        if not calls:
            if self.calls_sent:  # a malformed call after sent ones: the text after those
                return self.text[self.sent_calls_end:], []
            return self.text[self.sent:], []
        sent = self.text[:self.sent].strip()  # extract's content is stripped
        content = content or ""
        rest = content[len(sent):] if content.startswith(sent) else ""
        return rest, self._indexed(calls)


# ---- reasoning -------------------------------------------------------------------------------
class ReasoningParser:
    """`<think>reasoning</think>content`. Qwen3 writes the opening tag itself (no tag: no
    reasoning, as with enable_thinking false); DeepSeek-R1's template puts it in the prompt,
    so its reply is reasoning until `</think>`."""

    name: str
    START, END = "<think>", "</think>"
    implicit_start: bool  # reasoning even without the opening tag

    def split(self, text: str, final: bool = True) -> tuple[str | None, str | None]:
        """(reasoning, content) of a reply; `final=False` for a reply still streaming, whose
        end may be the start of a tag (not yet placed)."""
        stripped = text.lstrip()
        opened = stripped.startswith(self.START)
        if not final and not opened and self.START.startswith(stripped):
            return None, None  # maybe the opening tag, still coming
        if opened:
            text = stripped[len(self.START):]
        elif not self.implicit_start:
            return None, text
        head, closed, tail = text.partition(self.END)
        if not closed:
            if not final:
                head = head[:len(head) - _partial_suffix(head, (self.END,))]
            return head, None
        return head, tail.lstrip() or None


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"
    implicit_start = False


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek_r1"
    implicit_start = True


REASONING_PARSERS = {p.name: p for p in (Qwen3ReasoningParser, DeepSeekR1ReasoningParser)}


def reasoning_parser(name: str) -> ReasoningParser:
    return _build(REASONING_PARSERS, "reasoning parser", name)


@dataclass
class ReasoningStream:
    """A streaming reply split into reasoning and content deltas: each push re-splits the text
    so far and sends what grew (both parts only ever grow)."""

    parser: ReasoningParser
    text: str = ""
    sent_reasoning: int = 0
    sent_content: int = 0

    def push(self, delta: str, final: bool = False) -> tuple[str, str]:
        """(new reasoning, new content)."""
        self.text += delta
        reasoning, content = self.parser.split(self.text, final)
        reasoning, content = reasoning or "", content or ""
        new = reasoning[self.sent_reasoning:], content[self.sent_content:]
        self.sent_reasoning, self.sent_content = len(reasoning), len(content)
        return new


# ---- a chat reply, whole or streamed -----------------------------------------------------------
@dataclass
class ReplyParsers:
    """The parsers one chat request's reply goes through: reasoning first (its content is what
    tool calls are looked for in), then tool calls (None when the request has no tools)."""

    tool: ToolParser | None = None
    reasoning: ReasoningParser | None = None
    max_calls: int | None = None  # 1: the request's parallel_tool_calls is false

    def message(self, text: str, finish_reason: str) -> tuple[dict, str]:
        """The assistant message and the finish reason ("tool_calls" when it called)."""
        reasoning, content = self.reasoning.split(text) if self.reasoning else (None, text)
        calls = []
        if self.tool is not None and content:
            content, calls = self.tool.extract(content)
            calls = calls[:self.max_calls]
        message = {"role": "assistant", "content": content}
        if self.reasoning is not None:
            message["reasoning_content"] = reasoning
        if not calls:
            return message, finish_reason
        message["tool_calls"] = calls
        return message, "tool_calls" if finish_reason == "stop" else finish_reason

    @property
    def active(self) -> bool:
        return self.tool is not None or self.reasoning is not None

    def stream(self) -> "ReplyStream":
        return ReplyStream(self.tool and ToolCallStream(self.tool),
                           self.reasoning and ReasoningStream(self.reasoning), self.max_calls)


@dataclass
class ReplyStream:
    tools: ToolCallStream | None
    reasoning: ReasoningStream | None
    max_calls: int | None = None  # calls past it (their chunk index) are not sent

    @property
    def called(self) -> bool:
        """Some tool call was sent (the finish reason is then "tool_calls")."""
        return self.tools is not None and self.tools.calls_sent > 0

    def push(self, text: str, final: bool = False) -> dict:
        """A chunk's delta for new text (empty when nothing can be sent yet); `final` for the
        last, which also carries the tool calls."""
        reasoning, content = self.reasoning.push(text, final) if self.reasoning else ("", text)
        delta = {"reasoning_content": reasoning} if reasoning else {}
        calls = []
        if self.tools is not None:
            content, calls = self.tools.push(content)
            if final:
                rest, last = self.tools.finish()
                content, calls = content + rest, calls + last
        if content:
            delta["content"] = content
        if self.max_calls is not None:
            calls = [c for c in calls if c["index"] < self.max_calls]
        if calls:
            delta["tool_calls"] = calls
        return delta


def reply_parsers(tool_call_parser: str | None, reasoning_parser_name: str | None,
                  chat_template: str | None, tool_choice, parallel_tool_calls: bool | None = None) -> ReplyParsers:
    """A chat request's parsers: the server's (or the template's default) tool parser for
    tool_choice "auto"; hermes for forced calls, which the grammar writes in that syntax
    (flashlet/text/structured.py); none without tools."""
    if tool_choice == "none":
        tool = None
    elif tool_choice == "auto":
        tool = tool_parser(tool_call_parser or default_tool_parser(chat_template))
    else:
        tool = HermesToolParser()
    reasoning = reasoning_parser(reasoning_parser_name) if reasoning_parser_name else None
    return ReplyParsers(tool, reasoning, 1 if parallel_tool_calls is False else None)
