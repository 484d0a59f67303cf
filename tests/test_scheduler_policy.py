"""The scheduler's policy, in counted steps (no model, no clock): stall-free steps while decodes
run (issue 32), client requests taking turns with their prompts (issue 35, item 7), and the
priority policy (vLLM's `priority`, lower first)."""

import random

import pytest

from flashlet import Engine, EngineConfig, SamplingParams
from flashlet.core.request import Request
from flashlet.core.scheduler import Scheduler
from flashlet.kvcache.kv_pool import PageAllocator

PAGE = 16


def make_scheduler(budget=512, decode_budget=None, num_pages=40_000, policy="fcfs",
                   max_num_seqs=256, page_size=PAGE):
    return Scheduler(PageAllocator(num_pages), page_size, max_num_seqs=max_num_seqs,
                     max_num_batched_tokens=budget, enable_prefix_cache=False,
                     max_decode_step_tokens=decode_budget, policy=policy)


def make_request(rid, prompt_len, new_tokens=16, group=None, priority=0):
    prompt = [(rid * 31 + i) % 1000 + 2 for i in range(prompt_len)]
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True, priority=priority)
    return Request(rid, prompt, params, group=group)


def run_step(sched):
    """One step, its tokens read at once -> the step's (request, tokens) pairs."""
    out = sched.schedule()
    sched.on_launch(out)
    sched.update(out, [7] * len(out.sampling))
    sched.check_integrity()
    return out.scheduled


def steps_until_done(sched, req, limit=10_000):
    for step in range(1, limit + 1):
        run_step(sched)
        if req.is_finished:
            return step
    raise AssertionError(f"request {req.request_id} did not finish in {limit} steps")


# ---- stall-free steps -------------------------------------------------------------------------
def test_steps_with_decodes_stay_within_the_decode_step_budget():
    sched = make_scheduler(budget=8192, decode_budget=512)
    decoders = [make_request(i, 20, new_tokens=400) for i in range(64)]
    for req in decoders:
        sched.add(req)
    run_step(sched)  # every decoder's prompt in one prefill-only step
    long_prompts = [make_request(100 + i, 8000, new_tokens=4) for i in range(8)]
    for req in long_prompts:
        sched.add(req)
    prompt_tokens = []
    while not all(len(r.output_token_ids) for r in long_prompts):
        scheduled = run_step(sched)
        assert sum(n for _, n in scheduled) <= 512  # every one of these steps carries decodes
        prompt_tokens.append(sum(n for r, n in scheduled if r in long_prompts))
    assert all(n > 0 for n in prompt_tokens), "a step with decodes left the prompts out"
    assert sum(prompt_tokens) >= 8 * 8000


def test_prefill_only_steps_use_the_whole_budget():
    sched = make_scheduler(budget=8192, decode_budget=512)
    sched.add(make_request(0, 20_000, new_tokens=2))
    assert [n for _, n in run_step(sched)] == [8192]
    assert [n for _, n in run_step(sched)] == [8192]


@pytest.mark.parametrize("decodes,prompt_tokens", [(8, 248), (64, 256), (100, 400), (200, 800)])
def test_a_step_with_many_decodes_carries_four_prompt_tokens_a_decode(decodes, prompt_tokens):
    """Up to the decode-step budget (256) in all, or 4 prompt tokens a decode where more."""
    sched = make_scheduler(budget=2048, decode_budget=256, max_num_seqs=300)
    for i in range(decodes):
        sched.add(make_request(i, 4, new_tokens=50))
    run_step(sched)
    sched.add(long := make_request(999, 3000, new_tokens=2))
    scheduled = dict((r.request_id, n) for r, n in run_step(sched))
    assert scheduled[long.request_id] == prompt_tokens and len(scheduled) == decodes + 1


def test_engine_config_budgets_follow_the_device_and_the_server_bounds_decode_steps():
    cpu = EngineConfig(device="cpu")
    assert (cpu.max_num_batched_tokens, cpu.max_decode_step_tokens) == (256, 256)
    cuda = EngineConfig(device="cuda")
    assert (cuda.max_num_batched_tokens, cuda.max_decode_step_tokens) == (8192, 8192)
    assert cpu.for_serving(False).max_decode_step_tokens == 64
    assert cuda.for_serving(False).max_decode_step_tokens == 512
    assert cuda.for_serving(True).max_decode_step_tokens == 8192  # given: kept
    small = EngineConfig(device="cuda", max_num_batched_tokens=300)
    assert small.for_serving(False).max_decode_step_tokens == 300  # never above the budget
    assert EngineConfig(device="cpu", max_num_seqs=1000).max_num_batched_tokens == 1000
    given = EngineConfig(device="cuda", max_num_batched_tokens=2048, max_decode_step_tokens=1024)
    assert (given.max_num_batched_tokens, given.max_decode_step_tokens) == (2048, 1024)
    with pytest.raises(ValueError, match="max_decode_step_tokens"):
        EngineConfig(max_decode_step_tokens=0)


# ---- client requests take turns -------------------------------------------------------------
def short_request_steps(with_big_request: bool) -> int:
    """Steps a 40-token, 16-new-token request takes, alone or arriving one step after a request
    of 64 prompts x 8,000 tokens (group "big")."""
    sched = make_scheduler(budget=512, decode_budget=128)
    if with_big_request:
        for i in range(64):
            sched.add(make_request(i, 8000, new_tokens=8, group="big"))
        run_step(sched)
    short = make_request(1000, 40, group="short")
    sched.add(short)
    return steps_until_done(sched, short)


def test_a_short_request_is_not_stuck_behind_64_long_prompts_of_another():
    idle = short_request_steps(False)
    loaded = short_request_steps(True)
    assert idle == 16
    assert loaded <= 2 * idle + 1, f"{loaded} steps against {idle} alone"


def test_the_prompts_of_one_group_come_in_arrival_order():
    sched = make_scheduler(budget=512)
    reqs = [make_request(i, 300, new_tokens=1, group="g") for i in range(4)]
    for req in reqs:
        sched.add(req)
    assert [(r.request_id, n) for r, n in run_step(sched)] == [(0, 300), (1, 212)]
    assert [(r.request_id, n) for r, n in run_step(sched)] == [(1, 88), (2, 300), (3, 124)]


def test_groups_share_a_prefill_only_step_evenly_then_in_order():
    sched = make_scheduler(budget=512)
    sched.add(a := make_request(0, 5000, group="a"))
    sched.add(b := make_request(1, 5000, group="b"))
    sched.add(c := make_request(2, 100, group="c"))
    assert [(r, n) for r, n in run_step(sched)] == [(a, 171 + 70), (b, 171), (c, 100)]


def test_a_burst_of_short_requests_is_served_first_come_first_served():
    """Four groups at most split a step: the fifth request of a burst waits its turn."""
    sched = make_scheduler(budget=512)
    reqs = [make_request(i, 100, group=i) for i in range(8)]
    for req in reqs:
        sched.add(req)
    assert [(r.request_id, n) for r, n in run_step(sched)] == [(i, 100) for i in range(5)] + [(5, 12)]


# ---- priority -----------------------------------------------------------------------------------
def admitted_order(policy, priorities):
    sched = make_scheduler(budget=64, policy=policy, max_num_seqs=len(priorities))
    for i, p in enumerate(priorities):
        sched.add(make_request(i, 64, new_tokens=1, priority=p))
    return [r.request_id for step in range(len(priorities)) for r, _ in run_step(sched)]


def test_a_priority_request_jumps_the_queue():
    assert admitted_order("priority", [0, 0, 0, -5, 3, -5]) == [3, 5, 0, 1, 2, 4]


def test_fcfs_ignores_priority_order():
    assert admitted_order("fcfs", [0, 0, 0, -5, 3, -5]) == [0, 1, 2, 3, 4, 5]


def test_priority_outside_the_priority_policy_is_refused(tiny_qwen2):
    from flashlet import Engine

    engine = Engine(EngineConfig(model=str(tiny_qwen2)))
    with pytest.raises(ValueError, match="^priority: 3 needs the priority scheduling policy"):
        engine.add_request([5, 6, 7], SamplingParams(priority=3))
    engine = Engine(EngineConfig(model=str(tiny_qwen2), scheduling_policy="priority"))
    engine.add_request([5, 6, 7], SamplingParams(priority=3))
    with pytest.raises(ValueError, match="scheduling_policy"):
        EngineConfig(scheduling_policy="lifo")
    with pytest.raises(ValueError, match="^priority must be"):
        SamplingParams(priority=1.5)


def test_an_engine_serves_a_short_request_beside_a_many_prompt_one(tiny_qwen2):
    """Through Engine.add_request(group=) on a real (tiny) model: the short request takes no
    more than twice its idle steps plus one beside 16 long prompts of one request, and gives
    the tokens it gives alone."""
    from flashlet import Engine

    def short_request(with_big_request: bool) -> tuple[int, list[int]]:
        engine = Engine(EngineConfig(model=str(tiny_qwen2), max_num_seqs=32,
                                     max_num_batched_tokens=64, max_decode_step_tokens=32))
        if with_big_request:
            for i in range(16):
                engine.add_request([(i * 13 + j) % 250 + 2 for j in range(400)],
                                   SamplingParams(max_new_tokens=4, ignore_eos=True), group=1)
            engine.step()
        rid = engine.add_request([5, 6, 7, 8, 9], SamplingParams(max_new_tokens=8, ignore_eos=True),
                                 group=2)
        for steps in range(1, 1000):
            done = [o for o in engine.step() if o.request_id == rid and o.finished]
            if done:
                return steps, done[0].token_ids
        raise AssertionError("the short request never finished")

    idle_steps, idle_tokens = short_request(False)
    steps, tokens = short_request(True)
    assert tokens == idle_tokens
    assert steps <= 2 * idle_steps + 1, f"{steps} steps against {idle_steps} alone"


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_random_groups_and_priorities_keep_every_invariant(policy):
    """Random arrivals in several groups, with priorities, through a pool small enough to
    preempt: every step within its budgets, its sampling rows the requests that reach their
    last token, pages owned once, and every request finished with all its tokens."""
    import random

    num_preemptions = 0
    for seed in range(6):
        rng = random.Random(seed)
        sched = make_scheduler(budget=24, decode_budget=10, num_pages=14, policy=policy,
                               max_num_seqs=5, page_size=4)
        requests, next_id = [], 0
        for _ in range(500):
            if next_id < 30 and rng.random() < 0.3:
                req = make_request(next_id, rng.randrange(1, 30), rng.randrange(1, 6),
                                   group=rng.randrange(3), priority=rng.randrange(-2, 3))
                sched.add(req)
                requests.append(req)
                next_id += 1
            if not sched.has_unfinished():
                continue
            decoders = {r for r in sched.running if r.num_tokens_to_compute == 1}
            out = sched.schedule()
            num_decodes = sum(1 for r, _ in out.scheduled if r in decoders)
            total = out.num_batched_tokens
            assert total <= 24
            if num_decodes:
                assert total - num_decodes <= max(10 - num_decodes, 4 * num_decodes)
            want = [r for r, n in out.scheduled if r.num_computed_tokens + n == r.num_tokens]
            assert out.sampling == want
            sched.on_launch(out)
            sched.update(out, [rng.randrange(2, 50) for _ in out.sampling])
            sched.check_integrity()
        while sched.has_unfinished():
            out = sched.schedule()
            sched.on_launch(out)
            sched.update(out, [7] * len(out.sampling))
        assert all(len(r.output_token_ids) == r.params.max_new_tokens for r in requests)
        assert sched.allocator.num_free + sched.cache.num_pages == 14
        num_preemptions += sched.num_preemptions
    assert num_preemptions > 0, "the pool was not small enough to preempt"


@pytest.mark.parametrize("seed", range(3))
def test_the_runners_batch_follows_admissions_and_preemptions_under_page_pressure(tiny_qwen2,
                                                                                  seed):
    """Many requests of several groups on 16 pages of 4 tokens, prompts arriving while others
    decode (the soak's shape): requests are admitted, preempted and admitted again, sometimes
    within one update. After every step the runner's rows are exactly the running requests
    (check_integrity runs Scheduler.check_batch), and every request ends with its tokens."""
    rng = random.Random(seed)
    engine = Engine(EngineConfig(model=str(tiny_qwen2), page_size=4, max_num_pages=16,
                                 max_num_seqs=12, max_decode_step_tokens=8))
    pending = [(rng.randrange(1, 24), rng.randrange(1, 40), rng.randrange(4)) for _ in range(40)]
    lengths, done = {}, {}
    while pending or engine.has_unfinished():
        for _ in range(rng.randrange(4)):
            if pending:
                prompt_len, new, group = pending.pop()
                rid = engine.add_request([rng.randrange(1, 200) for _ in range(prompt_len)],
                                         SamplingParams(max_new_tokens=new, ignore_eos=True),
                                         group=group)
                lengths[rid] = new
        for out in engine.step():
            done[out.request_id] = done.get(out.request_id, 0) + len(out.new_token_ids)
        engine.check_integrity()
    assert done == lengths
    assert engine.scheduler.num_preemptions > 0  # the pressure was real
