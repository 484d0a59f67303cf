"""OpenAI's Responses API as a translation onto chat completions: a request becomes a chat
request (instructions a system message, input items messages, function tools chat tools), and
the chat reply becomes a Response object, or its SSE chunks become the Responses events
(response.created, response.output_item.added, response.output_text.delta, ...,
response.completed)."""

from __future__ import annotations

import json
import time
import uuid

import msgspec
from pydantic import ValidationError

from flashlet.server.errors import ApiError
from flashlet.server.frontend import EventStream
from flashlet.server.protocol import ChatCompletionRequest
from flashlet.server.protocol_extra import (InputFunctionCall, InputFunctionCallOutput,
                                            InputReasoning, NamedFunctionChoice,
                                            ResponsesRequest)

# Chat's field names -> the Responses request's, for error messages.
FIELD_NAMES = {"messages": "input", "max_completion_tokens": "max_output_tokens",
               "response_format": "text"}


def responses_field(name: str | None) -> str | None:
    """A chat request's field name as the Responses request's (the same where it has no other)."""
    return FIELD_NAMES.get(name, name)


def in_responses_terms(message: str) -> str:
    """A chat request's error message with the Responses request's field names."""
    for chat_name, name in FIELD_NAMES.items():
        message = message.replace(f"{chat_name}:", f"{name}:")
    return message


def responses_error(error: ApiError) -> ApiError:
    """An error the chat endpoint raised for the translated request, named as the Responses
    request's fields (a prompt too long for the context is `input`'s, not `messages`')."""
    return ApiError(error.status, in_responses_terms(error.message), responses_field(error.param),
                    error.code, error.headers)


# ---- request ---------------------------------------------------------------------------------
def chat_messages(body: ResponsesRequest) -> list[dict]:
    messages = [{"role": "system", "content": body.instructions}] if body.instructions else []
    if isinstance(body.input, str):
        return messages + [{"role": "user", "content": body.input}]
    for item in body.input:
        if isinstance(item, InputReasoning):
            continue
        if isinstance(item, InputFunctionCall):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls"):
                last["tool_calls"].append(call)  # parallel calls: one assistant turn
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif isinstance(item, InputFunctionCallOutput):
            messages.append({"role": "tool", "tool_call_id": item.call_id,
                             "content": item.output})
        else:
            messages.append({"role": item.role, "content": item.text})
    return messages


def chat_body(body: ResponsesRequest) -> ChatCompletionRequest:
    """The chat request that computes this response; 400 naming the Responses field if the
    translation is refused."""
    fields = {"model": body.model, "messages": chat_messages(body), "stream": body.stream,
              "temperature": body.temperature, "top_p": body.top_p,
              "max_completion_tokens": body.max_output_tokens, "user": body.user,
              "parallel_tool_calls": body.parallel_tool_calls}
    if body.stream:
        fields["stream_options"] = {"include_usage": True}
    if body.tools:
        fields["tools"] = [{"type": "function", "function": t.model_dump(
            exclude_none=True, by_alias=True, exclude={"type"})} for t in body.tools]
    choice = body.tool_choice
    if choice is not None:
        fields["tool_choice"] = ({"type": "function", "function": {"name": choice.name}}
                                 if isinstance(choice, NamedFunctionChoice) else choice)
    fmt = body.text.format if body.text else None
    if fmt is not None:
        fields["response_format"] = {"type": fmt.type} if fmt.type != "json_schema" else {
            "type": "json_schema", "json_schema": {"name": fmt.name, "schema": fmt.schema_}}
    if not fields["messages"]:
        raise ApiError(400, "input: holds no message for the model (reasoning items are not "
                            "shown to it again)", "input")
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValidationError as e:
        error = e.errors()[0]
        message = in_responses_terms(error["msg"].removeprefix("Value error, "))
        if error["loc"]:
            param = responses_field(str(error["loc"][0]))
            raise ApiError(400, f"{param}: {message}", param) from None
        # A check of the whole request: its message begins with the field it names.
        named, colon, _ = message.partition(":")
        param = named if colon and named.isidentifier() else "input"
        raise ApiError(400, message if param == named else f"input: {message}", param) from None


# ---- response --------------------------------------------------------------------------------
def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def message_item(text: str, status: str = "completed") -> dict:
    return {"type": "message", "id": _id("msg"), "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [],
                         "logprobs": []}]}


def reasoning_item(text: str) -> dict:
    return {"type": "reasoning", "id": _id("rs"), "summary": [],
            "content": [{"type": "reasoning_text", "text": text}]}


def function_call_item(call: dict) -> dict:
    return {"type": "function_call", "id": _id("fc"), "call_id": call["id"],
            "name": call["function"]["name"], "arguments": call["function"]["arguments"],
            "status": "completed"}


def response_object(body: ResponsesRequest, response_id: str, created: int, status: str,
                    output: list[dict], usage: dict | None, finish_reason: str | None) -> dict:
    incomplete = ({"reason": "max_output_tokens"} if finish_reason == "length" else None)
    if incomplete and status == "completed":
        status = "incomplete"
    return {
        "id": response_id, "object": "response", "created_at": created, "status": status,
        "error": None, "incomplete_details": incomplete, "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens, "model": body.model, "output": output,
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "previous_response_id": None, "store": body.store,
        "temperature": body.temperature, "top_p": body.top_p,
        "text": {"format": {"type": "text"}} if body.text is None
        else body.text.model_dump(exclude_none=True, by_alias=True),
        "tool_choice": (body.tool_choice.model_dump() if isinstance(
            body.tool_choice, NamedFunctionChoice) else body.tool_choice or "auto"),
        "tools": [t.model_dump(exclude_none=True) for t in body.tools or ()],
        "truncation": "disabled", "metadata": body.metadata or {}, "user": body.user,
        "usage": usage and _usage(usage)}


def _usage(chat_usage: dict) -> dict:
    cached = (chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"input_tokens": chat_usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": chat_usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": chat_usage["total_tokens"]}


def response_of_chat(body: ResponsesRequest, chat: dict, created: int) -> dict:
    choice = chat["choices"][0]
    message, output = choice["message"], []
    if message.get("reasoning_content"):
        output.append(reasoning_item(message["reasoning_content"]))
    if message.get("content"):
        output.append(message_item(message["content"]))
    output += [function_call_item(c) for c in message.get("tool_calls") or ()]
    return response_object(body, _id("resp"), created, "completed", output, chat["usage"],
                           choice["finish_reason"])


# ---- streamed --------------------------------------------------------------------------------
class ResponseEvents:
    """Chat chunks in, Responses events out: an output item is opened when its first text
    arrives and closed when another kind begins or the reply ends."""

    def __init__(self, body: ResponsesRequest, created: int):
        self.body, self.created = body, created
        self.response_id = _id("resp")
        self.sequence = 0
        self.output: list[dict] = []
        self.open: dict | None = None  # the reasoning or message item being written
        self.finish_reason: str | None = None
        self.usage: dict | None = None
        self.failed = False

    def event(self, kind: str, **fields) -> bytes:
        payload = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return (f"event: {kind}\ndata: ".encode() + msgspec.json.encode(payload) + b"\n\n")

    def response(self, status: str) -> dict:
        return response_object(self.body, self.response_id, self.created, status, self.output,
                               self.usage, self.finish_reason)

    def start(self) -> list[bytes]:
        return [self.event("response.created", response=self.response("in_progress")),
                self.event("response.in_progress", response=self.response("in_progress"))]

    def chunk(self, chunk: dict) -> list[bytes]:
        if "error" in chunk:  # named as the Responses request's fields (responses_error)
            self.failed = True
            error = chunk["error"]
            return [self.event("error", message=in_responses_terms(error["message"]),
                               code=error.get("code"),
                               param=responses_field(error.get("param")))]
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        events = []
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta") or {}
            if delta.get("reasoning_content"):
                events += self._text("reasoning", delta["reasoning_content"])
            if delta.get("content"):
                events += self._text("message", delta["content"])
            for call in delta.get("tool_calls") or ():
                events += self._close() + self._function_call(call)
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
        return events

    def finish(self) -> list[bytes]:
        status = ("failed" if self.failed else
                  "incomplete" if self.finish_reason == "length" else "completed")
        kind = f"response.{status}"
        return self._close() + [self.event(kind, response=self.response(status))]

    def _text(self, kind: str, text: str) -> list[bytes]:
        events = []
        if self.open is None or self.open["type"] != kind:
            events += self._close()
            self.open = (message_item("", "in_progress") if kind == "message"
                         else reasoning_item(""))
            events += self._item_added()
        part = self.open["content"][0]
        part["text"] += text
        name = ("response.output_text.delta" if kind == "message"
                else "response.reasoning_text.delta")
        extra = {"logprobs": []} if kind == "message" else {}
        return events + [self.event(name, item_id=self.open["id"],
                                    output_index=len(self.output), content_index=0, delta=text,
                                    **extra)]

    def _item_added(self) -> list[bytes]:
        item, index = self.open, len(self.output)
        events = [self.event("response.output_item.added", output_index=index,
                             item={**item, "content": []})]
        empty = {**item["content"][0], "text": ""}
        return events + [self.event("response.content_part.added", item_id=item["id"],
                                    output_index=index, content_index=0, part=empty)]

    def _close(self) -> list[bytes]:
        item, self.open = self.open, None
        if item is None:
            return []
        index, part = len(self.output), item["content"][0]
        if item["type"] == "message":
            item["status"] = "completed"
            done = self.event("response.output_text.done", item_id=item["id"],
                              output_index=index, content_index=0, text=part["text"],
                              logprobs=[])
        else:
            done = self.event("response.reasoning_text.done", item_id=item["id"],
                              output_index=index, content_index=0, text=part["text"])
        self.output.append(item)
        return [done,
                self.event("response.content_part.done", item_id=item["id"],
                           output_index=index, content_index=0, part=part),
                self.event("response.output_item.done", output_index=index, item=item)]

    def _function_call(self, call: dict) -> list[bytes]:
        item, index = function_call_item(call), len(self.output)
        self.output.append(item)
        return [self.event("response.output_item.added", output_index=index,
                           item={**item, "arguments": "", "status": "in_progress"}),
                self.event("response.function_call_arguments.delta", item_id=item["id"],
                           output_index=index, delta=item["arguments"]),
                self.event("response.function_call_arguments.done", item_id=item["id"],
                           output_index=index, arguments=item["arguments"]),
                self.event("response.output_item.done", output_index=index, item=item)]


def stream_of_chat(body: ResponsesRequest, chat_stream: EventStream,
                   created: int | None = None) -> EventStream:
    """The chat stream's chunks re-told as Responses events (its requests aborted with it)."""
    events = ResponseEvents(body, created or int(time.time()))

    async def translate():
        for e in events.start():
            yield e
        async for raw in chat_stream.body_iterator:
            for line in (raw.decode() if isinstance(raw, bytes) else raw).splitlines():
                data = line.removeprefix("data: ").strip()
                if not line.startswith("data: ") or data == "[DONE]":
                    continue
                for e in events.chunk(json.loads(data)):
                    yield e
        for e in events.finish():
            yield e

    return EventStream(translate(), chat_stream.generations)
