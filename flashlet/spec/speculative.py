"""Speculative decoding: a cheap proposer guesses a request's next k tokens, and one step of the
model checks all of them; what the model agrees with is kept, so a step can yield up to k + 1
tokens at about the cost of one.

How a speculating step runs (engine.py, scheduler.py, batch.py):
1. Before scheduling, `SpeculativeDecoding.propose` asks the proposer for up to k tokens for
   each running request that decodes (its tokens all known: a step in flight is read first,
   since a proposal needs the newest token). A request with a response_format
   speculates too: its verify rows are masked as its grammar stands after the proposals
   before each (`mask_grammars`), and its grammar advances over the accepted tokens only.
2. The scheduler gives such a row 1 + len(proposals) query tokens (its newest token, then the
   proposals) beside the step's other decodes and prefill chunks, in the one ragged attention
   call, with pages for all of them where the pool has them free (or evictable from the prefix
   cache): proposals never preempt a request, a row without room for them verifies none.
   The layout takes logits at every one of those positions (`BatchUpdate.spec_lens`). Where
   the fused decode path runs and the step has no prefill chunk and at most 4 query tokens,
   the runner loads it as one decode row per query token and runs it fused
   (`fused_decode.verify_as_decode_rows`); the logits rows are the same either way. A step
   whose requests are all plain greedy then needs no logits: `verify_greedy` decides from each
   row's argmax (the LM head's epilogue), as those requests' decode steps do without speculation.
3. `verify` turns the step's logits into each request's accepted tokens: the longest prefix
   of proposals the model keeps, plus one token of its own (so at least one token a step).
   Greedy rows accept a proposal where it is the argmax: the output equals decoding without
   speculation. Sampled rows use exact rejection sampling after the sampler's own transforms
   (min_tokens, penalties, temperature, min-p, top-k, top-p): a proposal x is kept with
   probability p(x) (q is one-hot for a proposer that names one token), and on rejection the
   token is drawn from p with x's mass removed, renormalised; so the output distribution is
   the model's.
4. The scheduler writes the accepted tokens in, checking stops and max_new_tokens on each,
   counts only the accepted tokens as computed, and frees the rejected tokens' whole pages
   (the prefix cache only ever sees accepted tokens).

Design notes: other proposers behind the same interface.
- A draft model (spec/draft.py) keeps its own KV for each request and runs k small steps
  inside `propose`; `on_accepted` tells it how far to roll its KV back; `release` frees it.
- EAGLE-style heads and multi-token-prediction (MTP) heads predict from the target model's
  own hidden states rather than from tokens. They would plug in as a proposer whose
  `propose` also takes the hidden states of each request's last accepted position: the runner
  keeps the final hidden states of the sampled rows of the verify step (`forward_hidden`
  returns them already, for prompt logprobs and pooling), the engine gathers each request's
  row at its accepted length (the row after its last accepted proposal) and hands them over
  as `propose(requests, k, hidden=...)`, a [len(requests), hidden] tensor left on the
  device. An MTP head then runs its k small layers on it (one per future token); an EAGLE head
  runs its one-layer decoder autoregressively k times, feeding its own features back, with a
  KV of its own per request as a draft model has (freed by `release`). Tree-shaped proposals
  (EAGLE-2, Medusa) would need a tree attention mask in the verify step; the chain of k
  tokens here is the tree's one-branch case.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Sequence

import numpy as np
import torch

from flashlet.core.request import Request
from flashlet.core.sampling import SamplingColumns, TokenLogprob, _splitmix64
from flashlet.runner.sampler import (StepLogprobs, apply_penalties, ban_early_stops,
                                     exponential_race, sampling_probs)
from flashlet.spec.draft import DraftProposer
from flashlet.spec.api import Proposer, SpeculativeConfig
from flashlet.text.structured import refused_token

__all__ = ["SpeculativeConfig", "Proposer", "NgramProposer", "SpeculativeDecoding", "verify",
           "verify_greedy", "all_plain_greedy"]

class NgramProposer:
    """Prompt lookup: find the request's last n tokens (n from prompt_lookup_max down to
    prompt_lookup_min) earlier in its prompt and output, at their most recent earlier
    occurrence, and propose the k tokens that followed it. No weights; it pays on input-grounded
    work (editing, repeating, summarising a given text), where outputs copy spans of the input.

    Each request's tokens are kept as it grows (`_History`: a step indexes only its new
    tokens), with where each n-gram of the sizes looked up last ended: a proposal is at most
    one dict look-up a size, never a scan of the tokens. A range of sizes wider than
    `MAX_INDEXED_SIZES` (each token costs one entry a size) is not indexed: `lookup` scans.
    Neither is a request past `MAX_INDEXED_TOKENS` tokens: its index costs ~0.6-2.7 us a token to
    build (this CPU, idle to loaded), all at its first proposal, a stall of the whole batch's
    step (20-170 ms at 32k tokens), and ~400 bytes a token, where the scan costs ~10-40 us a
    step (1.4 ms for its first at 32k); one that grows past it drops its index and scans."""

    MAX_INDEXED_SIZES = 8
    MAX_INDEXED_TOKENS = 1024

    def __init__(self, prompt_lookup_min: int = 1, prompt_lookup_max: int = 4):
        self.min_n, self.max_n = prompt_lookup_min, prompt_lookup_max
        indexed = prompt_lookup_max - prompt_lookup_min < self.MAX_INDEXED_SIZES
        self._sizes = range(prompt_lookup_min, prompt_lookup_max + 1) if indexed else range(0)
        self._tokens: dict[int, _History] = {}  # request id -> its tokens so far

    def propose(self, requests: Sequence[Request], k: int) -> list[list[int]]:
        return [self._propose_one(self._history(req), k) for req in requests]

    def _propose_one(self, history: "_History", k: int) -> list[int]:
        """`lookup`'s answer for the history's tokens, from its n-gram index (by `lookup`
        itself where the sizes are not indexed)."""
        tokens = history.tokens
        longest = min(self.max_n, len(tokens) - 1)
        if longest < self.min_n:
            return []
        if not history.indexed:
            return self.lookup(history.array(), k)
        for n in range(longest, self.min_n - 1, -1):
            end = history.last_end(n)
            if end is not None:
                return tokens[end + 1 : end + 1 + k]
        return []

    def lookup(self, tokens: np.ndarray, k: int) -> list[int]:
        """The k tokens after the most recent earlier occurrence of the longest suffix of
        `tokens` (max_n down to min_n long) that occurs earlier; [] if none does."""
        length = len(tokens)
        longest = min(self.max_n, length - 1)
        if longest < self.min_n:
            return []
        ends = np.flatnonzero(tokens[:-1] == tokens[-1])
        end = int(ends[-1]) if len(ends) else -1
        if end >= longest - 1 and (tokens[end - longest + 1 : end].tolist()
                                   == tokens[length - longest : -1].tolist()):
            # the most recent candidate matches the longest suffix: in text that repeats (where
            # proposals are accepted) it usually does, and the check is cheap
            return tokens[end + 1 : end + 1 + k].tolist()
        return self._scan(tokens, k, longest, ends)

    def _scan(self, tokens: np.ndarray, k: int, longest: int, ends: np.ndarray) -> list[int]:
        """`lookup` by a scan: where an earlier match could end are the newest token's earlier
        places (`ends`: each before the last token, so the suffix itself is no match and every
        match has a token after it); each pass keeps the ends whose match is one token longer.
        One scan of the whole array, then work on the few candidates only."""
        length = len(tokens)
        best = ends if self.min_n == 1 else None
        for n in range(2, longest + 1):
            ends = ends[ends >= n - 1]
            ends = ends[tokens[ends - (n - 1)] == tokens[length - n]]
            if not len(ends):
                break
            if n >= self.min_n:
                best = ends
        if best is None or not len(best):
            return []
        start = int(best[-1]) + 1
        return tokens[start : start + k].tolist()

    def _history(self, req: Request) -> "_History":
        history = self._tokens.get(req.request_id)
        if history is None:
            history = self._tokens[req.request_id] = _History(self._sizes, self.MAX_INDEXED_TOKENS)
        total = req.num_tokens
        if total > len(history.tokens):
            history.extend(req.token_slice(len(history.tokens), total))
        return history

    def on_accepted(self, request: Request, num_accepted: int) -> None:
        pass  # nothing proposed is kept

    def release(self, request: Request) -> None:
        self._tokens.pop(request.request_id, None)

    def warm_up(self) -> None:
        pass  # dicts on the host: nothing to compile


class _History:
    """One request's tokens for prompt lookup: a list; for each indexed n-gram size, where each
    n-gram last ended before the newest token (so a token follows it); and a numpy copy made
    up to date only when a scan needs it (sizes not indexed, or more than max_tokens tokens)."""

    def __init__(self, sizes: range, max_tokens: int):
        self.tokens: list[int] = []
        self._sizes, self._widest, self._max_tokens = sizes, max(sizes, default=0), max_tokens
        self.indexed = bool(sizes)  # False: `lookup` scans this request's tokens
        # n tokens (of an indexed size n) -> the last position they end at before the newest
        # token (one dict: keys of different sizes never match)
        self._ends: dict[tuple[int, ...], int] = {}
        self._buffer = np.empty(0, np.int64)
        self._filled = 0  # tokens copied into the buffer

    def extend(self, new: list[int]) -> None:
        if not new:
            return
        tokens = self.tokens
        # the newest token so far, and each new one but the last, now have a token after them
        first = max(len(tokens) - 1, 0)
        tokens += new
        if self.indexed and len(tokens) > self._max_tokens:
            self.indexed, self._ends = False, {}  # too long to index: scanned from now on
        if not self.indexed:
            return
        ends, sizes, widest = self._ends, self._sizes, self._widest
        # (no n-gram of an indexed size ends before the smallest size's last token)
        for end in range(max(first, sizes[0] - 1), len(tokens) - 1):
            # the widest n-gram ending here, and its suffixes (near the start, shorter: its
            # suffixes of sizes past its length are itself, indexed as its own size)
            window = tuple(tokens[max(end - widest + 1, 0) : end + 1])
            for n in sizes:
                ends[window[-n:]] = end

    def last_end(self, n: int) -> int | None:
        """Where the newest n tokens last occurred earlier, ending (None: they did not)."""
        return self._ends.get(tuple(self.tokens[-n:]))

    def array(self) -> np.ndarray:
        """The tokens as an int64 array (a view of a buffer that grows by doubling)."""
        total = len(self.tokens)
        if total > len(self._buffer):
            grown = np.empty(max(2 * total, 64), np.int64)
            grown[: self._filled] = self._buffer[: self._filled]
            self._buffer = grown
        if total > self._filled:
            self._buffer[self._filled : total] = self.tokens[self._filled : total]
            self._filled = total
        return self._buffer[:total]


def make_proposer(config: SpeculativeConfig, engine) -> Proposer:
    """The proposer the config names."""
    if config.method == "ngram":
        return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    return DraftProposer(engine.config, config, engine.device,
                         target_vocab=engine.model_config.vocab_size,
                         target_tokenizer=engine.tokenizer)


class Verified(NamedTuple):
    """One request's result of a verify step: its new tokens (accepted proposals, then the
    model's own), their logprobs if asked for, and how many proposals were accepted."""

    tokens: list[int]
    logprobs: list[TokenLogprob] | None
    num_accepted: int


@dataclass
class SpecStats:
    """Counters since the engine started (vLLM's names: a draft is one request's proposals in
    one verify step)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    def as_dict(self) -> dict:
        drafts, proposed = self.num_drafts, self.num_draft_tokens
        accepted = self.num_accepted_tokens
        return {"spec_num_drafts": drafts, "spec_num_draft_tokens": proposed,
                "spec_num_accepted_tokens": accepted,
                "spec_acceptance_rate": accepted / proposed if proposed else 0.0,
                # tokens a verified request gained a step: its accepted proposals and its own
                "spec_mean_accepted_length": 1 + accepted / drafts if drafts else 0.0}


class SpeculativeDecoding:
    """The engine's side of speculation: who proposes this step, the verification of a step's
    logits, and the counters."""

    def __init__(self, config: SpeculativeConfig, proposer: Proposer):
        self.config = config
        self.proposer = proposer
        self.stats = SpecStats()
        self._proposed: dict[int, Request] = {}  # requests the proposer has seen, by id

    def active(self, num_running: int) -> bool:
        """Speculation pays at small batches; above disable_by_batch_size it is off."""
        limit = self.config.disable_by_batch_size
        return limit is None or num_running <= limit

    def propose(self, running: Sequence[Request]) -> dict[Request, list[int]]:
        """Proposals for the running requests that decode next (only those given any)."""
        candidates = [req for req in running if _can_speculate(req)]
        if not candidates:
            return {}
        k = self.config.num_speculative_tokens
        proposals = {}
        for req, tokens in zip(candidates, self.proposer.propose(candidates, k)):
            self._proposed[req.request_id] = req
            # At most max_new_tokens - generated - 1: the model's own token comes on top.
            room = req.params.max_new_tokens - len(req.output_token_ids) - 1
            if tokens and room > 0:
                proposals[req] = list(tokens[: min(k, room)])
        return proposals

    def accepted(self, proposals: dict[Request, list[int]], requests: list[Request],
                 verified: list) -> None:
        """Count a verify step's results (its `requests`' rows) and tell the proposer."""
        stats = self.stats
        for req, result in zip(requests, verified):
            if req in proposals and not isinstance(result, Exception):
                stats.num_drafts += 1
                stats.num_draft_tokens += len(proposals[req])
                stats.num_accepted_tokens += result.num_accepted
                self.proposer.on_accepted(req, result.num_accepted)

    def release_finished(self, request_ids) -> None:
        """Drop the proposer's state of requests that ended or were preempted."""
        for request_id in request_ids:
            req = self._proposed.pop(request_id, None)
            if req is not None:
                self.proposer.release(req)


def _can_speculate(req: Request) -> bool:
    """A decode whose tokens are all known, that may output more than one more token."""
    p = req.params
    return (req.num_tokens_to_compute == 1 and p.pooling is None
            and len(req.output_token_ids) + 1 < p.max_new_tokens
            and (not req.output_token_ids or req.output_token_ids[-1] >= 0))


# ---- verification ------------------------------------------------------------------------------
@dataclass
class _Rows:
    """The logit rows of a verify step: each sampling request's 1 + k rows, in order."""

    starts: list[int]  # per request: its first row
    proposals: list[list[int]]  # per request: its proposals (row start + j checks proposal j)

    @classmethod
    def of(cls, requests: list[Request], proposals: dict[Request, list[int]]) -> "_Rows":
        starts, props, row = [], [], 0
        for req in requests:
            p = proposals.get(req, [])
            starts.append(row)
            props.append(p)
            row += 1 + len(p)
        return cls(starts, props)

    @property
    def num_rows(self) -> int:
        return self.starts[-1] + 1 + len(self.proposals[-1]) if self.starts else 0

    def request_of_row(self) -> np.ndarray:
        return np.repeat(np.arange(len(self.starts)), [1 + len(p) for p in self.proposals])

    def proposal_of_row(self) -> np.ndarray:
        """[rows]: the token each row checks (-1 on a request's last row: nothing to check)."""
        return np.array([t for p in self.proposals for t in p + [-1]], np.int64)


@torch.inference_mode()
def verify(logits: torch.Tensor, requests: list[Request], proposals: dict[Request, list[int]],
           eos_token_ids) -> list[Verified | Exception]:
    """A verify step's logits [rows, vocab] (each request's 1 + k rows: row j's logits follow
    its j-th proposal) -> each request's accepted tokens (see the module docstring), or the
    exception its grammar raised. Reads the device once for the decisions, and once more for
    logprobs where asked."""
    if all_plain_greedy(requests):  # nothing transforms their logits: each row's argmax decides
        return verify_greedy(logits.argmax(dim=-1), requests, proposals)
    rows = _Rows.of(requests, proposals)
    errors: dict[int, Exception] = {}
    device = logits.device
    row_req = rows.request_of_row()
    proposal = rows.proposal_of_row()
    params = [req.params for req in requests]
    lp_rows = [r for r in range(rows.num_rows) if params[row_req[r]].logprobs is not None]
    raw = torch.log_softmax(logits[lp_rows].float(), dim=-1) if lp_rows else None
    logits = logits.float()
    if any(req.grammar is not None for req in requests):
        mask_grammars(logits, requests, rows, errors)
    logits = _apply_transforms(logits, requests, rows, row_req, eos_token_ids)
    ok, chosen = _decide(logits, requests, rows, row_req, proposal)
    ok, chosen = torch.stack((ok.to(chosen.dtype), chosen)).tolist()  # one read of the device
    results = _accepted(rows, ok, chosen)
    logprobs = _logprobs(raw, lp_rows, row_req, rows, results, params, device) if lp_rows else {}
    return [errors.get(i) or Verified(tokens, logprobs.get(i), a)
            for i, (tokens, a) in enumerate(results)]


def all_plain_greedy(requests: Sequence[Request]) -> bool:
    """Is every request plain greedy (SamplingParams.plain_greedy, no grammar): each row's
    argmax is its token, in a decode step, and decides its verification (`verify_greedy`)."""
    return all(req.plain_greedy and req.grammar is None for req in requests)


def verify_greedy(tokens: torch.Tensor | list[int], requests: list[Request],
                  proposals: dict[Request, list[int]]) -> list[Verified]:
    """`verify` for a step whose requests are all plain greedy (`all_plain_greedy`: nothing
    transforms their logits), from each row's argmax token [rows] (the fused path's LM head
    argmax, as their decode steps take it without speculation): no logits at all. A tensor is
    read from the device once; a list has been read already."""
    chosen = tokens.tolist() if isinstance(tokens, torch.Tensor) else tokens
    results, start = [], 0
    for req in requests:  # a request's rows: its token's, then one after each proposal
        props = proposals.get(req, ())
        a = 0
        while a < len(props) and chosen[start + a] == props[a]:
            a += 1
        results.append(Verified(list(props[:a]) + [chosen[start + a]], None, a))
        start += 1 + len(props)
    return results


def _accepted(rows: _Rows, ok: list[bool], chosen: list[int]) -> list[tuple[list[int], int]]:
    """Per request: (its accepted proposals then the token drawn at the first rejection or
    after the last proposal, how many proposals it accepted)."""
    results = []
    for start, props in zip(rows.starts, rows.proposals):
        a = 0
        while a < len(props) and ok[start + a]:
            a += 1
        results.append((props[:a] + [chosen[start + a]], a))
    return results


def mask_grammars(logits: torch.Tensor, requests: list[Request], rows: "_Rows",
                  errors: dict) -> None:
    """Each constrained request's rows masked as its grammar would mask them were its
    proposals accepted one by one: row j's mask is the grammar's after proposals 0 .. j - 1
    (the matcher is walked over them and rolled back). A proposal the grammar refuses is
    masked out in its own row, so it is rejected there and the rows after it are never read."""
    import xgrammar as xgr  # structured output's library, loaded once a grammar is in use

    for i, req in enumerate(requests):
        if req.grammar is None:
            continue
        start, props = rows.starts[i], rows.proposals[i]
        bitmask = xgr.allocate_token_bitmask(len(props) + 1, logits.shape[1])
        filled, walked = 0, 0
        try:
            for j in range(len(props) + 1):
                req.grammar.fill_next_token_bitmask(bitmask, j)
                filled += 1
                if j == len(props) or not req.grammar.accept_token(props[j]):
                    break
                walked += 1
                if req.grammar.is_terminated():  # a stop: the scheduler drops what follows
                    break
        except Exception as e:  # one bad request must not fail the batch
            errors[i] = e
        finally:
            if walked:
                req.grammar.rollback(walked)
        if filled:
            span = logits[start : start + filled]
            xgr.apply_token_bitmask_inplace(span, bitmask[:filled].to(logits.device),
                                            vocab_size=logits.shape[1])


def advance_verified_grammars(requests: list[Request], results: list, eos_token_ids,
                              vocab_size: int) -> list:
    """Feed each constrained request the tokens it keeps, up to a stop (which ends it, and
    its grammar); a token its grammar refuses turns the row into that error (`refused_token`)."""
    results = list(results)
    for i, req in enumerate(requests):
        result = results[i]
        if req.grammar is None or req.is_finished or isinstance(result, Exception):
            continue
        p = req.params
        for token in result.tokens:
            if not req.grammar.accept_token(token):
                results[i] = refused_token(req.grammar, token, vocab_size)
                break
            if (not p.ignore_eos and token in eos_token_ids) or token in p.stop_token_ids:
                break
    return results


def _apply_transforms(logits: torch.Tensor, requests: list[Request], rows: _Rows,
                      row_req: np.ndarray, eos_token_ids) -> torch.Tensor:
    """The sampler's transforms before temperature, per position: min_tokens' mask, the logit
    bias and the penalties, each position seeing the proposals before it as output tokens."""
    for i, req in enumerate(requests):
        p, start, props = req.params, rows.starts[i], rows.proposals[i]
        generated = len(req.output_token_ids)
        if p.min_tokens > generated:  # positions still short of min_tokens may not stop
            banned = p.early_stop_ids(eos_token_ids)
            short = min(p.min_tokens - generated, len(props) + 1)
            if banned and req.grammar is not None:  # a grammar's end wins (ban_early_stops)
                span = torch.arange(start, start + short, device=logits.device)
                ban_early_stops(logits, span.repeat_interleave(len(banned)),
                                torch.tensor(banned * short, device=logits.device))
            elif banned:
                logits[start : start + short, banned] = float("-inf")
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias), device=logits.device)
            bias = torch.tensor(list(p.logit_bias.values()), dtype=logits.dtype, device=logits.device)
            logits[start : start + len(props) + 1, ids] += bias
        if p.has_penalties:
            span = slice(start, start + len(props) + 1)
            logits[span] = _penalised(logits[span], req, props)
    return logits


def _penalised(logits: torch.Tensor, req: Request, props: list[int]) -> torch.Tensor:
    """The penalties (sampler.apply_penalties, dense) on one request's k + 1 rows: row j counts
    the output so far and proposals 0 .. j - 1."""
    vocab, device, p = logits.shape[1], logits.device, req.params
    output = torch.tensor(req.output_token_ids, dtype=torch.int64, device=device)
    base = torch.bincount(output, minlength=vocab)[:vocab]
    steps = torch.zeros(len(props) + 1, vocab, dtype=base.dtype, device=device)
    if props:  # row j adds proposals before j: a cumulative one-hot
        one_hot = torch.zeros(len(props), vocab, dtype=base.dtype, device=device)
        one_hot[torch.arange(len(props)), torch.tensor(props, device=device)] = 1
        steps[1:] = one_hot.cumsum(0)
    counts = base + steps
    prompt_mask = torch.zeros(vocab, dtype=torch.bool, device=device)
    prompt_mask[torch.tensor(req.prompt_token_ids, device=device)] = True
    n = len(props) + 1
    column = lambda v: torch.full((n,), float(v), device=device)  # noqa: E731
    return apply_penalties(logits, counts, prompt_mask.expand(n, vocab),
                           column(p.presence_penalty), column(p.frequency_penalty),
                           column(p.repetition_penalty))


def _decide(logits: torch.Tensor, requests: list[Request], rows: _Rows, row_req: np.ndarray,
            proposal: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: is its proposal accepted, and the token drawn there should it be the first
    rejection (or the last row). Greedy rows: accept where the proposal is the argmax, draw
    the argmax. Sampled rows: accept with probability p(x); draw from p without x."""
    device = logits.device
    chosen = logits.argmax(dim=-1)
    prop = torch.from_numpy(proposal).to(device)
    has_prop = prop >= 0
    ok = (chosen == prop) & has_prop
    params = [req.params for req in requests]
    random = [r for r in range(len(row_req)) if not params[row_req[r]].is_greedy]
    if not random:
        return ok, chosen
    index = torch.tensor(random, dtype=torch.int64, device=device)
    columns = SamplingColumns.of([params[row_req[r]] for r in random])
    cols = torch.from_numpy(columns.sample).to(device)  # temperature, top_k, top_p, min_p
    probs = sampling_probs(logits[index], *cols.unbind(1))
    uniform, noise = _randomness(requests, rows, row_req, random, probs)
    x = prop[index]
    safe_x = x.clamp(min=0).unsqueeze(1)
    p_x = probs.gather(1, safe_x).squeeze(1)
    accept = (uniform < p_x) & (x >= 0)
    residual = probs.scatter(1, safe_x, torch.where(x >= 0, 0.0, p_x).unsqueeze(1))
    ok[index] = accept
    chosen[index] = exponential_race(residual, noise)
    return ok, chosen


def _randomness(requests: list[Request], rows: _Rows, row_req: np.ndarray, random: list[int],
                probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A uniform and a row of Exp(1) noise per sampled row. A seeded request draws its rows
    from a generator keyed by its seed and output position, so its tokens depend on neither
    the batch nor the step they ran in."""
    device = probs.device
    uniform = torch.rand(len(random), device=device)
    noise = torch.empty_like(probs).exponential_()
    at = {r: j for j, r in enumerate(random)}
    for i, req in enumerate(requests):
        seed = req.params.seed
        if seed is None or req.params.is_greedy:
            continue
        g = torch.Generator(device=device)
        g.manual_seed(_splitmix64(seed % 2**64, len(req.output_token_ids)))
        first, n = at[rows.starts[i]], 1 + len(rows.proposals[i])
        uniform[first : first + n] = torch.rand(n, device=device, generator=g)
        noise[first : first + n].exponential_(generator=g)
    return uniform, noise


def _logprobs(raw: torch.Tensor, lp_rows: list[int], row_req: np.ndarray, rows: _Rows,
              results: list, params, device) -> dict[int, list[TokenLogprob]]:
    """Each asking request's logprobs of its new tokens (the model's raw ones, as the sampler
    reports them) -> {request index: one per new token}."""
    chosen_at = {}
    for i, (tokens, _) in enumerate(results):
        for j, token in enumerate(tokens):
            chosen_at[rows.starts[i] + j] = token
    keep = [n for n, r in enumerate(lp_rows) if r in chosen_at]
    picked = [lp_rows[n] for n in keep]
    ks = [params[row_req[r]].logprobs for r in picked]
    step = StepLogprobs(picked, ks, raw[keep], torch.tensor([chosen_at[r] for r in picked],
                                                             dtype=torch.int64, device=device))
    if device.type == "cuda":  # its copies to the host do not block: wait for them here
        torch.cuda.current_stream(device).synchronize()
    out: dict[int, list[TokenLogprob]] = {}
    for r in picked:
        out.setdefault(int(row_req[r]), []).append(step.get(r))
    return out
