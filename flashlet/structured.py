"""Structured output with xgrammar: a response format (json_object, json_schema, an EBNF
grammar, a structural tag such as a tool call) is compiled once against the model's tokenizer
(cached by format), each constrained request gets its own matcher, and every step the matcher
fills the row's token bitmask, which the batched sampler applies before sampling.

Overlap: a constrained row's mask for step N depends on the token of step N-1, which the host
reads only after launching step N when steps overlap. The engine therefore finishes (reads) the
in-flight step before scheduling the next whenever that step sampled a constrained row: the
whole step runs without overlap while a constrained request is running. Holding back only the
constrained rows would also cost them every other step and make the scheduler depend on what
is in flight; the mask itself is filled after the forward pass has been launched, so on a GPU
the matcher's work runs while the model computes.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict

import torch

TOOL_CALL_MODEL_FORMAT = "qwen_3"  # <tool_call>\n{"name": ..., "arguments": ...}\n</tool_call>


class StructuredOutputs:
    """Compiles response formats for one tokenizer and makes a matcher per request."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: set[int],
                 cache_size: int = 256):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self.cache_size = cache_size
        self._compiler = None  # built on first use: TokenizerInfo walks the whole vocabulary
        self._compiled: OrderedDict[str, object] = OrderedDict()  # canonical format -> grammar
        self._lock = threading.Lock()  # the server checks requests outside the engine's thread
        self.num_compiled = 0

    def compile(self, fmt: dict):
        """A response_format -> xgrammar's CompiledGrammar; ValueError if it is invalid."""
        key = json.dumps(fmt, sort_keys=True)
        with self._lock:
            return self._compile_cached(key, fmt)

    def _compile_cached(self, key: str, fmt: dict):
        if key in self._compiled:
            self._compiled.move_to_end(key)
            return self._compiled[key]
        try:
            grammar = self._compile(fmt)
        except (RuntimeError, ValueError, TypeError) as e:  # xgrammar's errors for bad input
            # Its messages start "[12:00:00] /project/cpp/file.cc:94: ": keep what follows.
            reason = re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", str(e).strip())
            raise ValueError(f"invalid {fmt['type']} response_format: {reason}") from None
        self.num_compiled += 1
        self._compiled[key] = grammar
        if len(self._compiled) > self.cache_size:
            self._compiled.popitem(last=False)
        return grammar

    def matcher(self, fmt: dict):
        import xgrammar as xgr

        return xgr.GrammarMatcher(self.compile(fmt))

    def _compile(self, fmt: dict):
        compiler = self._get_compiler()
        kind = fmt["type"]
        if kind == "json_object":
            return compiler.compile_builtin_json_grammar()
        if kind == "json_schema":
            # Compact JSON: small models otherwise tend to loop on whitespace (vLLM's
            # disable_any_whitespace for the same reason).
            return compiler.compile_json_schema(json.dumps(fmt["json_schema"]["schema"]),
                                                any_whitespace=False)
        if kind == "grammar":
            return compiler.compile_grammar(fmt["grammar"])
        if kind == "structural_tag":
            return compiler.compile_structural_tag({"type": "structural_tag",
                                                    "format": fmt["format"]})
        raise ValueError(f"response_format {kind!r} needs no grammar")

    def _get_compiler(self):
        if self._compiler is None:
            import xgrammar as xgr

            info = xgr.TokenizerInfo.from_huggingface(
                self.tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids)
            self._compiler = xgr.GrammarCompiler(info)
        return self._compiler


def apply_grammar_masks(logits: torch.Tensor, reqs: list, errors: dict) -> None:
    """Mask, in place, the tokens each constrained row's grammar forbids (logits
    [len(reqs), vocab]); a matcher that fails puts its row in `errors`."""
    rows = [i for i, req in enumerate(reqs) if req.grammar is not None]
    if not rows:
        return
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(len(reqs), logits.shape[1])
    filled = []
    for i in rows:
        try:
            reqs[i].grammar.fill_next_token_bitmask(bitmask, i)
            filled.append(i)
        except Exception as e:  # one bad request must not fail the batch
            errors[i] = e
    if filled:
        if logits.is_cuda:
            bitmask = bitmask.pin_memory().to(logits.device, non_blocking=True)
        xgr.apply_token_bitmask_inplace(logits, bitmask,
                                        vocab_size=logits.shape[1], indices=filled)


def advance_grammars(reqs: list, tokens: list) -> None:
    """Feed each constrained request its sampled token (tokens: one per row, an Exception where
    sampling failed); a token its grammar rejects becomes that row's error. The grammar ends on
    an EOS token, which ends the request as any EOS does."""
    for row, req in enumerate(reqs):
        token = tokens[row]
        if req.grammar is None or req.is_finished or isinstance(token, Exception):
            continue  # unconstrained, a void row (stopped a step before), or failed already
        if not req.grammar.accept_token(token):
            tokens[row] = ValueError(f"token {token} does not fit the response format")


def tool_call_format(tools: list[dict], tool_choice="required",
                     model_format: str = TOOL_CALL_MODEL_FORMAT) -> dict:
    """OpenAI `tools` and a `tool_choice` ("required" or {"type": "function", "function":
    {"name": ...}}) -> a structural_tag response_format that makes the model call them in
    `model_format`'s syntax (Qwen2.5's <tool_call> by default); ValueError if invalid."""
    import xgrammar as xgr

    if tool_choice == "auto" or tool_choice == "none":
        raise ValueError(f"tool_choice {tool_choice!r} does not constrain the output")
    try:
        tag = xgr.get_builtin_structural_tag(model_format, tools=tools, tool_choice=tool_choice,
                                             reasoning=False, max_whitespace_cnt=1)
    except (ValueError, TypeError, KeyError) as e:
        raise ValueError(f"invalid tools or tool_choice: {e}") from None
    fmt = tag.model_dump(mode="json")["format"]
    if fmt["type"] == "triggered_tags":  # "required": calls only, then the end
        fmt = calls_only(fmt)
    return {"type": "structural_tag", "format": fmt}


def calls_only(triggered: dict) -> dict:
    """xgrammar's `required` format (triggered tags, at least one) allows free text around
    and after the calls, so a model may call and then talk to max_tokens. This one is one or
    more calls, one a line, and nothing else: the grammar then ends, and with it (on EOS) the
    request, whose finish_reason becomes "tool_calls"."""
    return {"type": "tags_with_separator", "tags": triggered["tags"], "separator": "\n",
            "at_least_one": True, "stop_after_first": False}
