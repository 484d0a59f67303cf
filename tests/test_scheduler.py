"""The scheduler's update against its slow, obvious form: random runs of requests through the
real schedule / on_launch / update, one step in flight as with overlap (so rows go void when a
request stops or is aborted while the next step is launched), with EOS, stop token ids, the last
allowed token, failed rows and logprobs; every step's outputs and the requests' final state must
be what sending every row through all the checks (`Scheduler._update_row`) gives."""

import random

import pytest

from flashlet.core.request import Request, RequestStatus
from flashlet.core.sampling import SamplingParams, TokenLogprob
from flashlet.core.scheduler import Scheduler
from flashlet.kvcache.kv_pool import PageAllocator

EOS = 1


class StepLogprobsStub:
    """sampler.StepLogprobs' interface: a row's logprob."""

    def get(self, row):
        return TokenLogprob(row, -0.5 * row, [(row, -0.5 * row)])


def every_row_checked(self, out, tokens, logprobs):
    """Scheduler._append_tokens without its fast path: each row through _update_row."""
    return [self._update_row(req, row, slot, token, logprobs)
            for row, (req, slot, token) in enumerate(zip(out.sampling, out.slots, tokens))
            if req.status is not RequestStatus.FINISHED]


def random_run(seed: int) -> tuple[list, list]:
    """Every step's outputs and each request's final state, of one random run."""
    rng = random.Random(seed)
    sched = Scheduler(PageAllocator(40), 4, max_num_seqs=5, max_num_batched_tokens=12,
                      enable_prefix_cache=seed % 2 == 0, eos_token_ids={EOS})
    requests = []
    for rid in range(10):
        prompt = [rng.randrange(2, 12) for _ in range(rng.randrange(1, 14))]
        params = SamplingParams(max_new_tokens=rng.randrange(1, 10),
                                ignore_eos=rng.random() < 0.3,
                                stop_token_ids=rng.sample(range(2, 12), rng.randrange(0, 3)))
        req = Request(rid, prompt, params)
        if rng.random() < 0.3:
            req.output_logprobs = []  # asked for logprobs
        sched.add(req)
        requests.append(req)
    steps, in_flight = [], None
    for _ in range(300):
        if not sched.has_unfinished() and in_flight is None:
            break
        out = sched.schedule()
        if out.scheduled:
            sched.on_launch(out)
        if rng.random() < 0.05 and sched.running:  # an abort while a step is in flight
            sched.abort(rng.choice(sched.running).request_id)
        if in_flight is not None:
            tokens = [RuntimeError("sampling failed") if rng.random() < 0.03
                      else EOS if rng.random() < 0.1 else rng.randrange(2, 12)
                      for _ in in_flight.sampling]
            steps.append(sched.update(in_flight, tokens, StepLogprobsStub()))
            sched.check_integrity()
        in_flight = out if out.scheduled else None
    assert not sched.has_unfinished(), "the run did not finish"
    states = [(r.output_token_ids, r.finish_reason, r.error, r.output_logprobs, r.status)
              for r in requests]
    return steps, states + [sched.allocator.num_free, sched.cache.num_pages]


@pytest.mark.parametrize("seed", range(40))
def test_update_gives_what_checking_every_row_gives(seed, monkeypatch):
    got = random_run(seed)
    monkeypatch.setattr(Scheduler, "_append_tokens", every_row_checked)
    want = random_run(seed)
    assert got == want


def test_the_random_runs_reach_every_way_a_row_ends():
    """The runs above see each kind of row the fast path must leave to _update_row."""
    reasons = {reason for seed in range(40) for reason in
               (state[1] for state in random_run(seed)[1][:-2])}
    assert reasons == {"stop", "length", "abort", "error"}


def test_a_prompt_run_again_gives_the_tree_the_pages_it_recomputed_and_decoded():
    """A cached prompt's last token always runs, so a prompt of whole pages recomputes its last
    page, and a greedy run again decodes the pages the first run cached: the tree holds them
    already. With no other request on them, the tree takes the request's pages and frees its
    own (found below the path it holds locked, with no walk from the root), so the request's
    page table only ever grows at its end (a running row's indices never move under it), every
    ownership invariant holds, and the pool ends as the first run left it."""
    sched = Scheduler(PageAllocator(40), 4, max_num_seqs=4, max_num_batched_tokens=16,
                      enable_prefix_cache=True, eos_token_ids={EOS})
    prompt = list(range(2, 14))  # three whole pages
    held_after = []
    for rid in range(2):
        req = Request(rid, prompt, SamplingParams(max_new_tokens=10, ignore_eos=True))
        sched.add(req)
        pages_before = []
        while sched.has_unfinished():
            out = sched.schedule()
            for i, first, _ in out.batch_update.pages:
                assert i == rid and first == len(pages_before), "a page-table entry changed"
            pages_before = list(req.page_ids)
            sched.on_launch(out)
            sched.update(out, [5 + len(req.output_token_ids)] * len(out.sampling), StepLogprobsStub())
            sched.check_integrity()
            if req.num_computed_tokens >= len(prompt) and req.status is RequestStatus.RUNNING:
                tree_pages = sched.cache.match_prefix(req.token_slice(0, req.num_computed_tokens))[0]
                assert req.page_ids[:req.num_tree_pages] == tree_pages
                assert req.num_tree_pages == req.num_computed_tokens // 4
                assert req.page_ids[:len(pages_before)] == pages_before
        held_after.append((sched.allocator.num_free, sched.cache.num_pages))
    assert held_after[1] == held_after[0], "the second run left the pool otherwise"
    assert sum(held_after[1]) == 40


def test_two_requests_decoding_the_same_tokens_share_the_first_ones_pages():
    """Two greedy requests of one prompt running at once cache the same continuation: the one
    whose pages fill second finds them held by the other, takes the tree's pages (its page
    table changes inside) and frees its own; the pool ends with one copy."""
    sched = Scheduler(PageAllocator(40), 4, max_num_seqs=4, max_num_batched_tokens=32,
                      enable_prefix_cache=True, eos_token_ids={EOS})
    prompt = list(range(2, 10))  # two whole pages
    reqs = [Request(rid, prompt, SamplingParams(max_new_tokens=9, ignore_eos=True)) for rid in range(2)]
    for req in reqs:
        sched.add(req)
    moved, tables = [], {}
    while sched.has_unfinished():
        out = sched.schedule()
        moved += [(i, first) for i, first, _ in out.batch_update.pages if first < len(tables.get(i, []))]
        tables = {r.request_id: list(r.page_ids) for r in reqs}
        sched.on_launch(out)
        sched.update(out, [5 + len(r.output_token_ids) for r in out.sampling], StepLogprobsStub())
        sched.check_integrity()
        a, b = reqs
        if a.status is b.status is RequestStatus.RUNNING and a.num_tree_pages == b.num_tree_pages:
            assert a.page_ids[:a.num_tree_pages] == b.page_ids[:b.num_tree_pages]
    assert moved, "no request took another's pages"
    # one copy of the prompt's 2 pages and the continuation's (17 tokens: 4 whole pages)
    assert sched.cache.num_pages == 4 and sched.allocator.num_free == 36
