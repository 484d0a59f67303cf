"""The messages between the API processes and the engine-core processes: msgspec structs sent
as msgpack over Unix sockets or ZeroMQ (engine_core.py's docstring describes the sockets). Both sides import
this module and nothing of the other's.
"""

from __future__ import annotations

import dataclasses
import struct
from typing import Any

import msgspec
import numpy as np

from flashlet.core.request import FinishReason
from flashlet.core.sampling import SamplingParams, TokenLogprob

_PARAM_FIELDS = tuple(f.name for f in dataclasses.fields(SamplingParams))
TOKEN_DTYPE = np.dtype("<i4")  # AddRequests.prompt's


# ---- messages in ---------------------------------------------------------------------------------
class AddRequests(msgspec.Struct, tag=True, array_like=True):
    """A prompt's request, or its samples (n > 1) as one message: the core adds them together,
    never the first alone (which could then run its prompt before the others arrive to share
    its KV pages: Engine.add_request's `after`)."""

    request_ids: list[int]  # the API process's ids; the engine uses them as its own
    # The prompt's token ids as little-endian int32 bytes (pack_token_ids): decoding a msgpack
    # list cost the core ~40 ns an id, checking the ids as Python ints as much again; an array
    # is checked in C and made a list once (request_check.check_prompt_ids).
    prompt: bytes
    # Each request's SamplingParams fields; no stop strings (the API process's).
    params: list[dict[str, Any]]
    # The client request they belong to (the prompts of one completion request share it): the
    # scheduler lets groups take turns with their prompts. None: the engine's common group.
    group: int | None = None

    @classmethod
    def of(cls, request_ids: list[int], prompt_token_ids: list[int],
           params: list[SamplingParams], group: int | None = None) -> "AddRequests":
        # SamplingParams' fields, not the dataclass: msgspec cannot build one with an InitVar
        # (max_tokens), and __init__ validates them again on the way in.
        return cls(request_ids, pack_token_ids(prompt_token_ids),
                   [{name: getattr(p, name) for name in _PARAM_FIELDS} for p in params], group)

    def prompt_token_ids(self) -> np.ndarray:
        """The prompt as an int32 array (ValueError if the bytes are not whole int32s)."""
        return np.frombuffer(self.prompt, TOKEN_DTYPE)


def pack_token_ids(token_ids: list[int]) -> bytes:
    """Token ids as AddRequests carries them (struct.pack: ~2x faster from a list than numpy)."""
    try:
        return struct.pack(f"<{len(token_ids)}i", *token_ids)
    except struct.error:
        raise ValueError("token ids must be integers in [-2**31, 2**31)") from None


class AbortRequests(msgspec.Struct, tag=True, array_like=True):
    request_ids: list[int]
    finish_reason: FinishReason = FinishReason.ABORT  # STOP: the API process found a stop string


class Probe(msgspec.Struct, tag=True, array_like=True):
    """Check the engine's integrity and reply with its stats (tests, diagnostics)."""

    api_server: int = 0  # the API process to reply to
    loop: bool = False  # reply with the loop's counters (diagnostics.py) too, skip the check


class Shutdown(msgspec.Struct, tag=True, array_like=True):
    pass


CoreInput = AddRequests | AbortRequests | Probe | Shutdown


# ---- messages out --------------------------------------------------------------------------------
class CoreOutput(msgspec.Struct, array_like=True, gc=False):
    """One request's share of a step (the attributes Generation reads off RequestOutput too).
    What every step carries comes first: a request that goes on without logprobs travels as
    its first three fields alone (output_rows). Untracked by the collector (gc=False: it never
    holds a reference cycle): an API process decodes one per streamed token."""

    request_id: int
    new_token_ids: list[int]
    num_cached_tokens: int = 0
    finished: bool = False
    finish_reason: FinishReason | None = None
    error: str | None = None  # only with finished
    status: int = 500  # the HTTP status of an error: 400 for a request the engine refused
    error_param: str | None = None  # the request field a 400 names, where the core knows it
    new_logprobs: list[TokenLogprob] | None = None  # for new_token_ids, if logprobs were asked
    embedding: list[float] | None = None  # an embedding request's (final output only)
    # The prompt's, with the first token and at the end, if prompt_logprobs was asked for.
    prompt_logprobs: list[TokenLogprob | None] | None = None

    @classmethod
    def of(cls, out) -> "CoreOutput":
        """An engine's RequestOutput as a CoreOutput (a CoreOutput as it is)."""
        if isinstance(out, CoreOutput):
            return out
        return cls(out.request_id, out.new_token_ids, out.num_cached_tokens, out.finished,
                   out.finish_reason, out.error, error_param=out.error_param,
                   new_logprobs=out.new_logprobs,
                   embedding=out.embedding, prompt_logprobs=out.prompt_logprobs)

    @classmethod
    def refused(cls, request_id: int, message: str, status: int = 400,
                param: str | None = None) -> "CoreOutput":
        """The final output of a request that could not run (`param`: the field at fault)."""
        return cls(request_id, [], finished=True, finish_reason=FinishReason.ERROR, error=message,
                   status=status, error_param=param)


def output_rows(outputs) -> list:
    """Outputs (the engine's RequestOutputs, or CoreOutputs) as StepOutputs.outputs sends them:
    one that goes on without logprobs (all but a few of a step's) as the tuple (request id, new
    token ids, cached tokens), which msgpack writes as that CoreOutput without its trailing
    defaults, and msgspec decodes into the same CoreOutput; any other as a whole CoreOutput.
    Building a CoreOutput a row cost the core more than the whole message does now."""
    return [(o.request_id, o.new_token_ids, o.num_cached_tokens)
            if not o.finished and o.new_logprobs is None and o.prompt_logprobs is None
            else CoreOutput.of(o)
            for o in outputs]


def output_rows_by_api_server(outputs, api_server_count: int) -> list[list]:
    """output_rows of each API process's outputs (api_server_of), made in one pass: a step of
    256 rows split first and made into rows after cost the core two loops over its outputs."""
    rows: list[list] = [[] for _ in range(api_server_count)]
    appends = [r.append for r in rows]
    for o in outputs:
        appends[o.request_id % api_server_count](
            (o.request_id, o.new_token_ids, o.num_cached_tokens)
            if not o.finished and o.new_logprobs is None and o.prompt_logprobs is None
            else CoreOutput.of(o))
    return rows


class StepOutputs(msgspec.Struct, tag=True, array_like=True):
    core: int
    outputs: list[CoreOutput]  # sent as output_rows makes them
    stats: dict[str, float]


class CoreReady(msgspec.Struct, tag=True, array_like=True):
    core: int
    info: dict[str, object]  # the request limits, the model folder, a one-line description
    error: str | None = None  # set instead when the engine could not be built
    pid: int = 0


class ProbeReply(msgspec.Struct, tag=True, array_like=True):
    core: int
    stats: dict[str, float]
    error: str | None = None
    loop: dict[str, Any] | None = None  # LoopCounters.snapshot(), if asked for


class Heartbeat(msgspec.Struct, tag=True, array_like=True):
    """Sent every HEARTBEAT_S by a thread of the core, whatever its loop does: the process is
    alive (a long step is not a stopped or hung process: core_client.py)."""

    core: int


CoreMessage = StepOutputs | CoreReady | ProbeReply | Heartbeat


def api_server_of(request_id: int, api_server_count: int) -> int:
    """The API process that sent a request: each numbers its own with a stride of the count."""
    return request_id % api_server_count
