"""Request and response bodies (pydantic), for /generate and the OpenAI-compatible API.

Requests are strict (no "5" for an int, no 1 for a bool), reject unknown fields, NaN and
infinities, and strings that cannot be encoded as UTF-8 (lone surrogates from JSON escapes).
OpenAI parameters that this server accepts but does not implement are only allowed at their
neutral value, so a client never silently gets something other than what it asked for; those
that ask nothing of the output on a self-hosted model (store, metadata, service_tier,
prompt_cache_key, safety_identifier: no store, one tier, a prefix cache needing no key) are
accepted and ignored, and null means the default where OpenAI's API allows it. vLLM's names
for what this server does implement (guided_*, structured_outputs, skip_special_tokens,
include_stop_str_in_output, continue_final_message, ...) are taken as vLLM takes them.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, ClassVar, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from flashlet.core.sampling import MAX_LOGIT_BIAS, MAX_TOP_LOGPROBS
from flashlet.text import structured
from flashlet.text.tokenizing import chat_template_ending

MAX_STOP = 16
DEFAULT_MAX_NEW_TOKENS = 64  # /generate's
MAX_N = 16  # samples per prompt (n, best_of)
MAX_LOGIT_BIAS_ENTRIES = 1024  # token ids one request may bias (a bound on its per-step work)
MAX_PROMPTS = 64  # prompts in one /v1/completions request
MAX_TOOLS = 64


def _utf8(value: str) -> str:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"is not valid Unicode (unpaired surrogate at index {e.start})") from None
    return value


ECHO_CHARS = 100  # of a request's value quoted back in an error message


def echo(value) -> str:
    """A request's value for an error message, in backquotes and cut to ECHO_CHARS
    characters: a client's 1 MB value is not sent back to it (nor written to a log)."""
    text = str(value)
    if len(text) <= ECHO_CHARS:
        return f"`{text}`"
    return f"`{text[:ECHO_CHARS]}`... ({len(text)} characters)"


Text = Annotated[str, AfterValidator(_utf8)]
NonEmptyText = Annotated[str, Field(min_length=1), AfterValidator(_utf8)]
TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]
Stop = NonEmptyText | Annotated[list[NonEmptyText], Field(max_length=MAX_STOP)] | None
Temperature = Annotated[float, Field(ge=0.0, le=2.0)]
TopP = Annotated[float, Field(gt=0.0, le=1.0)]
Seed = Annotated[int, Field(description="Any integer; reduced modulo 2**64 for the sampler")]
MaxTokens = Annotated[int, Field(ge=1)]


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


# OpenAI's `metadata`: up to 16 string pairs (accepted; nothing is stored).
Metadata = Annotated[dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]],
                     Field(max_length=16)]


class _Open(BaseModel):  # responses: never validated from client input
    model_config = ConfigDict(extra="allow")


# ---- errors -------------------------------------------------------------------------------
class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


# ---- /generate ----------------------------------------------------------------------------
class GenerateRequest(_Strict):
    prompt: NonEmptyText | TokenIds = Field(
        description="The prompt: text, or a list of token ids.")
    max_new_tokens: MaxTokens | None = Field(
        None, description=f"Default {DEFAULT_MAX_NEW_TOKENS}, or what the context leaves.")
    max_tokens: MaxTokens | None = Field(None, description="The same as max_new_tokens.")
    temperature: Temperature = 0.0
    top_p: TopP = 1.0
    top_k: Annotated[int, Field(ge=0, le=2**31 - 1)] = 0
    seed: Seed | None = None
    stop: Stop = None
    ignore_eos: bool = False

    @model_validator(mode="after")
    def _one_token_budget(self):
        if self.max_new_tokens is not None and self.max_tokens is not None:
            raise ValueError("max_tokens: give max_new_tokens or max_tokens, not both")
        return self

    @property
    def token_budget(self) -> tuple[int | None, str]:
        """(the max new tokens asked for, None if neither field was sent; that field)."""
        if self.max_tokens is not None:
            return self.max_tokens, "max_tokens"
        return self.max_new_tokens, "max_new_tokens"


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


class GenerateResponse(BaseModel):
    text: str
    token_ids: list[int]  # the generated tokens (all a model without a tokenizer can give)
    finish_reason: str
    usage: Usage
    ttft_ms: float | None
    latency_ms: float


# ---- OpenAI-compatible --------------------------------------------------------------------
class StreamOptions(_Strict):
    include_usage: bool = False


Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]
JsonObject = dict[str, Any]


# The drafts whose meta-schemas are built into jsonschema-rs. Any other `$schema` is refused
# here: the validator would fetch it over the network (a request from the server to any URL).
KNOWN_DRAFTS = {f"{scheme}://json-schema.org/{path}" for scheme in ("http", "https") for path in (
    "draft-04/schema", "draft-06/schema", "draft-07/schema", "draft/2019-09/schema",
    "draft/2020-12/schema")}


def _json_schema(schema: dict) -> dict:
    """A JSON schema, checked against its draft's meta-schema (a typo is an error, not a
    constraint silently ignored)."""
    import jsonschema_rs

    draft = schema.get("$schema")
    if draft is not None and (not isinstance(draft, str)
                              or draft.rstrip("#") not in KNOWN_DRAFTS):
        raise ValueError(f"$schema {draft!r} is not a JSON Schema draft this server knows "
                         "(draft-04, -06, -07, 2019-09, 2020-12)")
    try:
        jsonschema_rs.meta.validate(schema)
    except jsonschema_rs.ValidationError as e:
        raise ValueError(f"is not a valid JSON schema: {e.message}") from None
    except jsonschema_rs.ReferencingError as e:
        raise ValueError(f"is not a valid JSON schema: {e}") from None
    structured.check_json_schema(schema)  # $ref only inside it, 64-bit integers, admits some value
    return schema


def _object_in_text(text: str, what: str) -> dict:
    """The JSON object `text` holds; ValueError saying it must be `what` otherwise."""
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise ValueError(f"must be {what}")
    return value


def _json_object_text(text: str) -> str:
    _object_in_text(text, "a JSON object (as text)")
    return text


JsonSchema = Annotated[JsonObject, AfterValidator(_json_schema)]


def _json_schema_text(text: str) -> dict:
    """vLLM's guided_json may be a schema's JSON text: the schema, checked as a schema is."""
    return _json_schema(_object_in_text(text, "a JSON schema (an object, or its JSON text)"))


JsonSchemaOrText = JsonSchema | Annotated[str, AfterValidator(_json_schema_text)]
MAX_CHOICES = 1024  # guided_choice's options


class StructuredOutputsParams(_Strict):
    """vLLM's `structured_outputs` (its newer name for the guided_* fields): one constraint."""

    json_: JsonSchemaOrText | None = Field(None, alias="json")
    regex: NonEmptyText | None = None
    choice: Annotated[list[NonEmptyText], Field(min_length=1, max_length=MAX_CHOICES)] | None = None
    grammar: NonEmptyText | None = None
    json_object: bool | None = None

    @model_validator(mode="after")
    def _exactly_one(self):
        given = [name for name in ("json_", "regex", "choice", "grammar") if getattr(self, name) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise ValueError("give exactly one of json, regex, choice, grammar, json_object")
        return self


def guided_format(json_schema=None, regex=None, choice=None, grammar=None, json_object=False) -> dict | None:
    """vLLM's structured-output constraint -> the engine's response_format (a regex or a choice
    as an xgrammar structural tag); None for none."""
    if json_schema is not None:
        return {"type": "json_schema", "json_schema": {"schema": json_schema}}
    if regex is not None:
        return {"type": "structural_tag", "format": {"type": "regex", "pattern": regex}}
    if choice is not None:
        return {"type": "structural_tag", "format": {"type": "or", "elements": [
            {"type": "const_string", "value": c} for c in choice]}}
    if grammar is not None:
        return {"type": "grammar", "grammar": grammar}
    return {"type": "json_object"} if json_object else None


class JsonSchemaSpec(_Strict):
    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")]
    description: Text | None = None
    schema_: JsonSchema = Field(alias="schema")
    strict: bool | None = None


class ResponseFormatText(_Strict):
    type: Literal["text"]


class ResponseFormatJsonObject(_Strict):
    type: Literal["json_object"]


class ResponseFormatJsonSchema(_Strict):
    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


ResponseFormat = Annotated[ResponseFormatText | ResponseFormatJsonObject
                           | ResponseFormatJsonSchema, Field(discriminator="type")]


class NullIsTheDefault(_Strict):
    """A request whose fields named in NULL_IS_THE_DEFAULT may be sent as null, as OpenAI's API
    (and vLLM) allow, meaning their default: each such field holds its default from validation
    on, so the rest of the server never sees None there."""

    NULL_IS_THE_DEFAULT: ClassVar[tuple[str, ...]] = ()

    @model_validator(mode="after")
    def _null_is_the_default(self):
        for name in self.NULL_IS_THE_DEFAULT:
            if getattr(self, name) is None:
                setattr(self, name, type(self).model_fields[name].default)
        return self


class _OpenAISampling(NullIsTheDefault):
    model: Text | None = None  # optional, as in vLLM: the served model
    max_tokens: MaxTokens | None = None
    # null: the default (NullIsTheDefault)
    temperature: Temperature | None = 1.0
    top_p: TopP | None = 1.0
    top_k: Annotated[int, Field(ge=-1, le=2**31 - 1)] | None = -1  # an extension (vLLM's): -1 = off
    n: Annotated[int, Field(ge=1, le=MAX_N)] | None = 1
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: Stop = None
    seed: Seed | None = None
    ignore_eos: bool = False  # an extension
    user: Text | None = None
    frequency_penalty: Penalty | None = None
    presence_penalty: Penalty | None = None
    response_format: ResponseFormat | None = None
    # Extensions (vLLM's names).
    repetition_penalty: Annotated[float, Field(ge=0.01, le=100.0)] | None = None  # SamplingParams' range
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    min_tokens: Annotated[int, Field(ge=0)] | None = None
    stop_token_ids: Annotated[list[Annotated[int, Field(ge=0)]],
                              Field(max_length=MAX_STOP * 4)] | None = None
    # With --scheduling-policy priority: lower values run first (vLLM's field).
    priority: Annotated[int, Field(ge=-2**63, lt=2**63)] = 0
    # Each prompt token's logprob and its top k (the first token's is null), as vLLM returns.
    prompt_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    # {token id (a string, as JSON keys are): bias in [-100, 100]}, added to the logits.
    logit_bias: Annotated[dict[Annotated[str, Field(pattern=r"^[0-9]{1,10}$")],
                               Annotated[float, Field(ge=-MAX_LOGIT_BIAS, le=MAX_LOGIT_BIAS)]],
                          Field(max_length=MAX_LOGIT_BIAS_ENTRIES)] | None = None
    # vLLM's: how the text is made (special tokens left in it; the stop string hit kept).
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # vLLM's structured outputs, beside OpenAI's response_format (at most one of them all).
    guided_json: JsonSchemaOrText | None = None
    guided_regex: NonEmptyText | None = None
    guided_choice: Annotated[list[NonEmptyText], Field(min_length=1, max_length=MAX_CHOICES)] | None = None
    guided_grammar: NonEmptyText | None = None
    structured_outputs: StructuredOutputsParams | None = None

    NULL_IS_THE_DEFAULT: ClassVar[tuple[str, ...]] = ("temperature", "top_p", "top_k", "n", "stream")

    @model_validator(mode="after")
    def _stream_options_need_stream(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only allowed when stream is true")
        return self

    @model_validator(mode="after")
    def _one_structured_constraint(self):
        given = [name for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar",
                                   "structured_outputs") if getattr(self, name) is not None]
        if self.response_format is not None and self.response_format.type != "text":
            given.append("response_format")
        if len(given) > 1:
            raise ValueError(f"{given[1]}: give one structured-output constraint, not {' and '.join(given)}")
        return self

    @property
    def structured_format(self) -> dict | None:
        """The engine's response_format for the constraint asked for (OpenAI's response_format
        or vLLM's guided_* / structured_outputs), or None."""
        so = self.structured_outputs
        if so is not None:
            return guided_format(so.json_, so.regex, so.choice, so.grammar, bool(so.json_object))
        guided = guided_format(self.guided_json, self.guided_regex, self.guided_choice, self.guided_grammar)
        if guided is not None:
            return guided
        fmt = self.response_format
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object":
            return {"type": "json_object"}
        return {"type": "json_schema", "json_schema": {"schema": fmt.json_schema.schema_}}


PromptItem = NonEmptyText | TokenIds


class CompletionRequest(_OpenAISampling):
    prompt: PromptItem | Annotated[list[PromptItem], Field(min_length=1, max_length=MAX_PROMPTS)]
    # 0 (the legacy way to score a prompt, with echo and logprobs) generates nothing.
    max_tokens: Annotated[int, Field(ge=0)] | None = None
    echo: bool | None = False  # null: the default (OpenAI's API allows it)
    NULL_IS_THE_DEFAULT: ClassVar[tuple[str, ...]] = _OpenAISampling.NULL_IS_THE_DEFAULT + ("echo",)
    logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    best_of: Annotated[int, Field(ge=1, le=MAX_N)] | None = None
    suffix: None = None

    @model_validator(mode="after")
    def _check_combinations(self):
        if self.best_of is not None and self.best_of < self.n:
            raise ValueError(f"best_of: must be >= n ({self.n}), got {self.best_of}")
        if self.stream and self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of: streaming needs best_of == n (the best samples are "
                             "known only at the end)")
        if self.max_tokens == 0 and self.stream:
            raise ValueError("max_tokens: 0 (score the prompt) cannot be streamed")
        return self

    @property
    def engine_prompt_logprobs(self) -> int | None:
        """The top k the engine scores the prompt with: echo's logprobs, vLLM's
        prompt_logprobs, the larger of the two (None: no prompt scoring)."""
        asked = [k for k in (self.logprobs if self.echo else None, self.prompt_logprobs)
                 if k is not None]
        return max(asked) if asked else None

    @property
    def prompts(self) -> list:
        """The prompts, as a list (one string or token-id list each)."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        return list(p)


class TextPart(_Strict):
    type: Literal["text"]
    text: Text


Content = Text | Annotated[list[TextPart], Field(min_length=1)]


class FunctionCall(_Strict):
    name: NonEmptyText
    arguments: Annotated[Text, AfterValidator(_json_object_text)]  # JSON text, as OpenAI's


class ToolCall(_Strict):
    id: NonEmptyText
    type: Literal["function"]
    function: FunctionCall


class FunctionDefinition(_Strict):
    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")]
    description: Text | None = None
    parameters: JsonSchema | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: NonEmptyText


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class _Message(_Strict):
    name: Text | None = None

    def as_template_dict(self) -> dict[str, Any]:
        content = self.content
        if isinstance(content, list):
            content = "".join(p.text for p in content)
        role = "system" if self.role == "developer" else self.role
        return {"role": role, "content": content or ""}


class SystemMessage(_Message):
    role: Literal["system", "developer"]
    content: Content


class UserMessage(_Message):
    role: Literal["user"]
    content: Content


class AssistantMessage(_Message):
    role: Literal["assistant"]
    content: Content | None = None
    tool_calls: Annotated[list[ToolCall], Field(max_length=MAX_TOOLS)] | None = None  # []: none
    # A reply sent back as the history (what OpenAI's client does with a message it got): its
    # reasoning (this server's and vLLM's reasoning parsers return it) goes to the chat template
    # as HF's templates take it (Qwen3's keeps the last turn's); the rest is not shown the model.
    reasoning_content: Text | None = None
    refusal: Text | None = None
    annotations: Annotated[list[dict[str, Any]], Field(max_length=64)] | None = None
    audio: None = None
    function_call: None = None

    def as_template_dict(self) -> dict[str, Any]:
        message = super().as_template_dict()
        if self.reasoning_content is not None:
            message["reasoning_content"] = self.reasoning_content
        if self.tool_calls:
            # Chat templates (Qwen2.5's, HF's convention) take the arguments as a mapping.
            message["tool_calls"] = [
                {"id": c.id, "type": "function",
                 "function": {"name": c.function.name,
                              "arguments": json.loads(c.function.arguments)}}
                for c in self.tool_calls]
        return message


class ToolMessage(_Message):
    role: Literal["tool"]
    content: Content
    tool_call_id: NonEmptyText

    def as_template_dict(self) -> dict[str, Any]:
        return {**super().as_template_dict(), "tool_call_id": self.tool_call_id}


ChatMessage = Annotated[SystemMessage | UserMessage | AssistantMessage | ToolMessage,
                        Field(discriminator="role")]


# apply_chat_template's own arguments: a template variable of these names would collide.
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length",
    "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"})


def _template_kwargs(kwargs: dict) -> dict:
    for key in kwargs:
        if not key.isidentifier() or key in RESERVED_TEMPLATE_KWARGS:
            raise ValueError(f"{key!r} cannot be a chat template variable")
    return kwargs


TemplateKwargs = Annotated[dict[Annotated[str, Field(max_length=64)], Any],
                           Field(max_length=16), AfterValidator(_template_kwargs)]


def template_ending(body) -> dict:
    """A request's add_generation_prompt (default true) and continue_final_message as
    apply_chat_template takes them (tokenizing.chat_template_ending: ValueError if they clash)."""
    return chat_template_ending(body.add_generation_prompt is not False, bool(body.continue_final_message))


class ChatCompletionRequest(_OpenAISampling):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    chat_template_kwargs: TemplateKwargs | None = Field(
        None, description="More variables for the chat template (vLLM's), e.g. "
                          '{"enable_thinking": false} for Qwen3')
    # vLLM's: the template's assistant opening (default on), or the last message left open for
    # the model to continue (a prefilled reply: needs add_generation_prompt false).
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    max_completion_tokens: MaxTokens | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None  # False: at most one tool call
    # OpenAI's fields that change nothing here, accepted and ignored: a self-hosted model stores
    # nothing, has one service tier, and its prefix cache needs no key.
    store: bool | None = None
    metadata: Metadata | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None
    prompt_cache_key: Text | None = None
    safety_identifier: Text | None = None
    # OpenAI's fields this server does not implement, accepted at their neutral values only.
    modalities: Annotated[list[Literal["text"]], Field(max_length=1)] | None = None
    audio: None = None
    prediction: None = None
    web_search_options: None = None
    reasoning_effort: None = None
    verbosity: None = None
    functions: None = None  # the deprecated form of tools
    function_call: None = None

    @property
    def template_kwargs(self) -> dict:
        """The chat template's variables: chat_template_kwargs and how the prompt ends."""
        return {**(self.chat_template_kwargs or {}), **template_ending(self)}

    @model_validator(mode="after")
    def _check_combinations(self):
        template_ending(self)  # checked here: a 400 naming the field
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs: needs logprobs: true")
        if self.tool_choice is not None and self.tool_choice != "none" and not self.tools:
            raise ValueError("tool_choice: needs tools")
        if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name \
                not in {t.function.name for t in self.tools}:
            name = echo(self.tool_choice.function.name)
            raise ValueError(f"tool_choice: no tool is named {name}")
        if self.tools and len({t.function.name for t in self.tools}) != len(self.tools):
            raise ValueError("tools: function names must be unique")
        if self.uses_tools and self.structured_format is not None:
            raise ValueError("response_format: cannot be combined with tools")
        return self

    @property
    def effective_tool_choice(self):
        """The tool choice in force: OpenAI's default is "auto" with tools, "none" without."""
        if not self.tools:
            return "none"
        return self.tool_choice if self.tool_choice is not None else "auto"

    @property
    def uses_tools(self) -> bool:
        return self.effective_tool_choice != "none"


class ModelCard(_Open):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "flashlet"
    max_model_len: int


class ModelList(_Open):
    object: Literal["list"] = "list"
    data: list[ModelCard]
