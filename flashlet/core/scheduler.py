"""The scheduler: which requests run this step and how many tokens each computes.

There is no prefill phase and no decode phase: every request has tokens computed and tokens
still to compute. Each step, in order:
1. every running request with one token to compute (a decode) gets it;
2. what budget is left goes to prompts: chunks of running requests part-way through their
   prompt, and waiting requests admitted (longest cached prefix first adopted) while
   `max_num_seqs` and free pages allow. A step that carries decodes stops at
   `max_decode_step_tokens`, or at PROMPT_TOKENS_PER_DECODE prompt tokens a decode where that
   is more (stall-free batching: a long prompt lengthens every token gap by a bounded amount,
   and still progresses every step); a prefill-only step uses the whole budget.
   Prompts are taken in arrival order (by `priority` first under the priority policy), except
   that prompts of different client requests (`Request.group`) take turns: each group's k-th
   prompt comes after every group's (k-1)-th, and while several groups have prompts to compute,
   each group's first one gets an equal share of the budget first (a quarter at least: see
   MAX_SHARING_GROUPS), the rest going in order; so a short request is not stuck behind a
   request of 64 long prompts, nor behind one long prompt's chunks. One group (LLM.generate, an
   in-process engine) is plain arrival order, as in vLLM.
When pages run out, unlocked prefix-cache pages are evicted first; then the newest running
request is preempted: its pages are released (full pages go into the prefix cache) and it waits
to be recomputed, keeping the tokens it has generated so its output does not change.

The scheduler is the one owner of its requests' scheduling state and pages. After a step is
launched, `on_launch` counts its tokens as computed and gives each request that samples a
placeholder for its token; once the tokens are read, `update` writes them in, applies the stop
checks (EOS, max_new_tokens), caches completed pages and retires finished requests. With
overlap (engine.py) the next step is scheduled between the two.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from functools import cached_property
from operator import attrgetter, itemgetter
from typing import NamedTuple

from flashlet.core.request import PLACEHOLDER, FinishReason, Request, RequestOutput, RequestStatus
from flashlet.core.request_check import RequestError
from flashlet.core.sampling import SamplingParams
from flashlet.kvcache.kv_pool import OutOfPages, PageAllocator
from flashlet.kvcache.radix_cache import PageHolder, RadixCache


class NewRow(NamedTuple):
    """A request taking a row of the runner's batch: what the row keeps while it runs."""

    request_id: int
    page_ids: list[int]
    params: SamplingParams  # the row's sampling columns (batch.InputBatch.sampling)
    num_prompt_tokens: int  # to tell which output token a sampled position produces


@dataclass
class BatchUpdate:
    """What the model runner's persistent batch (batch.InputBatch) needs for a step: what
    changed since the last one, and the step's columns, one entry per scheduled request in
    row order. Plain data: tensor-parallel rank 0 sends it to the workers as it is."""

    removed: list[int] = field(default_factory=list)  # request ids: finished or preempted
    added: list[NewRow] = field(default_factory=list)
    # (id, first entry that changed, the page table from it on): pages appended, or the prefix
    # cache's own copies swapped in for a request's duplicates
    pages: list[tuple[int, int, list[int]]] = field(default_factory=list)
    request_ids: list[int] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)  # tokens computed before this step
    token_ids: list[int] = field(default_factory=list)  # every row's new tokens, in order
    query_lens: list[int] | None = None  # new tokens of each row; None: one each
    sample: list[bool] | None = None  # does each row sample; None: every row
    # Proposals each row verifies (speculative.py), its last spec_lens[i] tokens; each of its
    # last 1 + spec_lens[i] tokens is then sampled. None: no row verifies any.
    spec_lens: list[int] | None = None
    # The rows are the last step's, in its order, each one token on (a decode step after a
    # decode step of the same requests, each sampling in both): request_ids and starts are
    # left empty, and token_ids is None where every row's token is the one it sampled last
    # step, not read yet (overlap): the batch moves its last columns on (InputBatch._advance).
    steady: bool = False


@dataclass
class SchedulerOutput:
    scheduled: list[tuple[Request, int]] = field(default_factory=list)  # (request, new tokens)
    preempted: list[Request] = field(default_factory=list)
    # Requests whose scheduled tokens reach their last token: each samples one, in row order.
    sampling: list[Request] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)  # per sampling row: its placeholder's index
    # Speculative decoding: the proposals each verifying request's row checks, after its token.
    proposals: dict[Request, list[int]] = field(default_factory=dict)
    filled: list[Request] = field(default_factory=list)  # requests that completed a page in it
    batch_update: BatchUpdate = field(default_factory=BatchUpdate)  # for the model runner

    @property
    def num_batched_tokens(self) -> int:
        return sum(map(itemgetter(1), self.scheduled))

    @cached_property  # read once the step is scheduled (by its batch update, then on_launch)
    def is_pure_decode(self) -> bool:
        """Every row computes one token: as every row computes at least one, that is one a row
        in all (summed in C: a generator over 256 rows cost more, every step)."""
        return self.num_batched_tokens == len(self.scheduled)


# While several client requests have prompts to compute, this many at most split a step's
# prompt budget evenly before the rest goes in order: enough that a short request gets in at
# once, few enough that a burst of requests is still served mostly first come, first served
# (an even split among all of them would finish every prompt of the burst last).
MAX_SHARING_GROUPS = 4
# A step with many decodes is long already and may carry this many prompt tokens per decode
# beyond max_decode_step_tokens: its gaps grow in proportion to the decode step's own, and the
# prompts of a closed loop of such streams (a few times as long as their outputs) keep pace,
# where a fixed bound would leave streams waiting for their prefill at high concurrency.
PROMPT_TOKENS_PER_DECODE = 4


def prompt_tokens_beside(num_decodes: int, max_decode_step_tokens: int) -> int:
    """Prompt tokens a step with `num_decodes` decodes may carry: up to max_decode_step_tokens
    in all, or PROMPT_TOKENS_PER_DECODE a decode where that is more (never none: prompts must
    progress)."""
    return max(max_decode_step_tokens - num_decodes, PROMPT_TOKENS_PER_DECODE * num_decodes, 1)


def _newest_tokens(reqs: list[Request]) -> list[int]:
    """Each request's newest token (its last output token, or its prompt's last)."""
    return [(req.output_token_ids or req.prompt_token_ids)[-1] for req in reqs]


@dataclass
class _PromptBudget:
    """The prompt half of one step being scheduled: its tokens left and the chunk each request
    got so far (admitted ones included), in the order they were given."""

    out: SchedulerOutput
    tokens: int
    chunks: dict[Request, int] = field(default_factory=dict)
    admitting: bool = True  # false once a waiting request found no pages: the rest wait too


class Scheduler:
    def __init__(self, allocator: PageAllocator, page_size: int, max_num_seqs: int,
                 max_num_batched_tokens: int, enable_prefix_cache: bool = True,
                 eos_token_ids: frozenset[int] = frozenset(),
                 max_decode_step_tokens: int | None = None, policy: str = "fcfs"):
        self.allocator = allocator
        self.page_size = page_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        # None: steps with decodes in them get the whole budget too (no stall-free bound).
        self.max_decode_step_tokens = min(max_decode_step_tokens or max_num_batched_tokens,
                                          max_num_batched_tokens)
        self.by_priority = policy == "priority"
        self.enable_prefix_cache = enable_prefix_cache
        self.eos_token_ids = frozenset(eos_token_ids)
        self.requests: dict[int, Request] = {}  # every unfinished request, by id
        self.cache = RadixCache(allocator, page_size)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order: the last is the newest
        self.num_preemptions = 0
        # Changes the model runner's batch has not been told of (see _batch_update).
        self._rows_removed: list[int] = []
        self._rows_added: list[Request] = []
        self._pages_changed: dict[int, int] = {}  # request id -> first page entry changed
        # The last update's requests if it was a decode step with every row sampling: the
        # next step of the same requests is steady (BatchUpdate.steady).
        self._last_decode: list[Request] | None = None
        self._unread: SchedulerOutput | None = None  # launched, its tokens not written in

    def add(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is in use")
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- the policy -----------------------------------------------------------------------
    def schedule(self, proposals: dict[Request, list[int]] | None = None) -> SchedulerOutput:
        """proposals: speculative tokens of decoding requests (speculative.py): each such
        decode computes its token and as many of them as the budget allows, to be verified."""
        out = SchedulerOutput()
        budget, prefills = self._schedule_decodes(out, self.max_num_batched_tokens, proposals)
        if out.scheduled:
            budget = min(budget, prompt_tokens_beside(len(out.scheduled),
                                                      self.max_decode_step_tokens))
        partial = [r for r in prefills if r.status is RequestStatus.RUNNING]  # not preempted
        can_admit = self.waiting and len(self.running) < self.max_num_seqs
        if budget > 0 and (partial or can_admit):
            self._schedule_prompts(_PromptBudget(out, budget), partial)
        out.batch_update = self._batch_update(out)
        return out

    def _batch_update(self, out: SchedulerOutput) -> BatchUpdate:
        """What changed for the runner's batch since the last step, and this step's columns. A
        step with nothing scheduled is not run, so its changes wait for the next one."""
        if not out.scheduled:
            return BatchUpdate()
        update = BatchUpdate(removed=self._rows_removed)
        # A request admitted and then preempted or finished before this update is sent holds
        # no row: it is in `removed`, and adding it would leave a waiting request a row.
        running = RequestStatus.RUNNING
        added = {req.request_id: req for req in self._rows_added if req.status is running}
        update.added = [NewRow(i, req.page_ids, req.params, req.num_prompt_tokens)
                        for i, req in added.items()]
        for i, first in self._pages_changed.items():
            req = self.requests.get(i)
            if i not in added and req is not None and req.status is running:
                update.pages.append((i, first, req.page_ids[first:]))
        self._rows_removed, self._rows_added, self._pages_changed = [], [], {}
        every_row_samples = len(out.sampling) == len(out.scheduled)
        decode = every_row_samples and out.is_pure_decode
        if decode and not (update.removed or update.added) and out.sampling == self._last_decode:
            self._fill_steady(update, out.sampling)
        else:
            self._fill_columns(update, out, every_row_samples)
        self._last_decode = out.sampling if decode else None
        return update

    def _fill_steady(self, update: BatchUpdate, reqs: list[Request]) -> None:
        """A steady step's columns: its tokens, unless each is still the placeholder of the
        last step's sampled token (that step is not read yet)."""
        update.steady = True
        update.token_ids = _newest_tokens(reqs) if self._unread is None else None

    def _fill_columns(self, update: BatchUpdate, out: SchedulerOutput,
                      every_row_samples: bool) -> None:
        """The step's columns, one entry per scheduled request in row order."""
        # (every row sampling: `sampling` lists the scheduled requests, in order)
        reqs = out.sampling if every_row_samples else [req for req, _ in out.scheduled]
        update.request_ids = [req.request_id for req in reqs]
        update.starts = starts = [req.num_computed_tokens for req in reqs]
        if not out.is_pure_decode:
            update.query_lens = lens = [n for _, n in out.scheduled]
            update.sample = [start + n >= req.num_tokens  # (> for a verifying row)
                             for req, start, n in zip(reqs, starts, lens)]
            if out.proposals:
                self._add_proposals(update, reqs, out.proposals)
            else:
                update.token_ids = [t for req, start, n in zip(reqs, starts, lens)
                                    for t in req.token_slice(start, start + n)]
        elif every_row_samples:  # each row's token is its newest one
            update.token_ids = _newest_tokens(reqs)
        else:
            update.token_ids = [req.token_at(start) for req, start in zip(reqs, starts)]
            update.sample = [start + 1 == req.num_tokens for req, start in zip(reqs, starts)]

    @staticmethod
    def _add_proposals(update: BatchUpdate, reqs: list[Request],
                       proposals: dict[Request, list[int]]) -> None:
        """A verify step's columns: its token ids, each verifying row's ending in its proposals."""
        update.spec_lens = spec_lens = [len(proposals.get(req, ())) for req in reqs]
        token_ids = update.token_ids = []
        for req, start, n, k in zip(reqs, update.starts, update.query_lens, spec_lens):
            token_ids += req.token_slice(start, start + n - k)
            if k:
                token_ids += proposals[req]

    def _schedule_decodes(self, out: SchedulerOutput, budget: int,
                          proposals: dict[Request, list[int]] | None = None
                          ) -> tuple[int, list[Request]]:
        """One token for each running request with one to compute (a decode; each samples),
        in admission order -> the budget left, and the running requests part-way through their
        prompt (for chunks). A request that has sampled every token it may is in neither: it
        only waits for its last token to be read. One pass over the running requests (it runs
        over every one every step), reading the lists' lengths once."""
        ps, running = self.page_size, RequestStatus.RUNNING
        prefills = []
        for req in list(self.running):  # a copy: preempting removes from the list
            num_output = len(req.output_token_ids)
            computed = req.num_computed_tokens
            if len(req.prompt_token_ids) + num_output - computed > 1:  # prompt left to compute
                prefills.append(req)
                continue
            if num_output >= req.params.max_new_tokens or req.status is not running or budget == 0:
                continue  # all sampled, or preempted earlier in this loop
            n = 1
            if proposals and req in proposals:  # its token and what the budget has room for
                n += len(proposals[req][: budget - 1])
                # Guesses never cost another request its place: without free pages, none.
                if n > 1 and not self._reserve(req, req.num_computed_tokens + n):
                    n = 1
            # Only a decode whose pages are full needs another (most need none).
            if (computed + n > len(req.page_ids) * ps
                    and not self._reserve_or_preempt(req, n, out)):
                continue
            # (a preemption rebuilds out's lists: look them up after it)
            out.scheduled.append((req, n))
            out.sampling.append(req)
            if n > 1:
                out.proposals[req] = proposals[req][: n - 1]
            budget -= n
        return budget, prefills

    def _schedule_prompts(self, step: _PromptBudget, partial: list[Request]) -> None:
        """Prompt chunks for the running requests part-way through their prompt and for
        waiting requests, within step.tokens (see the module's docstring for the order)."""
        order, num_groups = self._prompt_order(partial)
        if num_groups > 1:  # first, the head of each group gets an even share
            share = -(-step.tokens // min(num_groups, MAX_SHARING_GROUPS))
            heads = {}
            for req in order:
                heads.setdefault(req.group, req)
            self._give_chunks(step, heads.values(), share)
        self._give_chunks(step, order, step.tokens)
        for req, n in step.chunks.items():
            if req.status is RequestStatus.RUNNING:  # not preempted by a later chunk
                step.out.scheduled.append((req, n))
                if n == req.num_tokens_to_compute:
                    step.out.sampling.append(req)

    def _prompt_order(self, partial: list[Request]) -> tuple[list[Request], int]:
        """The requests with prompt tokens to compute, in the order they get the budget, and
        how many groups they come from. Running ones keep their place ahead of waiting ones of
        their group; the k-th of each group comes after every group's (k-1)-th."""
        order = partial + list(self.waiting)
        if self.by_priority:
            order.sort(key=attrgetter("params.priority"))  # stable: arrival order within
        rank_in_group: dict[object, int] = {}
        keys = []
        for position, req in enumerate(order):
            rank = rank_in_group.get(req.group, 0)
            rank_in_group[req.group] = rank + 1
            keys.append((req.params.priority if self.by_priority else 0, rank, position))
        if len(rank_in_group) > 1:
            order = [order[k[2]] for k in sorted(keys)]
        return order, len(rank_in_group)

    def _give_chunks(self, step: _PromptBudget, requests, share: int) -> None:
        """Each request in turn up to `share` more prompt tokens, while step.tokens last."""
        for req in requests:
            if step.tokens == 0:
                return
            if req.status is RequestStatus.WAITING:
                n = self._admit(step, req, min(share, step.tokens))
            else:
                n = self._extend_chunk(step, req, min(share, step.tokens))
            step.tokens -= n

    def _extend_chunk(self, step: _PromptBudget, req: Request, most: int) -> int:
        """Up to `most` more of a running request's prompt in this step -> the tokens added (0
        where it was preempted for want of pages)."""
        if req.status is not RequestStatus.RUNNING:
            return 0  # preempted by an earlier chunk of this step
        have = step.chunks.get(req, 0)
        n = min(req.num_tokens_to_compute - have, most)
        if n <= 0:
            return 0
        if not self._reserve_or_preempt(req, have + n, step.out):
            step.chunks.pop(req, None)
            return 0
        step.chunks[req] = have + n
        return n

    # ---- after a step ---------------------------------------------------------------------
    def on_launch(self, out: SchedulerOutput) -> None:
        """The step is on the device: its tokens count as computed, and each request that
        samples holds a placeholder for the token until `update` writes it in. The requests
        that completed a page are noted for `update` to cache it (no pass over every row)."""
        out.slots, out.filled = slots, filled = [], []
        ps = self.page_size
        self._unread = out
        if len(out.sampling) == len(out.scheduled) and out.is_pure_decode:
            # Every row a decode that samples (the steady state): one pass; the rows of
            # `sampling` are those of `scheduled`, in the same order.
            for req in out.sampling:
                computed = req.num_computed_tokens = req.num_computed_tokens + 1
                if computed % ps == 0:
                    filled.append(req)
                output_ids = req.output_token_ids
                slots.append(len(output_ids))
                output_ids.append(PLACEHOLDER)
            return
        for req, n in out.scheduled:
            computed = req.num_computed_tokens = req.num_computed_tokens + n
            if computed // ps > (computed - n) // ps:
                filled.append(req)
        for req in out.sampling:
            output_ids = req.output_token_ids
            slots.append(len(output_ids))
            output_ids.append(PLACEHOLDER)

    def update(self, out: SchedulerOutput, tokens: list, logprobs=None) -> list[RequestOutput]:
        """The launched step's sampled tokens (one per sampling row; an Exception where that
        row's sampling failed) and their logprobs (sampler.StepLogprobs, for the rows that
        asked) -> the requests' outputs. Stop checks, page caching, retiring."""
        if self._unread is out:
            self._unread = None
        outputs = self._append_tokens(out, tokens, logprobs)
        if self.enable_prefix_cache:
            finished = RequestStatus.FINISHED
            for req in out.filled:  # (one preempted or finished since has cached its pages)
                if req.status is not finished:
                    self.cache_computed_pages(req)
        return outputs

    def _append_tokens(self, out: SchedulerOutput, tokens: list, logprobs) -> list[RequestOutput]:
        """Each sampling row's token into its request -> the requests' outputs. Most rows only
        append a token: that case's test and output are inline (a call per row was a large
        part of a 256-row step's host time, issue 13); any other row (a stop, its last token, a
        failure, logprobs) goes through every check in _update_row."""
        outputs = []
        append, finished, eos = outputs.append, RequestStatus.FINISHED, self.eos_token_ids
        for row, (req, slot, token) in enumerate(zip(out.sampling, out.slots, tokens)):
            if req.status is finished:  # aborted, or stopped by the step before: this row is void
                continue
            p = req.params
            if (type(token) is int and slot + 1 < p.max_new_tokens
                    and (p.ignore_eos or token not in eos) and token not in p.stop_token_ids
                    and req.output_logprobs is None
                    and (slot or req.prompt_logprobs is None)):  # only the first carries them
                req.output_token_ids[slot] = token
                # req.output([token]) of a request that goes on without logprobs
                append(RequestOutput(req.request_id, [token], False, None, req.prompt_token_ids,
                                     None, req.num_cached_tokens))
            else:
                append(self._update_row(req, row, slot, token, logprobs))
        return outputs

    def _update_row(self, req: Request, row: int, slot: int, token, logprobs) -> RequestOutput:
        """A row's token written in with every check: its logprob, a failed sampling, a stop
        token, the last token it may have."""
        if isinstance(token, Exception):
            req.finish_reason = FinishReason.ERROR
            if isinstance(token, RequestError):  # the request's own doing (its format)
                req.error, req.error_param = str(token), token.param
            else:
                req.error = f"sampling failed: {token!r}"
            self.finish(req)
            return req.output([])
        if isinstance(token, tuple):  # a verify step's tokens (speculative.Verified)
            return self._append_verified(req, slot, token)
        if logprobs is not None and req.output_logprobs is not None:
            req.output_logprobs.append(logprobs.get(row))
        req.output_token_ids[slot] = token
        p = req.params
        if (not p.ignore_eos and token in self.eos_token_ids) or token in p.stop_token_ids:
            req.finish_reason = FinishReason.STOP
        elif slot + 1 >= p.max_new_tokens:
            req.finish_reason = FinishReason.LENGTH
        if req.finish_reason is not None:
            self.finish(req)
        return req.output([token], first=slot == 0)

    def _append_verified(self, req: Request, slot: int, verified) -> RequestOutput:
        """A verifying row's accepted tokens written in, each checked for a stop and for
        max_new_tokens (the rest dropped); only they count as computed, and the pages past
        them (the rejected proposals' whole pages) are freed."""
        del req.output_token_ids[slot:]  # the placeholder
        p, eos, new = req.params, self.eos_token_ids, []
        logprobs = verified.logprobs
        for i, token in enumerate(verified.tokens):
            req.output_token_ids.append(token)
            new.append(token)
            if logprobs is not None and req.output_logprobs is not None:
                req.output_logprobs.append(logprobs[i])
            if (not p.ignore_eos and token in eos) or token in p.stop_token_ids:
                req.finish_reason = FinishReason.STOP
            elif len(req.output_token_ids) >= p.max_new_tokens:
                req.finish_reason = FinishReason.LENGTH
            if req.finish_reason is not None:
                break
        req.num_computed_tokens = req.num_tokens - 1  # the newest token's K/V is next step's
        self._trim_pages(req)
        if req.finish_reason is not None:
            self.finish(req)
        return req.output(new, first=slot == 0)

    def _trim_pages(self, req: Request) -> None:
        """Free the pages past those `req`'s tokens need (rejected proposals' K/V)."""
        keep = max(-(-req.num_tokens // self.page_size), req.num_tree_pages)
        if len(req.page_ids) > keep:
            self.allocator.free(req.page_ids[keep:])
            self._set_pages(req, req.page_ids[:keep], keep)

    def abort(self, request_id: int,
              finish_reason: FinishReason = FinishReason.ABORT) -> RequestOutput | None:
        """End a request now (pages freed; with "stop", its full computed pages are cached);
        its final output, or None if it is unknown or finished already."""
        req = self.requests.get(request_id)
        if req is None:
            return None
        req.finish_reason = finish_reason
        self.finish(req)
        return req.output([])

    def _reserve_or_preempt(self, req: Request, n: int, out: SchedulerOutput) -> bool:
        """Find pages for `req`'s next `n` tokens, preempting newer requests; False if `req`
        itself had to be preempted."""
        while not self._reserve(req, req.num_computed_tokens + n):
            victim = self.running[-1]
            self.preempt(victim)
            out.preempted.append(victim)
            out.scheduled = [(r, k) for r, k in out.scheduled if r is not victim]
            out.sampling = [r for r in out.sampling if r is not victim]
            out.proposals.pop(victim, None)
            if victim is req:
                return False
        return True

    def _admit(self, step: _PromptBudget, req: Request, most: int) -> int:
        """Admit a waiting request with a chunk of up to `most` tokens -> the tokens given (0:
        not admitted; after a preemption in this step, none is, as pages are short)."""
        if (not step.admitting or step.out.preempted
                or len(self.running) >= self.max_num_seqs):
            return 0
        self._adopt_cached_prefix(req)
        n = min(req.num_tokens_to_compute, most)
        if not self._reserve(req, req.num_computed_tokens + n):
            self.release(req, cache=False)
            step.admitting = False
            return 0
        self.waiting.remove(req)
        if req.num_preemptions == 0:  # a recompute after preemption is not a cache hit
            req.num_cached_tokens = req.num_computed_tokens
            self.cache.queried_tokens += req.num_prompt_tokens
            self.cache.hit_tokens += req.num_cached_tokens
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        self._rows_added.append(req)
        step.chunks[req] = n
        return n

    # ---- pages ----------------------------------------------------------------------------
    def _adopt_cached_prefix(self, req: Request) -> None:
        """Take the longest cached prefix, never the last token (one query token must run).
        None for a mean-pooled embedding or a request still scoring its prompt: each needs
        every prompt position computed."""
        if not self.enable_prefix_cache or req.params.pooling == "mean" or (
                req.prompt_logprobs is not None
                and len(req.prompt_logprobs) < req.num_prompt_tokens):
            return
        usable = (req.num_tokens - 1) // self.page_size * self.page_size
        tokens = req.token_slice(0, usable)
        pages, node = self.cache.match_prefix(tokens)
        self.cache.lock(node)
        self._set_pages(req, list(pages), 0)
        req.num_tree_pages, req.tree_node = len(pages), node
        req.num_computed_tokens = len(pages) * self.page_size

    def _reserve(self, req: Request, num_tokens: int) -> bool:
        """Give `req` pages for `num_tokens` tokens, evicting cached pages if needed."""
        need = -(-num_tokens // self.page_size) - len(req.page_ids)
        if need <= 0:
            return True
        if self.allocator.num_free < need:
            self.cache.evict(need - self.allocator.num_free)
        try:
            self._set_pages(req, req.page_ids + self.allocator.allocate(need), len(req.page_ids))
        except OutOfPages:
            return False
        return True

    def _set_pages(self, req: Request, page_ids: list[int], first_changed: int) -> None:
        """Replace `req`'s page table (entries before first_changed are as they were); the
        runner's batch hears of it with the next step."""
        req.page_ids = page_ids
        changed = self._pages_changed
        i = req.request_id
        changed[i] = min(changed.get(i, first_changed), first_changed)

    def cache_computed_pages(self, req: Request) -> None:
        """Hand `req`'s newly completed full pages to the prefix cache (deduplicating)."""
        if not self.enable_prefix_cache:
            return
        ps = self.page_size
        num_full = req.num_computed_tokens // ps
        if num_full <= req.num_tree_pages:
            return
        if req.tree_node is None:  # it adopted no prefix (it computes every position): its
            req.tree_node = self.cache.root  # path starts at the root, which it now holds too
            self.cache.lock(req.tree_node)
        start = req.num_tree_pages
        mine = req.page_ids[start:num_full]
        node, tree = self.cache.extend_locked(
            req.tree_node, req.token_slice(start * ps, num_full * ps), mine)
        duplicates = [p for p, q in zip(mine, tree) if p != q]  # the tree held these already
        if duplicates:
            self.allocator.free(duplicates)
            self._set_pages(req, req.page_ids[:start] + tree + req.page_ids[num_full:], start)
        req.num_tree_pages, req.tree_node = num_full, node

    def release(self, req: Request, cache: bool = True) -> None:
        """Give back every page `req` holds (full computed pages go to the prefix cache)."""
        if cache:
            self.cache_computed_pages(req)
        self.allocator.free(req.page_ids[req.num_tree_pages :])
        self.cache.unlock(req.tree_node)
        self._set_pages(req, [], 0)
        req.num_tree_pages, req.tree_node = 0, None
        req.num_computed_tokens = 0

    def preempt(self, req: Request) -> None:
        self.running.remove(req)
        self._rows_removed.append(req.request_id)
        self.release(req)
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def finish(self, req: Request) -> None:
        """A request whose finish_reason is set gives back its pages and leaves."""
        req.drop_placeholders()  # rows launched after it stopped, never to be read
        self.requests.pop(req.request_id, None)
        if req in self.running:
            self.running.remove(req)
            self._rows_removed.append(req.request_id)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.release(req, cache=req.finish_reason not in (FinishReason.ABORT, FinishReason.ERROR))
        req.status = RequestStatus.FINISHED

    def check_integrity(self) -> None:
        """Pages are owned exactly once (free list, tree, or one request) and locks add up."""
        live = list(self.running) + [r for r in self.waiting if r.page_ids or r.tree_node]
        self.cache.check_integrity([
            PageHolder(r.tree_node, r.page_ids[: r.num_tree_pages],
                       r.page_ids[r.num_tree_pages :], f"request {r.request_id}") for r in live])
        for req in self.running:
            assert len(req.page_ids) * self.page_size >= req.num_computed_tokens
        for req in self.waiting:
            assert not req.page_ids and req.tree_node is None, "a waiting request holds pages"

    def check_batch(self, batch) -> None:
        """The runner's batch holds what the updates told it: a row for each running request
        with its page table (changes not yet sent aside), and no row for a waiting one."""
        for req in self.running:
            i = req.request_id
            if i not in self._pages_changed:
                assert batch.pages_of(i) == req.page_ids, f"request {i}'s row has other pages"
        removed = set(self._rows_removed)
        for req in self.waiting:
            assert req.request_id not in batch.row_of or req.request_id in removed, \
                f"waiting request {req.request_id} holds a row"
