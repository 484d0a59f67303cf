"""The API process's pieces without a server: how a handler batches the outputs it fell behind
on, and the data-parallel router's rule (where the request finishes first: the core's wait
against the prefill its cached prefix saves)."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest

from flashlet.core.request import RequestOutput
from flashlet.core.sampling import SamplingParams
from flashlet.server.diagnostics import ApiCounters
from flashlet.server.engine_loop import RequestStream, StreamError
from flashlet.server.errors import ApiError
from flashlet.server.frontend import Generation
from flashlet.server.metrics import Metrics
from flashlet.server.router import PrefixRouter


def _generation(items) -> Generation:
    stream = RequestStream([1, 2, 3], SamplingParams(max_new_tokens=3))
    for item in items:
        stream.push(item)
    loop = SimpleNamespace(core_stats=lambda: [], is_ready=True, abort=lambda *a: None)
    server = SimpleNamespace(metrics=Metrics(loop), loop=loop, api_counters=ApiCounters())
    return Generation(server, stream, "generate", time.monotonic(), None)


def _out(token: int, finished: bool = False) -> RequestOutput:
    return RequestOutput(0, [token], finished, "length" if finished else None)


def test_outputs_queued_together_go_out_as_one_delta():
    async def main():
        gen = _generation([_out(5), _out(6), _out(7, finished=True)])
        return [d async for _, d in gen.deltas()], gen

    deltas, gen = asyncio.run(main())
    assert [d.new_token_ids for d in deltas] == [[5, 6, 7]]
    assert deltas[0].finished and deltas[0].finish_reason == "length"
    assert gen.usage()["completion_tokens"] == 3


def test_an_error_after_tokens_comes_after_them():
    async def main():
        gen = _generation([_out(5), _out(6), StreamError("engine core 0 died", 500)])
        seen = []
        with pytest.raises(ApiError) as e:
            async for _, d in gen.deltas():
                seen.append(d.new_token_ids)
        return seen, e.value

    seen, error = asyncio.run(main())
    assert seen == [[5, 6]]
    assert error.status == 500 and "died" in error.message


def test_router_sends_a_prefix_to_the_core_that_has_it():
    router = PrefixRouter(num_cores=3, page_size=4, request_cost_tokens=4)
    prefix = list(range(100, 112))  # three pages
    assert router.route(prefix + [1], [0, 0, 0]) == 0  # nothing cached: least loaded (first)
    assert router.route([7, 7, 7, 7, 7], [1, 0, 0]) == 1  # no match: least loaded
    # 12 cached tokens outweigh one request more in flight (4 tokens) but not four more.
    assert router.route(prefix + [2, 3], [1, 1, 0]) == 0
    assert router.route(prefix + [2, 3], [4, 1, 0]) == 2
    # Now cores 0 and 2 hold the prefix: the one with the shorter wait takes it.
    assert router.route(prefix + [5], [2, 2, 1]) == 2
    # Prompt tokens queued at a core (no first token yet) count as its wait too.
    assert router.route(prefix + [6], [0, 0, 0], pending_tokens=[0, 0, 20]) == 0


def test_router_reports_the_tokens_the_chosen_core_must_compute():
    router = PrefixRouter(num_cores=2, page_size=4)
    prompt = list(range(50, 61))  # two full pages and three tokens
    assert router.route_request(prompt, [0, 0]) == (0, 11)
    assert router.route_request(prompt + [1], [0, 0]) == (0, 4)  # two pages cached there
    single = PrefixRouter(num_cores=1, page_size=4)
    assert single.route_request(prompt, [5]) == (0, 11)


def test_router_spreads_requests_that_share_only_a_template_prefix():
    """32 requests sharing two pages (a chat template) arriving at once: each core takes about
    half, where the old rule (longest prefix unless 32 apart) sent them all to one."""
    router = PrefixRouter(num_cores=2, page_size=16)
    template = list(range(1000, 1032))
    loads, pending, cores = [0, 0], [0, 0], []
    for i in range(32):
        core, prefill = router.route_request(template + [i] * 10, loads, pending)
        loads[core] += 1
        pending[core] += prefill
        cores.append(core)
    assert cores.count(0) == cores.count(1) == 16


def test_router_alternates_requests_that_arrive_one_after_another_on_idle_cores():
    """Each request done before the next arrives (loads and waits all zero): the cores take
    turns, where always picking the first core of a tie sent them all to core 0 (issue 32's
    two-core test saw 21 of 32 there)."""
    router = PrefixRouter(num_cores=3, page_size=16)
    template = list(range(1000, 1030))  # a page and a bit
    # Three at once first: each core comes to hold the template's page.
    assert [router.route(template + [i], loads) for i, loads in
            enumerate(([0, 0, 0], [1, 0, 0], [1, 1, 0]))] == [0, 1, 2]
    cores = [router.route(template + [i] * 12, [0, 0, 0]) for i in range(30)]
    assert [cores.count(c) for c in range(3)] == [10, 10, 10], cores
    # A tie broken by turn never outweighs fewer in flight.
    assert router.route([5] * 20, [0, 1, 1]) == 0 and router.route([6] * 20, [1, 0, 1]) == 1


def test_router_keeps_a_long_shared_system_prompt_on_its_core():
    router = PrefixRouter(num_cores=2, page_size=16)
    system = list(range(2000))
    assert router.route_request(system + [1], [0, 0]) == (0, 2001)
    loads, pending = [0, 0], [0, 0]  # the first one is done: its prompt is cached on core 0
    for i in range(24):
        core, prefill = router.route_request(system + [2, i], loads, pending)
        assert core == 0 and prefill == 2
        loads[core] += 1
        pending[core] += prefill
    # Until core 0's wait outgrows the 2,000 tokens the prefix saves.
    assert router.route(system + [3], [31, 0], [0, 0]) == 0
    assert router.route(system + [3], [32, 0], [0, 0]) == 1


def test_router_forgets_least_recently_used_pages():
    router = PrefixRouter(num_cores=2, page_size=2, max_pages_per_core=2)
    assert router.route([1, 2, 3, 4], [0, 0]) == 0
    assert router.route([5, 6, 7, 8], [1, 0]) == 1
    assert router.route([9, 9, 9, 9], [0, 0]) == 0  # evicts [1, 2] and [1, 2, 3, 4] from core 0
    assert router.indexes[0].match(router.indexes[0].page_keys([1, 2, 3, 4])) == 0
    assert router.route([5, 6, 7, 8], [5, 5]) == 1  # core 1 still has it


@pytest.mark.parametrize("value", [0.0, 0.0004, 0.003, 0.05, 1e9])
def test_batch_histogram_equals_as_many_plain_observations(value):
    """BatchHistogram.observe(value, count) scrapes as `count` observations on
    prometheus_client's own Histogram would."""
    from prometheus_client import CollectorRegistry, Histogram

    from flashlet.server.metrics import BatchHistogram

    def samples(registry) -> dict:
        family = next(iter(registry.collect()))
        return {(s.name, s.labels.get("le")): s.value for s in family.samples
                if not s.name.endswith("_created")}

    fast_registry, slow_registry = CollectorRegistry(), CollectorRegistry()
    buckets = (0.001, 0.01, 0.1)
    fast = BatchHistogram("h", "h", buckets=buckets, registry=fast_registry)
    slow = Histogram("h", "h", buckets=buckets, registry=slow_registry)
    for count in (0, 1, 7):
        fast.observe(value, count)
        for _ in range(count):
            slow.observe(value)
    got, want = samples(fast_registry), samples(slow_registry)
    assert got.pop(("h_sum", None)) == pytest.approx(want.pop(("h_sum", None)), rel=1e-12)
    assert got == want and want[("h_count", None)] == 8
