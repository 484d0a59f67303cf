"""A request's life: its tokens, how many of them have K/V in the pool, its pages, its output.

The scheduler is the one writer of a request's scheduling state and pages (scheduler.py); the
engine reads them to build a step. Text is not here: the front end detokenizes (detokenizer.py).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from flashlet.core.sampling import SamplingParams, TokenLogprob


# An output token sampled on the device whose value the host has not read yet (see engine.py).
PLACEHOLDER = -1


class FinishReason(enum.StrEnum):
    """Why a request ended. A str (`FinishReason.STOP == "stop"`), so JSON bodies, metrics
    labels and comparisons with the plain names stay as they were."""

    STOP = "stop"  # an eos or stop token, or a stop string the front end found
    LENGTH = "length"  # max_new_tokens reached
    ABORT = "abort"  # aborted: the client went away, or the caller asked
    ERROR = "error"  # the request failed; `error` says why


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False, slots=True)  # identity comparison: `req in running` stays cheap; slots:
# attributes in the object itself, read by every per-row loop of a step
class Request:
    request_id: int  # the engine's, or the caller's (e.g. an API-server process)
    prompt_token_ids: list[int]
    params: SamplingParams
    generator: torch.Generator | None = None
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose K/V are in the pool
    # This request's page table, replaced (never changed in place) by the scheduler, which
    # tells the model runner's batch of each change (scheduler.BatchUpdate).
    page_ids: list[int] = field(default_factory=list)
    num_tree_pages: int = 0  # leading pages owned by the prefix cache (locked through tree_node)
    tree_node: object = None  # deepest radix node this request holds a lock on
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at admission
    num_preemptions: int = 0
    finish_reason: FinishReason | None = None
    error: str | None = None
    error_param: str | None = None  # the request field its error names, if its own (a RequestError)
    grammar: object = None  # xgrammar matcher of a constrained request (flashlet/text/structured.py)
    output_logprobs: list[TokenLogprob] | None = None  # one per output token, if asked for
    # The client request this one is part of (a multi-prompt completion's prompts share one):
    # the scheduler shares prefill between groups (scheduler.py). None: the common group.
    group: object = None
    # One per prompt token scored so far, if asked for (the first token's is None): filled a
    # chunk at a time (flashlet/runner/prompt_logprobs.py), complete once the prompt is computed.
    prompt_logprobs: list[TokenLogprob | None] | None = None
    # params.plain_greedy, read once: every decode step asks it of each of its rows
    plain_greedy: bool = field(init=False, default=False)

    def __post_init__(self) -> None:
        self.plain_greedy = self.params.plain_greedy

    def token_at(self, i: int) -> int:
        p = len(self.prompt_token_ids)
        return self.prompt_token_ids[i] if i < p else self.output_token_ids[i - p]

    def token_slice(self, start: int, end: int) -> list[int]:
        """(prompt + output tokens)[start:end] without building the whole list."""
        p = len(self.prompt_token_ids)
        if start >= p:
            return self.output_token_ids[start - p : end - p]
        if end <= p:
            return self.prompt_token_ids[start:end]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - p]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens_to_compute(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    @property
    def has_all_tokens(self) -> bool:
        """Every output token it may produce is sampled: only reading the last one is left."""
        return len(self.output_token_ids) >= self.params.max_new_tokens

    def drop_placeholders(self) -> None:
        """Forget tokens sampled after the request stopped (their values were never read)."""
        while self.output_token_ids and self.output_token_ids[-1] == PLACEHOLDER:
            self.output_token_ids.pop()

    def output(self, new_token_ids: list[int], first: bool = False) -> "RequestOutput":
        """This step's delta (the final result too, once finished); `first`: its tokens
        start the output (then it carries the prompt logprobs, if asked for)."""
        finished = self.status is RequestStatus.FINISHED
        out = RequestOutput(self.request_id, new_token_ids, finished, self.finish_reason,
                            self.prompt_token_ids, num_cached_tokens=self.num_cached_tokens,
                            error=self.error, error_param=self.error_param)
        if finished:
            out.token_ids = list(self.output_token_ids)
        if self.prompt_logprobs is not None and (finished or first):
            out.prompt_logprobs = self.prompt_logprobs  # with the first token, and at the end
        if self.output_logprobs is not None:  # asked for: this step's ones, and all at the end
            if new_token_ids:
                out.new_logprobs = self.output_logprobs[-len(new_token_ids):]
            if finished:
                out.logprobs = list(self.output_logprobs)
        return out


@dataclass(slots=True)  # one a running request a step: slots make it ~15% cheaper to build
class RequestOutput:
    """What one step produced for one request (a delta), or the final result. The engine fills
    the token fields; the text fields are filled by the front end (detokenizer.TextOutputs)."""

    request_id: int
    new_token_ids: list[int]
    finished: bool
    finish_reason: FinishReason | None = None
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None  # every output token, in the final output only
    num_cached_tokens: int = 0
    error: str | None = None
    error_param: str | None = None  # the request field at fault, where the error is its own
    new_logprobs: list[TokenLogprob] | None = None  # for new_token_ids, if logprobs were asked
    logprobs: list[TokenLogprob] | None = None  # one per output token, in the final output only
    embedding: list[float] | None = None  # an embedding request's, in its final output
    # The prompt's, if asked for: in the output of the first token and in the final one.
    prompt_logprobs: list[TokenLogprob | None] | None = None
    new_text: str = ""  # text safe to stream now (stop strings cut, a possible one held back)
    text: str = ""  # all output text so far
    prompt: str | None = None  # the prompt's text, where LLM.generate was given text

    @property
    def outputs(self) -> list["RequestOutput"]:
        """vLLM's shape, for code written against it (`out.outputs[0].text`, `.token_ids`,
        `.finish_reason`, `.logprobs`, `.cumulative_logprob`): this output, whose fields have
        those names. Here each sample is an output of its own (LLM.generate returns a prompt's
        n samples one after another), so the list holds one."""
        return [self]

    @property
    def cumulative_logprob(self) -> float | None:
        return sum(lp.logprob for lp in self.logprobs) if self.logprobs is not None else None
