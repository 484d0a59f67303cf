"""Request and response bodies (pydantic), for /generate and the OpenAI-compatible API.

Requests are strict (no "5" for an int, no 1 for a bool), reject unknown fields, NaN and
infinities, and strings that cannot be encoded as UTF-8 (lone surrogates from JSON escapes).
OpenAI parameters that this server accepts but does not implement are only allowed at their
neutral value, so a client never silently gets something other than what it asked for.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

MAX_STOP = 16


def _utf8(value: str) -> str:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"is not valid Unicode (unpaired surrogate at index {e.start})") from None
    return value


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
    max_new_tokens: MaxTokens = 64
    temperature: Temperature = 0.0
    top_p: TopP = 1.0
    top_k: Annotated[int, Field(ge=0, le=2**31 - 1)] = 0
    seed: Seed | None = None
    stop: Stop = None
    ignore_eos: bool = False


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


class GenerateResponse(BaseModel):
    text: str
    finish_reason: str
    usage: Usage
    ttft_ms: float | None
    latency_ms: float


# ---- OpenAI-compatible --------------------------------------------------------------------
class StreamOptions(_Strict):
    include_usage: bool = False


class _OpenAISampling(_Strict):
    model: Text
    max_tokens: MaxTokens | None = None
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    top_k: Annotated[int, Field(ge=-1, le=2**31 - 1)] = -1  # an extension (vLLM's): -1 = off
    n: Annotated[int, Field(ge=1, le=1)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: Stop = None
    seed: Seed | None = None
    ignore_eos: bool = False  # an extension
    user: Text | None = None
    # Accepted at their neutral values only: this server does not implement them.
    frequency_penalty: Annotated[float, Field(ge=0.0, le=0.0)] | None = None
    presence_penalty: Annotated[float, Field(ge=0.0, le=0.0)] | None = None
    logit_bias: Annotated[dict[str, float], Field(max_length=0)] | None = None

    @model_validator(mode="after")
    def _stream_options_need_stream(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only allowed when stream is true")
        return self


class CompletionRequest(_OpenAISampling):
    prompt: NonEmptyText | TokenIds | Annotated[list[NonEmptyText | TokenIds],
                                                Field(min_length=1, max_length=1)]
    echo: Literal[False] = False
    logprobs: Literal[0] | None = None
    best_of: Annotated[int, Field(ge=1, le=1)] | None = None
    suffix: None = None


class TextPart(_Strict):
    type: Literal["text"]
    text: Text


Content = Text | Annotated[list[TextPart], Field(min_length=1)]


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


ChatMessage = Annotated[SystemMessage | UserMessage | AssistantMessage,
                        Field(discriminator="role")]


class ChatCompletionRequest(_OpenAISampling):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: MaxTokens | None = None
    logprobs: Literal[False] | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=0)] | None = None


class ModelCard(_Open):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "flashlet"
    max_model_len: int


class ModelList(_Open):
    object: Literal["list"] = "list"
    data: list[ModelCard]
