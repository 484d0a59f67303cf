"""Sampling parameters (validated), per-token logprobs, and the slow per-row reference sampler
(`sample_one`); the batched sampler the engine uses is flashlet/runner/sampler.py."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import InitVar, dataclass, field

import numpy as np
import torch

# Response formats a request may ask for; all but "text" constrain the output with a grammar
# (flashlet/text/structured.py). "grammar" (EBNF) and "structural_tag" (xgrammar's JSON form, which
# tool calls use) are our extensions beside OpenAI's three.
RESPONSE_FORMATS = ("text", "json_object", "json_schema", "grammar", "structural_tag")
MAX_TOP_LOGPROBS = 20  # as OpenAI's top_logprobs
MAX_LOGIT_BIAS = 100  # as OpenAI's logit_bias
# Temperatures below this are greedy (vLLM's threshold): the logits are divided by the temperature
# in fp32, where a tiny one overflows them to inf (and 5e-324 rounds to 0), and a softmax of inf
# is NaN: the row would draw garbage.
GREEDY_TEMPERATURE = 1e-5
FP32_MAX = float(np.finfo(np.float32).max)
# repetition_penalty lies in [1 / this, this]: a logit is divided or multiplied by it in fp32, and
# a penalty that rounds to 0 there (5e-324) or overflows a logit makes NaN (-inf x 0, inf / inf).
MAX_REPETITION_PENALTY = 100.0

POOLING_MODES = (None, "last", "mean")

@dataclass
class SamplingParams:
    max_new_tokens: int = 64
    temperature: float = 0.0  # 0 is exact greedy (argmax); so is any below GREEDY_TEMPERATURE
    top_k: int = 0  # 0 keeps every token (so does -1, vLLM's older "off")
    top_p: float = 1.0
    min_p: float = 0.0  # drop tokens less likely than min_p times the most likely one
    presence_penalty: float = 0.0  # subtracted once from each token already in the output
    frequency_penalty: float = 0.0  # subtracted per occurrence in the output
    repetition_penalty: float = 1.0  # divides (>0) / multiplies (<0) logits of prompt+output tokens
    seed: int | None = None  # a fixed seed reproduces sampled output
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)  # end the request; the token is kept
    ignore_eos: bool = False
    # EOS and stop_token_ids cannot be sampled before this many tokens, except where a
    # response_format's grammar allows nothing else (its output is complete: the format wins)
    min_tokens: int = 0
    logprobs: int | None = None  # None: none; k >= 0: the chosen token's logprob and the top k
    # None: none; k >= 0: each prompt token's logprob (the first has none) and the top k there.
    # Such a request computes its whole prompt (no prefix-cache hit): every position is scored.
    prompt_logprobs: int | None = None
    n: int = 1  # samples per prompt (LLM.generate); they share the prompt's KV pages
    best_of: int | None = None  # sample this many, return the n of highest cumulative logprob
    response_format: dict | None = None  # {"type": one of RESPONSE_FORMATS, ...}
    # "last" / "mean": an embedding request: its prompt's final hidden states pooled and
    # normalised (flashlet/runner/pooling.py) come back in the final output.
    pooling: str | None = None
    priority: int = 0  # with scheduling_policy "priority": lower values run first (vLLM's)
    # How the text is made from the tokens (vLLM's names; where text is made, not in the engine):
    skip_special_tokens: bool = True  # False: special tokens (an EOS such as <|im_end|>) in the text
    include_stop_str_in_output: bool = False  # True: the text ends after the stop string it hit
    # {token id: bias}: added to the model's logits before the penalties and sampling (OpenAI's
    # and vLLM's logit_bias; each bias in [-100, 100]: -100 bans a token, 100 all but forces it).
    logit_bias: dict[int, float] | None = None
    max_tokens: InitVar[int | None] = None  # vLLM's name for max_new_tokens (either, not both)

    def __post_init__(self, max_tokens: int | None):
        if max_tokens is not None:
            if self.max_new_tokens not in (max_tokens, _DEFAULT_MAX_NEW_TOKENS):
                raise ValueError(f"max_tokens ({max_tokens!r}) and max_new_tokens "
                                 f"({self.max_new_tokens!r}) disagree: give one of them")
            self.max_new_tokens = max_tokens
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if isinstance(self.logprobs, bool):  # OpenAI's chat API: logprobs=True, top_logprobs=0
            self.logprobs = 0 if self.logprobs else None
        if self.top_k == -1 and not isinstance(self.top_k, bool):
            self.top_k = 0
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the first bad field."""
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        if not 0 <= self.temperature <= FP32_MAX:  # (the sampler divides by it in fp32)
            raise ValueError(f"temperature must be finite in fp32 (0 to {FP32_MAX:.4g}), got "
                             f"{self.temperature!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0, got {self.top_k!r}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2 <= value <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {value!r}")
        if not 1 / MAX_REPETITION_PENALTY <= self.repetition_penalty <= MAX_REPETITION_PENALTY:  # and NaN
            raise ValueError(f"repetition_penalty must be in [{1 / MAX_REPETITION_PENALTY:g}, "
                             f"{MAX_REPETITION_PENALTY:g}], got {self.repetition_penalty!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop must be a list of non-empty strings")
        if any(not _is_int(t) or t < 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be a list of integers >= 0")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_new_tokens:
            raise ValueError(f"min_tokens must be an integer from 0 to the request's most new "
                             f"tokens ({self.max_new_tokens!r}), got {self.min_tokens!r}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or not 0 <= value <= MAX_TOP_LOGPROBS):
                raise ValueError(f"{name} must be None or an integer in [0, {MAX_TOP_LOGPROBS}], "
                                 f"got {value!r}")
        if not _is_int(self.n) or self.n < 1:
            raise ValueError(f"n must be an integer >= 1, got {self.n!r}")
        if self.best_of is not None and (not _is_int(self.best_of) or self.best_of < self.n):
            raise ValueError(f"best_of must be an integer >= n ({self.n}), got {self.best_of!r}")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict) or any(
                    not _is_int(t) or t < 0 or not isinstance(b, (int, float)) or isinstance(b, bool)
                    or not -MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS for t, b in self.logit_bias.items()):
                raise ValueError(f"logit_bias must map token ids (integers >= 0) to biases in "
                                 f"[-{MAX_LOGIT_BIAS}, {MAX_LOGIT_BIAS}], got {self.logit_bias!r}"[:300])
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        if not _is_int(self.priority) or not -2**63 <= self.priority < 2**63:
            raise ValueError(f"priority must be a 64-bit integer, got {self.priority!r}")
        for name in ("skip_special_tokens", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        _check_response_format(self.response_format)
        if self.pooling not in POOLING_MODES:
            raise ValueError(f"pooling must be one of {POOLING_MODES}, got {self.pooling!r}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return (self.presence_penalty != 0 or self.frequency_penalty != 0
                or self.repetition_penalty != 1)

    def early_stop_ids(self, eos_token_ids) -> list[int]:
        """The ids a request short of min_tokens may not sample: its stop ids, and EOS unless
        ignored."""
        return self.stop_token_ids + ([] if self.ignore_eos else sorted(eos_token_ids))

    @property
    def is_constrained(self) -> bool:
        """True when a grammar constrains the output (json, a schema, a grammar, a tool call)."""
        return self.response_format is not None and self.response_format["type"] != "text"

    @property
    def plain_greedy(self) -> bool:
        """Nothing for a sampler to apply (no temperature, penalty, logprobs, min_tokens, logit
        bias or grammar): the logits' argmax is the token."""
        return (self.is_greedy and not self.has_penalties and self.logprobs is None
                and self.min_tokens == 0 and not self.is_constrained and not self.logit_bias)


@dataclass
class TokenLogprob:
    """A sampled token's log-probability and the `logprobs` most likely tokens at its position,
    all from the model's own distribution (raw logits; see flashlet/runner/sampler.py)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token id, logprob), most likely first
    rank: int | None = None  # 1 + how many tokens are likelier (prompt logprobs only)


class SamplingColumns:
    """Sampling parameters of many rows, one numpy column each: the model runner's batch keeps
    one row per running request (written when the request takes the row, so a row's next
    occupant leaves nothing stale), and the sampler builds a step's state from `take(rows)`,
    the columns at the step's sampled positions, in a few numpy calls instead of a loop over
    requests. A row sampled at several positions (speculation's k + 1) appears once for each."""

    def __init__(self, num_rows: int):
        self.sample = np.zeros((num_rows, 4), np.float32)  # temperature, top_k, top_p, min_p
        self.penalties = np.zeros((num_rows, 3), np.float32)  # presence, frequency, repetition
        self.seed = np.zeros(num_rows, np.int64)  # the seed's low 64 bits, two's complement
        self.seeded = np.zeros(num_rows, bool)
        self.greedy = np.ones(num_rows, bool)
        self.penalised = np.zeros(num_rows, bool)
        self.logprobs = np.full(num_rows, -1, np.int64)  # top logprobs asked for; -1: none
        self.min_tokens = np.zeros(num_rows, np.int64)
        self.constrained = np.zeros(num_rows, bool)
        self.biased = np.zeros(num_rows, bool)  # a logit_bias (its entries read from the request)

    @classmethod
    def of(cls, params: list[SamplingParams]) -> "SamplingColumns":
        """Columns whose row i holds params[i]."""
        columns = cls(len(params))
        for row, p in enumerate(params):
            columns.set(row, p)
        return columns

    def set(self, row: int, p: SamplingParams) -> None:
        """Row `row` now samples with `p` (every column written)."""
        self.sample[row] = (p.temperature, p.top_k, p.top_p, p.min_p)
        self.penalties[row] = (p.presence_penalty, p.frequency_penalty, p.repetition_penalty)
        self.seeded[row] = p.seed is not None
        self.seed[row] = 0 if p.seed is None else as_int64(p.seed)
        self.greedy[row] = p.is_greedy
        self.penalised[row] = p.has_penalties
        self.logprobs[row] = -1 if p.logprobs is None else p.logprobs
        self.min_tokens[row] = p.min_tokens
        self.constrained[row] = p.is_constrained
        self.biased[row] = bool(p.logit_bias)

    def take(self, rows: np.ndarray) -> "SamplingColumns":
        """The columns at these rows, in this order (repeats allowed)."""
        taken = SamplingColumns.__new__(SamplingColumns)
        for name, column in vars(self).items():
            setattr(taken, name, column[rows])
        return taken

    def plain_greedy(self) -> np.ndarray:
        """Rows with nothing for the sampler to apply: the argmax is the token."""
        return (self.greedy & ~self.penalised & (self.logprobs < 0) & (self.min_tokens == 0)
                & ~self.constrained & ~self.biased)


def as_int64(value: int) -> int:
    """The int64 holding `value`'s low 64 bits (two's complement)."""
    return ((value + 2**63) % 2**64) - 2**63


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_response_format(fmt) -> None:
    """The shape of a response_format (the grammar itself is checked when it is compiled)."""
    if fmt is None:
        return
    if not isinstance(fmt, dict) or fmt.get("type") not in RESPONSE_FORMATS:
        raise ValueError(f"response_format must be a dict whose type is one of "
                         f"{', '.join(RESPONSE_FORMATS)}, got {fmt!r}")
    kind = fmt["type"]
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), (dict, bool)):
            raise ValueError('response_format json_schema needs {"json_schema": {"schema": {...}}}')
        try:
            json.dumps(spec["schema"])
        except (TypeError, ValueError) as e:
            raise ValueError(f"the json_schema schema is not JSON: {e}") from None
    elif kind == "grammar" and (not isinstance(fmt.get("grammar"), str) or not fmt["grammar"].strip()):
        raise ValueError('response_format grammar needs {"grammar": "<EBNF text>"}')
    elif kind == "structural_tag" and not isinstance(fmt.get("format"), dict):
        raise ValueError('response_format structural_tag needs {"format": {...}} '
                         "(xgrammar's structural tag)")


def sample_params(params: SamplingParams, index: int, num_samples: int) -> SamplingParams:
    """The parameters of one of a prompt's samples: seed + index (as vLLM), so seeded samples
    differ from each other yet reproduce; logprobs on where best_of ranks by them. `params`
    itself where nothing changes (one sample: a copy costs ~8 us a request)."""
    changes = {}
    if params.n != 1 or params.best_of is not None:
        changes.update(n=1, best_of=None)
    if params.seed is not None and index:
        changes["seed"] = params.seed + index
    if params.prompt_logprobs is not None and index:  # one prompt: the first sample scores it
        changes["prompt_logprobs"] = None
    if num_samples > params.n and params.logprobs is None:
        changes["logprobs"] = 0
    return dataclasses.replace(params, **changes) if changes else params


_DEFAULT_MAX_NEW_TOKENS = SamplingParams.max_new_tokens
SamplingParams.max_tokens = property(lambda self: self.max_new_tokens,
                                     doc="vLLM's name for max_new_tokens")


def make_generator(params: SamplingParams, device) -> torch.Generator | None:
    """A generator for a seeded sampling request on the torch sampler path (the CUDA kernel
    derives its noise as `noise_seed` says); unseeded requests share the global one."""
    if params.is_greedy or params.seed is None:
        return None
    gen = torch.Generator(device=device)
    gen.manual_seed(params.seed & _MASK64)  # any integer seed, reduced modulo 2**64 (as the kernel's)
    return gen


_MASK64 = (1 << 64) - 1


def noise_seed(req, step_seed: int, row: int) -> int:
    """The Philox seed of a request's noise this step (the CUDA sampler's, which computes it in
    the kernel from the same pair; this is the host's reference): from its own seed and output
    position when it has a seed (so its tokens do not depend on the batch), else from the
    step's random seed and its row. A 63-bit int (splitmix64 of the pair)."""
    if req.params.seed is not None:
        return _splitmix64(req.params.seed, len(req.output_token_ids))
    return _splitmix64(step_seed, row)


def _splitmix64(a: int, b: int) -> int:
    z = (a * 0x9E3779B97F4A7C15 + b + 0x632BE59BD9B4E5B) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


def sample_one(logits: torch.Tensor, params: SamplingParams, generator) -> torch.Tensor:
    """The slow reference: logits [vocab] fp32 -> a 0-d token tensor, with temperature, top-k
    and top-p (tests compare the batched sampler with it)."""
    logits = logits / params.temperature
    if params.top_k > 0:
        kth = torch.topk(logits, min(params.top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        # Keep the smallest prefix whose mass reaches top_p (always at least one token).
        drop = sorted_probs.cumsum(-1) - sorted_probs >= params.top_p
        drop[0] = False  # the most likely token always stays, however small top_p is
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return torch.multinomial(probs, 1, generator=generator)[0]
