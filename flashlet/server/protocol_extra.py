"""Request bodies of the endpoints beyond completions: /tokenize and /detokenize (vLLM's
shapes), /v1/responses (OpenAI's Responses API, the subset that maps onto chat) and
/v1/embeddings. Strict like protocol.py's: unknown fields, wrong types and NaN are 400s."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import AfterValidator, Field, model_validator

from flashlet.server.protocol import (MAX_TOOLS, ChatMessage, JsonSchema, MaxTokens, Metadata,
                                      NonEmptyText, NullIsTheDefault, TemplateKwargs, Temperature,
                                      Text, TokenIds, Tool, TopP, _json_object_text, _Strict,
                                      template_ending)

MAX_EMBEDDING_INPUTS = 64
FunctionName = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")]


# ---- /tokenize, /detokenize ---------------------------------------------------------------
class TokenizeRequest(_Strict):
    """vLLM's two shapes in one body: a `prompt`, or `messages` through the chat template."""

    model: Text | None = None
    prompt: Text | None = None
    add_special_tokens: bool | None = None  # prompt only (default true)
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    add_generation_prompt: bool | None = None  # messages only (default true)
    continue_final_message: bool | None = None  # messages only: the last message left open
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None
    chat_template_kwargs: TemplateKwargs | None = None
    return_token_strs: bool = False  # each token's vocabulary string too (vLLM's)

    @model_validator(mode="after")
    def _prompt_or_messages(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("prompt: give a prompt or messages (one of them)")
        chat_only = ("add_generation_prompt", "continue_final_message", "tools", "chat_template_kwargs")
        for name in chat_only if self.messages is None else ("add_special_tokens",):
            if getattr(self, name) is not None:
                raise ValueError(f"{name}: only with "
                                 f"{'messages' if self.messages is None else 'prompt'}")
        template_ending(self)  # checked here: a 400 naming the field
        return self


class DetokenizeRequest(_Strict):
    model: Text | None = None
    tokens: Annotated[list[Annotated[int, Field(ge=0)]], Field(max_length=1 << 20)]


# ---- /v1/responses ------------------------------------------------------------------------
class InputText(_Strict):
    type: Literal["input_text", "output_text"]
    text: Text
    # On output_text sent back from an earlier response's output.
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class InputMessage(_Strict):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: Text | Annotated[list[InputText], Field(min_length=1)]
    id: Text | None = None
    status: Text | None = None

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(
            p.text for p in self.content)


class InputFunctionCall(_Strict):
    type: Literal["function_call"]
    call_id: NonEmptyText
    name: NonEmptyText
    arguments: Annotated[Text, AfterValidator(_json_object_text)]
    id: Text | None = None
    status: Text | None = None


class InputFunctionCallOutput(_Strict):
    type: Literal["function_call_output"]
    call_id: NonEmptyText
    output: Text
    id: Text | None = None
    status: Text | None = None


class InputReasoning(_Strict):
    """An earlier response's reasoning item, sent back with its output: not shown to the model
    again (as chat templates drop earlier turns' reasoning)."""

    type: Literal["reasoning"]
    id: Text | None = None
    summary: list[Any] = []
    content: list[Any] | None = None
    encrypted_content: Text | None = None
    status: Text | None = None


InputItem = InputMessage | InputFunctionCall | InputFunctionCallOutput | InputReasoning


class FunctionTool(_Strict):
    type: Literal["function"]
    name: FunctionName
    description: Text | None = None
    parameters: JsonSchema | None = None
    strict: bool | None = None


class NamedFunctionChoice(_Strict):
    type: Literal["function"]
    name: NonEmptyText


class TextFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: FunctionName | None = None
    schema_: JsonSchema | None = Field(None, alias="schema")
    description: Text | None = None
    strict: bool | None = None


class TextOptions(_Strict):
    format: TextFormat | None = None


class ResponsesRequest(NullIsTheDefault):
    NULL_IS_THE_DEFAULT: ClassVar[tuple[str, ...]] = ("temperature", "top_p", "stream")
    model: Text | None = None  # optional, as in vLLM: the served model
    input: NonEmptyText | Annotated[list[InputItem], Field(min_length=1)]
    instructions: Text | None = None
    tools: Annotated[list[FunctionTool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunctionChoice | None = None
    max_output_tokens: MaxTokens | None = None
    temperature: Temperature | None = 1.0  # null: the default (NullIsTheDefault)
    top_p: TopP | None = 1.0
    stream: bool | None = False
    store: bool = True  # accepted; nothing is stored (so previous_response_id is refused)
    metadata: Metadata | None = None
    parallel_tool_calls: bool | None = None
    user: Text | None = None
    text: TextOptions | None = None
    truncation: Literal["disabled"] | None = None
    previous_response_id: None = None

    @model_validator(mode="after")
    def _json_schema_needs_one(self):
        fmt = self.text.format if self.text else None
        if fmt is not None and fmt.type == "json_schema" and (fmt.schema_ is None or not fmt.name):
            raise ValueError("text: format json_schema needs a name and a schema")
        return self


# ---- /v1/embeddings -----------------------------------------------------------------------
class EmbeddingRequest(_Strict):
    model: Text | None = None  # optional, as in vLLM: the served model
    input: (NonEmptyText | TokenIds
            | Annotated[list[NonEmptyText], Field(min_length=1, max_length=MAX_EMBEDDING_INPUTS)]
            | Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_EMBEDDING_INPUTS)])
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: None = None  # matryoshka truncation is not implemented
    user: Text | None = None

    @property
    def inputs(self) -> list:
        """The inputs, as a list (one string or token-id list each)."""
        x = self.input
        if isinstance(x, str) or isinstance(x[0], int):
            return [x]
        return list(x)
