"""scripts/api_overhead.py's token source stands where an Engine does in the engine-core
process: what the core reads of an engine at start and per step must be there."""

from __future__ import annotations

import numpy as np

from flashlet.core.sampling import SamplingParams
from flashlet.server.engine_core import core_stats, engine_info
from flashlet.server.messages import CoreOutput
from tests.conftest import load_script


def test_token_source_gives_what_the_core_reads_of_an_engine():
    source = load_script("api_overhead").build_token_source(None)
    info = engine_info(source)  # what CoreReady carries: a missing stat failed the core's start
    assert info["kv_cache_dtype"] == "none" and info["num_pages"] == 1 << 16
    source.add_request(np.array([5, 6], np.int32), SamplingParams(max_new_tokens=2), 0)
    first = source.step()
    assert [out.new_token_ids for out in first] == [[5]]
    assert core_stats(source)["num_requests"] == 1
    last = source.step()
    assert last[0].finished and not source.has_unfinished()
    # what the core sends of each output (a field the source lacked stopped the core at its
    # first step once)
    sent = [CoreOutput.of(out) for out in first + last]
    assert [(o.new_token_ids, o.finished, o.finish_reason) for o in sent] == [
        ([5], False, None), ([6], True, "length")]
