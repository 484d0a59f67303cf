"""The one place a request is checked before it is queued: prompt token ids, its length and
token budget against the context and the KV pool, and its sampling parameters.

`LLM`, the server's API process and the engine (a last defensive check) all call these, so a
request is refused with the same words wherever it comes in. Errors are `RequestError`, a
ValueError that names the request field at fault (`param`) and, for context overflows, carries
OpenAI's `context_length_exceeded` code. A request that its own parameters stop part-way (a
response format no token of the vocabulary can continue, its grammar's mask past its CPU limit)
ends with a RequestError's message as its error, which the server answers as a bad request.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from flashlet.core.sampling import SamplingParams


class RequestError(ValueError):
    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message, self.param, self.code = message, param, code


@dataclass(frozen=True)
class RequestLimits:
    """What a request must fit: the model's context, its vocabulary and the KV pool."""

    max_model_len: int
    vocab_size: int
    page_size: int
    num_pages: int
    context_note: str = ""  # why the context is what it is, when that is not obvious

    @classmethod
    def of_engine(cls, engine) -> "RequestLimits":
        return cls(engine.max_model_len, engine.model_config.vocab_size,
                   engine.config.page_size, engine.kv_pool.num_pages, engine.context_note())

    @property
    def max_tokens(self) -> int:
        """The most tokens (prompt + output) one request can ever hold."""
        return min(self.max_model_len, self.num_pages * self.page_size)

    def check_prompt_ids(self, token_ids, param: str = "prompt",
                         typed: bool = False) -> list[int]:
        """Token ids -> a list, or RequestError if empty or out of the vocabulary.

        `typed`: a list of ints (no bools) by its making: what the server's strict models
        validated (the protocol's TokenIds) or a tokenizer encoded. Only its bounds are left to
        check (0.5 ms against the whole check's 1.3 at 30,000 ids on this project's CPU
        machine)."""
        if isinstance(token_ids, np.ndarray):  # the engine core's (int32 in its messages)
            return self._array_ids(token_ids, param)
        if not typed:
            token_ids = list(token_ids)
        if not token_ids:
            raise RequestError(f"{param} is empty", param)
        if not (self._in_vocab(token_ids) if typed else self._valid_ids(token_ids)):
            raise RequestError(f"{param}: token ids must be integers in [0, {self.vocab_size})",
                               param)
        return token_ids

    def _valid_ids(self, token_ids: list) -> bool:
        """Every id an int (not a bool) in [0, vocab_size). Plain ints (what JSON and msgpack
        give) are checked in C: a Python test per id cost the engine core
        ~0.2 us a prompt token, most of its time per request."""
        if set(map(type, token_ids)) == {int}:
            return self._in_vocab(token_ids)
        return all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < self.vocab_size
                   for t in token_ids)

    def _in_vocab(self, token_ids: list[int]) -> bool:
        """Plain ints in [0, vocab_size): one C pass into an array, whose min and max cost
        little (Python's max over the list alone costs more than all this)."""
        try:
            ids = np.fromiter(token_ids, np.int64, len(token_ids))
        except OverflowError:  # past int64: out of any vocabulary
            return False
        return bool(ids.min() >= 0 and ids.max() < self.vocab_size)

    def _array_ids(self, token_ids: np.ndarray, param: str) -> list[int]:
        """check_prompt_ids for a 1-d integer array: checked by numpy, made a list once."""
        if token_ids.ndim != 1 or token_ids.dtype.kind not in "iu":
            raise RequestError(f"{param}: token ids must be a 1-d integer array", param)
        if not token_ids.size:
            raise RequestError(f"{param} is empty", param)
        if token_ids.min() < 0 or token_ids.max() >= self.vocab_size:
            raise RequestError(f"{param}: token ids must be integers in [0, {self.vocab_size})",
                               param)
        return token_ids.tolist()

    def max_new_tokens(self, num_prompt: int, requested: int | None, default: int | None = None,
                       prompt_param: str = "prompt",
                       tokens_param: str = "max_new_tokens") -> int:
        """The request's max new tokens (`requested`, else `default` or all the room left),
        checked against the context and the KV pool."""
        limit = self.max_tokens
        if num_prompt >= limit:
            raise RequestError(
                f"{prompt_param}: the prompt is {num_prompt} tokens but the model's context is "
                f"{self.max_model_len} tokens (KV pool {self.num_pages * self.page_size}); leave "
                f"room for at least one new token{self.context_note}", prompt_param,
                "context_length_exceeded")
        if requested is None:
            return limit - num_prompt if default is None else min(default, limit - num_prompt)
        self.check_fits(num_prompt, requested, tokens_param)
        return requested

    def check_fits(self, num_prompt: int, max_new_tokens: int,
                   tokens_param: str = "max_new_tokens") -> None:
        """RequestError unless prompt + max_new_tokens fit the context and the KV pool."""
        total = num_prompt + max_new_tokens
        if total > self.max_model_len:
            raise RequestError(
                f"{tokens_param}: prompt ({num_prompt} tokens) + {tokens_param} "
                f"({max_new_tokens}) = {total} exceeds the model's context of "
                f"{self.max_model_len} tokens{self.context_note}", tokens_param,
                "context_length_exceeded")
        pages = -(-total // self.page_size)
        if pages > self.num_pages:
            raise RequestError(
                f"{tokens_param}: the request needs {pages} KV pages but the pool has only "
                f"{self.num_pages}: it could never run (raise max_num_pages or shorten it)",
                tokens_param)

    def check_stop_token_ids(self, params: SamplingParams) -> None:
        """The token ids a request's params name (stop_token_ids, logit_bias) are in the vocabulary."""
        if any(t >= self.vocab_size for t in params.stop_token_ids):
            raise RequestError(f"stop_token_ids must be < the vocabulary size {self.vocab_size}",
                               "stop_token_ids")
        highest = max(params.logit_bias or (), default=-1)
        if highest >= self.vocab_size:
            raise RequestError(f"logit_bias: token id {highest} is not in the vocabulary (< {self.vocab_size})",
                               "logit_bias")

    def check(self, token_ids, params: SamplingParams) -> list[int]:
        """Everything about one request of token ids: the prompt, its budget, its params."""
        self.check_params(params)
        token_ids = self.check_prompt_ids(token_ids)
        self.check_fits(len(token_ids), params.max_new_tokens)
        return token_ids

    def check_params(self, params: SamplingParams) -> None:
        """A request's params on their own (`check` less the prompt and its budget)."""
        try:
            params.validate()
        except ValueError as e:
            raise RequestError(str(e), str(e).split(" ", 1)[0]) from None
        self.check_stop_token_ids(params)
