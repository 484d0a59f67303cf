"""Token ids -> text, one request at a time, in whichever process talks to the user.

The engine deals only in token ids (EOS, stop token ids, max_new_tokens). Text, stop strings and
the holdback of a tail that could still become a stop string live here, so that the same code
serves the in-process users (`LLM`, the server's engine loop) and an API-server process that
receives token ids from an engine-core process.

`TextOutputs` is the small adapter for in-process users: it turns the engine's token outputs
into outputs with text, and ends a request through `engine.abort(..., finish_reason="stop")`
when a stop string appears.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Sequence

from tokenizers.decoders import DecodeStream

from flashlet.core.request import FinishReason, RequestOutput


def rust_decoder(tokenizer):
    """The `tokenizers.Tokenizer` under a Hugging Face fast tokenizer when its decode gives the
    same text (no clean-up of spaces afterwards), else None. Called twice per streamed token, it
    costs a third of `tokenizer.decode`, whose Python wrapping dominates for a few ids."""
    backend = getattr(tokenizer, "_tokenizer", None)
    try:
        from tokenizers import Tokenizer
    except ImportError:
        return None
    if not isinstance(backend, Tokenizer) or getattr(tokenizer, "clean_up_tokenization_spaces",
                                                     True):
        return None
    return backend


class IncrementalDetokenizer:
    """One request's output tokens -> its text, a piece at a time.

    Decodes a two-offset window (as Hugging Face's TGI does) so that tokenizers which merge
    spaces across tokens give the same text as decoding everything at once, and waits while the
    window ends in a partial UTF-8 character: with a Rust tokenizer, its own `DecodeStream`
    (the same window, kept in Rust: a third of the cost per token), else in Python here. With
    stop strings, the text is cut before the first one to complete (after it, with
    include_stop), and a tail that could still grow into one is held back until `finish()`."""

    def __init__(self, tokenizer, stop: Sequence[str] = (), skip_special_tokens: bool = True,
                 include_stop: bool = False):
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.skip_special_tokens = skip_special_tokens
        self.include_stop = include_stop
        self.text = ""  # all text so far (cut at a stop string)
        self.stopped = False
        self._token_ids: list[int] = []
        self._prefix_offset = 0  # the window over _token_ids that is decoded each time
        self._read_offset = 0
        self._num_sent_chars = 0  # characters of text already returned
        self._holdback = max((len(s) for s in self.stop), default=1) - 1
        self._backend = rust_decoder(tokenizer)
        self._stream = None if self._backend is None else DecodeStream(
            skip_special_tokens=skip_special_tokens)
        self._num_streamed = 0  # tokens whose text DecodeStream has given

    @classmethod
    def for_request(cls, tokenizer, params) -> "IncrementalDetokenizer":
        """A request's: its SamplingParams' stop strings and how they make its text."""
        return cls(tokenizer, params.stop or (), params.skip_special_tokens, params.include_stop_str_in_output)

    def push(self, token_ids: Sequence[int]) -> tuple[str, bool]:
        """Add tokens; returns (new text safe to emit now, whether a stop string was hit).

        After a stop string the text is cut before it, the held tail is dropped, and further
        pushes return ("", True)."""
        if self.stopped:
            return "", True
        searched = max(len(self.text) - self._holdback, 0)  # no stop string starts before here
        self._token_ids.extend(token_ids)
        if self._stream is None or not self._stream_decode(token_ids):
            self._decode()
        if self.stop and self._find_stop(searched):
            self.stopped = True
            return self._emit(len(self.text)), True
        return self._emit(len(self.text) - self._holdback), False

    def finish(self) -> str:
        """The rest of the text at the end of a request that did not stop on a stop string: the
        held-back tail, and the text of last tokens that end inside a UTF-8 character (a request
        cut off mid-character), as one decode of every token gives it (U+FFFD for the partial
        bytes). Their text may still hold a stop string: then `stopped` turns True."""
        if self.stopped:
            return ""
        decoded = self._num_streamed if self._stream is not None else self._read_offset
        if decoded < len(self._token_ids):  # rare: one whole decode, once
            searched = max(len(self.text) - self._holdback, 0)
            whole = self._decode_ids(self._token_ids)
            if len(whole) > len(self.text) and whole.startswith(self.text):
                self.text = whole
                if self.stop and self._find_stop(searched):
                    self.stopped = True
        return self._emit(len(self.text))

    def _stream_decode(self, token_ids: Sequence[int]) -> bool:
        """Decode with DecodeStream; False once it has failed, and the Python window takes
        over from the last token whose text it gave."""
        try:
            piece = self._stream.step(self._backend, list(token_ids))
        except Exception:  # noqa: BLE001 - its check that each window's text extends the last
            self._stream = None
            self._prefix_offset = self._read_offset = self._num_streamed
            return False
        if piece is not None:  # None: the tokens so far end inside a UTF-8 character
            self.text += piece
            self._num_streamed = len(self._token_ids)
        return True

    def _decode(self) -> None:
        ids, end = self._token_ids, len(self._token_ids)
        prefix = self._decode_ids(ids[self._prefix_offset : self._read_offset])
        full = self._decode_ids(ids[self._prefix_offset : end])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):  # not a partial UTF-8 char
            self.text += full[len(prefix) :]
            self._prefix_offset, self._read_offset = self._read_offset, end

    def _decode_ids(self, ids: list[int]) -> str:
        if self._backend is not None:
            return self._backend.decode(ids, skip_special_tokens=self.skip_special_tokens)
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _find_stop(self, start: int) -> bool:
        """Cut the text at the stop string that completes first at or after `start` (the
        smallest end; of two ending together, the one that starts first): before it, or after
        it with include_stop. The same stop whatever the pushes' sizes: one that ends first
        was whole in the text when it was pushed. True if one was found."""
        found = [(i + len(s), i) for i, s in ((self.text.find(s, start), s) for s in self.stop) if i >= 0]
        if not found:
            return False
        end, at = min(found)
        self.text = self.text[: end if self.include_stop else at]
        return True

    def _emit(self, end: int) -> str:
        if end <= self._num_sent_chars:
            return ""
        new, self._num_sent_chars = self.text[self._num_sent_chars : end], end
        return new


@dataclass
class _Tracked:
    """What TextOutputs keeps of one request: its detokenizer (None without a tokenizer) and
    what its final output carries, for one that a stop string ends here: its token ids and
    logprobs so far (None unless asked for), and its prompt's (from its first output)."""

    detok: IncrementalDetokenizer | None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list | None = None
    prompt_logprobs: list | None = None


class TextOutputs:
    """Fills in the text of an in-process engine's outputs, one IncrementalDetokenizer per
    request, and ends a request on a stop string (`engine.abort(rid, finish_reason="stop")`).

    Call `add(request_id, params)` after `engine.add_request`, then pass every `engine.step()`
    result through `process`. Without a tokenizer, outputs pass through with empty text (and
    stop strings cannot apply)."""

    def __init__(self, engine, tokenizer):
        self.engine = engine
        self.tokenizer = tokenizer
        self._tracked: dict[int, _Tracked] = {}
        # Stopped here on a stop string: the engine's outputs for them are dropped up to and
        # with their finished one (the abort's echo; a step's outputs may also carry a token
        # made after the one that completed the stop string).
        self._ended: set[int] = set()

    def add(self, request_id: int, params) -> None:
        detok = None
        if self.tokenizer is not None:
            detok = IncrementalDetokenizer.for_request(self.tokenizer, params)
        self._tracked[request_id] = _Tracked(detok, logprobs=[] if params.logprobs is not None else None)

    def forget(self, request_id: int) -> None:
        """Stop tracking a request (its caller is gone)."""
        self._tracked.pop(request_id, None)

    def process(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        result = []
        for out in outputs:
            if out.request_id in self._ended:
                if out.finished:
                    self._ended.discard(out.request_id)
                continue
            tracked = self._tracked.get(out.request_id)
            if tracked is None:
                result.append(out)  # not ours: passed on as it is
                continue
            result.append(self._with_text(out, tracked))
        return result

    def _with_text(self, out: RequestOutput, tracked: _Tracked) -> RequestOutput:
        rid, detok = out.request_id, tracked.detok
        tracked.token_ids.extend(out.new_token_ids)
        if tracked.logprobs is not None and out.new_logprobs:
            tracked.logprobs.extend(out.new_logprobs)
        if out.prompt_logprobs is not None:
            tracked.prompt_logprobs = out.prompt_logprobs
        if detok is None:
            new_text, stopped = "", False
        else:
            new_text, stopped = detok.push(out.new_token_ids)
        if stopped and not out.finished:
            self.engine.abort(rid, finish_reason=FinishReason.STOP)
            self._ended.add(rid)
            out = replace(out, finished=True, finish_reason=FinishReason.STOP,
                          token_ids=list(tracked.token_ids), prompt_logprobs=tracked.prompt_logprobs,
                          logprobs=None if tracked.logprobs is None else list(tracked.logprobs))
        elif out.finished and detok is not None and not stopped:
            new_text += detok.finish()
            if detok.stopped and out.finish_reason == FinishReason.LENGTH:
                out = replace(out, finish_reason=FinishReason.STOP)  # a stop string in that text
        elif stopped:
            out = replace(out, finish_reason=FinishReason.STOP)
        if out.finished:
            self.forget(rid)
        return replace(out, new_text=new_text, text=detok.text if detok else "")
