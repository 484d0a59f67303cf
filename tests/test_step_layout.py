"""The one step-layout builder (`batch.InputBatch`, and `build_layout` through it) against a
per-token reference, the persistent batch driven by updates as the engine drives it, and the step
buffers: CUDA-graph padding onto the scratch page, fed rows, and the runner's graph path on the
CPU (a stand-in graph that re-runs the captured body) against eager steps."""

import dataclasses
import random

import numpy as np
import pytest
import torch

from flashlet import Engine, EngineConfig, SamplingParams
from flashlet.attention.torch_ref import TorchBackend
from flashlet.core.request import PLACEHOLDER
from flashlet.core.scheduler import BatchUpdate
from flashlet.kvcache.kv_pool import KVPool
from flashlet.runner.batch import (ARENA_ALIGN, LAYOUT_DTYPES, InputBatch, StepBuffers, StepRow,
                            build_layout, load_layout)
from flashlet.runner.model_runner import graph_input_addresses

# The CPU engine with the Triton backend runs its kernels through the interpreter, which a
# machine with a GPU does not turn on (tests/conftest.py): there tests/gpu/test_gpu_mixed_graphs.py
# runs the mixed steps' graphs, padding and splits on the device.
CPU_ENGINE_THROUGH_THE_INTERPRETER = pytest.mark.skipif(
    torch.cuda.is_available(), reason="the CPU engine's Triton kernels through the interpreter; on "
    "a GPU tests/gpu/test_gpu_mixed_graphs.py runs the mixed steps")


def reference_layout(rows, ps):
    """Token by token, the obvious way."""
    out = {k: [] for k in ("input_ids", "positions", "slot_mapping", "qo_indptr", "paged_kv_indptr",
                           "paged_kv_indices", "paged_kv_last_page_len", "kv_lens",
                           "logits_indices", "feed_rows", "feed_src")}
    out["qo_indptr"].append(0)
    out["paged_kv_indptr"].append(0)
    for tokens, start, pages, sample, src in rows:
        for i, token in enumerate(tokens):
            pos = start + i
            if token == PLACEHOLDER:
                out["feed_rows"].append(len(out["input_ids"]))
                out["feed_src"].append(src)
            out["input_ids"].append(0 if token == PLACEHOLDER else token)
            out["positions"].append(pos)
            out["slot_mapping"].append(pages[pos // ps] * ps + pos % ps)
        kv_len = start + len(tokens)
        used = [pages[p] for p in range(-(-kv_len // ps))]
        out["paged_kv_indices"] += used
        out["qo_indptr"].append(len(out["input_ids"]))
        out["paged_kv_indptr"].append(len(out["paged_kv_indices"]))
        out["paged_kv_last_page_len"].append(kv_len - (len(used) - 1) * ps if used else 0)
        out["kv_lens"].append(kv_len)
        if sample:
            out["logits_indices"].append(len(out["input_ids"]) - 1)
    return out


def random_rows(rng, ps, decode_only=False):
    rows = []
    for _ in range(rng.randrange(1, 7)):
        start = rng.randrange(0, 40)
        n = 1 if decode_only or rng.random() < 0.5 else rng.randrange(0, 20)
        tokens = [PLACEHOLDER if n == 1 and rng.random() < 0.5 else rng.randrange(1, 100)
                  for _ in range(n)]
        pages = rng.sample(range(200), -(-(start + n) // ps) + rng.randrange(0, 3))  # spare pages
        rows.append(StepRow(tokens, start, pages, rng.random() < 0.8, rng.randrange(0, 8)))
    return rows


@pytest.mark.parametrize("ps", [1, 4, 16])
def test_builder_matches_the_token_by_token_reference(ps):
    rng = random.Random(ps)
    for trial in range(60):
        rows = random_rows(rng, ps, decode_only=trial % 3 == 0)
        layout = build_layout(rows, ps)
        want = reference_layout(rows, ps)
        for name, tensor in layout.tensors().items():
            assert tensor.tolist() == want[name], (name, rows)
        lens = [len(r.token_ids) for r in rows]
        assert layout.is_pure_decode == all(n == 1 for n in lens)
        assert layout.max_query_len == max(lens)
        assert layout.paged_kv_indptr.dtype == torch.int32 and layout.slot_mapping.dtype == torch.int64


@pytest.mark.parametrize("ps", [1, 4, 16])
def test_a_persistent_batch_driven_by_updates_gives_the_reference_layout(ps):
    """Requests join and leave the batch, their page tables grow or change in the middle, and
    steps take them in any order: each step's layout is the per-token reference's of the same
    rows (their tokens, positions, current page tables, sampling, fed sources)."""
    from flashlet.core.scheduler import BatchUpdate

    rng = random.Random(100 + ps)
    batch = InputBatch(8, 80, ps)
    tables: dict[int, list[int]] = {}
    last_sampled: list[int] = []  # the previous step's sampling requests, in row order
    next_id = 0
    for _ in range(150):
        update = BatchUpdate()
        for i in rng.sample(sorted(tables), rng.randrange(0, len(tables) + 1) // 2):
            update.removed.append(i)
            del tables[i]
        while len(tables) < 8 and rng.random() < 0.4:
            tables[next_id] = rng.sample(range(500), rng.randrange(0, 4))
            update.added.append((next_id, tables[next_id]))
            next_id += 1
        if not tables:
            continue
        step = rng.sample(sorted(tables), rng.randrange(1, len(tables) + 1))
        rows = []
        for i in step:
            start, n = rng.randrange(0, 60), 1 if rng.random() < 0.6 else rng.randrange(0, 9)
            need = -(-(start + n) // ps)
            if len(tables[i]) < need or rng.random() < 0.2:  # grows, or swaps pages mid-table
                first = rng.randrange(0, min(len(tables[i]), need) + 1)
                tables[i] = tables[i][:first] + rng.sample(range(500), need - first)
                update.pages.append((i, first, tables[i][first:]))
            fed = n == 1 and i in last_sampled and rng.random() < 0.5
            tokens = [PLACEHOLDER] if fed else [rng.randrange(1, 100) for _ in range(n)]
            src = last_sampled.index(i) if fed else 0
            rows.append(StepRow(tokens, start, tables[i], rng.random() < 0.8, src))
        update.request_ids = step
        update.starts = [r.num_computed for r in rows]
        update.token_ids = [t for r in rows for t in r.token_ids]
        lens = [len(r.token_ids) for r in rows]
        update.query_lens = None if set(lens) == {1} else lens
        update.sample = [r.sample for r in rows]
        layout = batch.apply(update)
        want = reference_layout(rows, ps)
        for name, tensor in layout.tensors().items():
            assert tensor.tolist() == want[name], (name, rows)
        last_sampled = [i for i, r in zip(step, rows) if r.sample]
        assert batch.sampling_rows == [batch.row_of[i] for i in last_sampled]
    assert next_id > 20


def test_a_batch_refuses_a_request_twice_and_more_rows_than_it_holds():
    batch = InputBatch(2, 4, 4)
    batch.add(7, [1])
    with pytest.raises(ValueError, match="has a row already"):
        batch.add(7, [2])
    batch.add(8, [2])
    with pytest.raises(ValueError, match="all taken"):
        batch.add(9, [3])
    with pytest.raises(ValueError, match="rows hold 4"):
        batch.set_pages(batch.row_of[7], 2, [1, 2, 3])
    batch.remove(7)
    batch.remove(7)  # a no-op: gone already (as for a request aborted while it waited)
    assert batch.add(9, [3]) == 0 and batch.version == 4  # two adds, a removal, an add


def assert_same_layout(got, want, rows):
    for name, tensor in want.tensors().items():
        fast = getattr(got, name)
        assert fast.dtype == tensor.dtype and fast.tolist() == tensor.tolist(), (name, rows)
        assert (got.arrays[name] == tensor.numpy()).all()  # its numpy views, set up front
    assert got.query_lens.tolist() == want.query_lens.tolist()
    assert got.query_lens.dtype == want.query_lens.dtype
    assert (got.is_pure_decode, got.max_query_len) == (want.is_pure_decode, want.max_query_len)


def test_engine_steps_get_the_reference_layout(tiny_qwen2, monkeypatch):
    """The runner's persistent batch, kept by the scheduler's updates, against the reference
    layout of the scheduled requests as they stand (tokens, page tables, fed sources), every
    step of a run that decodes across page boundaries, chunks prompts, shares cached prefixes
    and preempts, with overlap (fed rows) and without."""
    for overlap in (True, False):
        engine = Engine(EngineConfig(model=str(tiny_qwen2), page_size=4, max_num_pages=14,
                                     max_num_seqs=4, max_num_batched_tokens=16, overlap=overlap))
        steps = {"decode": 0, "fed": 0, "steady": 0}
        scheduled = []
        schedule, prepare = engine.scheduler.schedule, engine.runner.prepare
        previous_sampling = []

        def reference_rows(sched):
            for req, n in sched.scheduled:
                start = req.num_computed_tokens
                src = next((j for j, r in enumerate(previous_sampling) if r is req), 0)
                yield StepRow(req.token_slice(start, start + n), start, list(req.page_ids),
                              start + n == req.num_tokens, src)

        def recording_schedule(*args):
            sched = schedule(*args)
            scheduled.append(sched)
            return sched

        def checked_prepare(update):
            nonlocal previous_sampling
            sched = scheduled.pop()
            rows = list(reference_rows(sched))
            got = prepare(update)
            want = reference_layout(rows, 4)
            for name, tensor in got.tensors().items():
                assert tensor.tolist() == want[name], name
            steps["decode"] += got.is_pure_decode
            steps["fed"] += len(want["feed_rows"]) > 0
            steps["steady"] += update.steady  # moved on from the last step's columns
            previous_sampling = list(sched.sampling)
            return got

        monkeypatch.setattr(engine.scheduler, "schedule", recording_schedule)
        monkeypatch.setattr(engine.runner, "prepare", checked_prepare)
        rng = random.Random(0)
        shared = [rng.randrange(2, 200) for _ in range(9)]
        for i in range(6):
            prompt = shared + [rng.randrange(2, 200) for _ in range(rng.randrange(1, 20))]
            engine.add_request(prompt, SamplingParams(max_new_tokens=12, ignore_eos=True))
        while engine.has_unfinished():
            engine.step()
            engine.check_integrity()
        assert engine.stats()["num_preemptions"] > 0 and steps["decode"] > 5
        assert (steps["fed"] > 5) == overlap
        assert steps["steady"] > 5
        # Every row is a running request's, or one whose removal the next step's update carries.
        assert set(engine.runner.batch.row_of) <= set(engine.scheduler._rows_removed)


def test_a_built_layout_makes_its_tensors_only_when_read():
    """Loading a step reads its arrays: no field's tensor is made (from_numpy costs, to make and
    to free, about what the rest of a one-row decode layout does). A field read later is a view
    of its array, made once."""
    rng = random.Random(7)
    for rows in (random_rows(rng, 4), random_rows(rng, 4, decode_only=True)):
        layout = build_layout(rows, 4)
        fed = torch.arange(16)  # the previous step's sampled tokens, for the fed rows
        StepBuffers.for_layout(layout, "cpu").load(layout, fed)
        assert not set(vars(layout)) & set(LAYOUT_DTYPES), "load made a tensor"
        positions = layout.positions
        assert positions.dtype == torch.int64 and layout.positions is positions
        assert np.shares_memory(positions.numpy(), layout.arrays["positions"])


def test_a_page_table_too_short_for_its_tokens_is_refused():
    with pytest.raises(ValueError, match="fewer pages"):
        build_layout([StepRow([1, 2, 3, 4, 5], 0, [7])], 4)


def test_one_requests_page_change_leaves_the_batch_as_the_many_rows_write_does():
    """`_change_pages` writes one request's change (an appended page, a trim, pages swapped
    mid-table) on its own path: the page tables, their lengths and whether the last decode
    step's indices went stale are those of the many-rows write (forced by a no-op change of
    another request: its table from its end on, nothing)."""
    rng = random.Random(5)
    one, many = InputBatch(4, 12, 4), InputBatch(4, 12, 4)
    for batch in (one, many):
        for i in range(4):
            batch.add(i, [10 * i + j for j in range(3)])
    for trial in range(200):
        if trial % 7 == 0:  # a decode step, kept for a steady next one
            for batch in (one, many):
                batch.apply(BatchUpdate(request_ids=[0, 1, 2, 3], starts=[
                    int(batch.num_pages[batch.row_of[i]]) * 4 - 1 for i in range(4)],
                    token_ids=[1, 2, 3, 4]))
        i, other = rng.sample(range(4), 2)
        pages = int(one.num_pages[one.row_of[i]])
        first = rng.randrange(max(pages - 2, 1), min(pages + 1, 12))
        ids = rng.sample(range(100, 200), rng.randrange(0, 12 - first + 1))
        one._change_pages([(i, first, ids)])
        many._change_pages([(i, first, ids), (other, int(many.num_pages[many.row_of[other]]), [])])
        assert np.array_equal(one.num_pages, many.num_pages), trial
        for r in range(4):
            assert one.pages_of(r) == many.pages_of(r), trial
        assert (one._decode is None) == (many._decode is None)
        if one._decode is not None:
            assert one._decode.indices_changed == many._decode.indices_changed, trial


def test_fed_rows_take_the_previous_steps_tokens():
    layout = build_layout([StepRow([PLACEHOLDER], 3, [0], True, 2), StepRow([9, 8], 0, [1]),
                           StepRow([PLACEHOLDER], 0, [2], True, 0)], 4)
    buffers = StepBuffers.for_layout(layout, "cpu")
    input_ids, _ = buffers.load(layout, fed_tokens=torch.tensor([50, 60, 70]))
    assert input_ids.tolist() == [70, 9, 8, 50]
    with pytest.raises(ValueError, match="previous step's tokens"):
        buffers.load(layout)


SCRATCH = 250  # a page no random row uses


def padded_reference(rows, ps, size):
    """The layout of `rows` padded to `size` sequences, built the obvious way: the padding rows
    are one-token sequences at position 0 on the scratch page, not sampled."""
    padding = [StepRow([0], 0, [SCRATCH], False)] * (size - len(rows))
    return build_layout(list(rows) + padding, ps)


def fed_reference(layout, fed_tokens):
    ids = layout.input_ids.clone()
    ids[layout.feed_rows] = fed_tokens[layout.feed_src]
    return ids


@pytest.mark.parametrize("ps", [1, 16])
def test_loads_into_the_one_arena_give_the_layouts_tensors(ps):
    """Random prefill, mixed, decode and padded decode steps one after another into the same
    buffers: every device and host view holds the (padded) layout, fed rows included, each
    field at a 16-byte aligned address."""
    rng = random.Random(10 + ps)
    buffers = StepBuffers(200, 8, 8 * 60, "cpu", scratch_page=SCRATCH, page_size=ps)
    fed_tokens = torch.arange(1000, 1008)
    for trial in range(80):
        rows = random_rows(rng, ps, decode_only=trial % 2 == 0)
        layout = build_layout(rows, ps)
        size = rng.choice([len(rows), 8]) if layout.is_pure_decode else None
        want = padded_reference(rows, ps, size) if size else layout
        input_ids, meta = buffers.load(layout, fed_tokens, pad_to=size)
        assert input_ids.tolist() == fed_reference(want, fed_tokens).tolist(), rows
        assert meta.num_padding == (size or len(rows)) - len(rows)
        # (passed on from the layout, not recomputed: it must still hold of the padded rows)
        qo = meta.host.qo_indptr.numpy()
        assert meta.host.is_pure_decode == bool((np.diff(qo) == 1).all())
        for name, tensor in want.tensors().items():
            host = getattr(meta.host, name)
            assert host.dtype == LAYOUT_DTYPES[name]
            if name != "input_ids":  # the host copy keeps 0 in fed rows
                assert host.tolist() == tensor.tolist(), (name, rows)
            if hasattr(meta, name):
                dev = getattr(meta, name)
                assert dev.tolist() == tensor.tolist(), (name, rows)
                assert dev.data_ptr() % ARENA_ALIGN == 0, name


def test_padded_steps_of_one_shape_in_a_row_hold_the_reference_layout():
    """Consecutive decode steps of 5 rows padded to 8 (a speculating stream's verify steps as
    decode rows) write their padding rows once, but each loads as its reference: also after
    an unpadded step of the same shape (8 rows, 5 sampled), which overwrote those rows, after
    one of another row count, after one of the same shape with one real row more (4 rows, 4
    sampled, after 5 rows, 4 sampled: row 4 is padding again), after one of the same rows
    padded to another size, and after a mixed step of the same shape (padded to 16 tokens and
    the buffers' 16 sequences)."""
    ps = 4
    rng = random.Random(3)
    buffers = StepBuffers(64, 16, 16 * 40, "cpu", scratch_page=SCRATCH, page_size=ps)

    def decode_rows(n, sampled=None):
        rows = []
        for b in range(n):
            start = rng.randrange(0, 60)
            pages = rng.sample(range(200), start // ps + 1)
            rows.append(StepRow([rng.randrange(1, 99)], start, pages, sampled is None or b < sampled))
        return rows

    steps = ((5, 8, None), (5, 8, None), (8, None, 5), (5, 8, None), (5, 8, None), (4, 8, None),
             (5, 8, None), (5, 8, None), (5, 8, 4), (4, 8, 4), (5, 8, None), (5, 16, None),
             (5, 16, None), (5, "mixed", None), (5, 16, None))
    for n, size, sampled in steps:
        rows = decode_rows(n, sampled)
        layout = build_layout(rows, ps)
        if size == "mixed":
            input_ids, meta = buffers.load(layout, pad_tokens=16)
            want = mixed_padded_reference(layout, ps, 16, 16)
        else:
            input_ids, meta = buffers.load(layout, pad_to=size)
            padded = padded_reference(rows, ps, size) if size else layout
            want = {name: t.tolist() for name, t in padded.tensors().items()}
        assert input_ids.tolist() == want["input_ids"]
        for name, values in want.items():
            assert getattr(meta.host, name).tolist() == values, (name, n, size, sampled)


def test_decode_steps_padded_to_one_size_find_every_field_at_one_address():
    """What a CUDA graph captured at batch 8 reads: the same addresses for any decode step
    padded to 8, whatever its sequence count, page count, sampled and fed rows."""
    ps = 4
    buffers = StepBuffers(64, 8, 8 * 40, "cpu", scratch_page=SCRATCH, page_size=ps)
    fed_tokens = torch.arange(8)
    steps = [[StepRow([5], 3, [0]), StepRow([6], 2, [1])],  # 2 pages
             [StepRow([PLACEHOLDER], 40, list(range(10, 21)), True, 1),
              StepRow([PLACEHOLDER], 99, list(range(30, 55)), True, 0),
              StepRow([7], 12, [2, 3, 4, 5], False)],  # 40 pages, fed rows, one not sampled
             [StepRow([PLACEHOLDER], 16, list(range(60, 65)), True, b) for b in range(7)]]
    seen = set()
    for rows in steps:
        input_ids, meta = buffers.load(build_layout(rows, ps), fed_tokens, pad_to=8)
        seen.add(graph_input_addresses(input_ids, meta) + (meta.logits_indices.data_ptr(),))
    assert len(seen) == 1
    # An eager step (a prefill chunk) may go anywhere; the next padded decode is back in place.
    buffers.load(build_layout([StepRow(list(range(1, 30)), 0, list(range(8)))], ps))
    input_ids, meta = buffers.load(build_layout(steps[0], ps), pad_to=8)
    assert graph_input_addresses(input_ids, meta) + (meta.logits_indices.data_ptr(),) in seen


def test_a_step_beyond_a_fields_capacity_is_refused():
    buffers = StepBuffers(4, 2, 3, "cpu")
    with pytest.raises(ValueError, match="input_ids has 5 entries; the buffers hold 4"):
        buffers.load(build_layout([StepRow([1, 2, 3, 4, 5], 0, [0, 1])], 4))
    with pytest.raises(ValueError, match="paged_kv_indices has 6 entries; the buffers hold 5"):
        buffers.load(build_layout([StepRow([1], 11, [0, 1, 2]), StepRow([1], 11, [3, 4, 5])], 4))
    with pytest.raises(ValueError, match="cannot pad to 4"):
        StepBuffers(4, 2, 3, "cpu", scratch_page=9).load(build_layout([StepRow([1], 0, [0])], 4),
                                                          pad_to=4)


def test_padding_rows_use_the_scratch_page_and_leave_real_rows_alone():
    """A decode step of 3 padded to 8, as for a CUDA graph: padding rows are one-token
    sequences on the scratch page, and the torch backend's graph path (plan_graph, batched)
    gives the real rows the per-sequence oracle's output."""
    torch.manual_seed(0)
    ps, hq, hkv, d = 4, 6, 2, 8
    pool = KVPool(1, 40, ps, hkv, d, torch.float32, "cpu")
    pool.k_cache.normal_()
    pool.v_cache.normal_()
    rows = [StepRow([5], 9, [3, 4, 5]), StepRow([6], 0, [7]), StepRow([7], 20, [8, 9, 10, 11, 12, 13])]
    layout = build_layout(rows, ps)
    buffers = StepBuffers(16, 8, 8 * 10, "cpu", scratch_page=pool.scratch_page, page_size=ps)
    input_ids, meta = buffers.load(layout, pad_to=8)
    host = meta.host
    assert meta.num_seqs == 8 and meta.num_padding == 5 and meta.is_pure_decode
    assert input_ids.tolist() == [5, 6, 7] + [0] * 5
    assert host.slot_mapping.tolist()[3:] == [pool.scratch_page * ps] * 5
    assert host.paged_kv_indices.tolist() == [3, 4, 5, 7, 8, 9, 10, 11, 12, 13] + [pool.scratch_page] * 5
    assert host.paged_kv_indptr.tolist() == [0, 3, 4, 10, 11, 12, 13, 14, 15]
    assert host.kv_lens.tolist() == [10, 1, 21] + [1] * 5
    assert host.logits_indices.tolist() == [0, 1, 2]  # padding rows are not sampled

    q = torch.randn(8, hq, d)
    k, v = torch.randn(8, hkv, d), torch.randn(8, hkv, d)
    graphed = TorchBackend(pool, hq)
    graphed.plan_graph(meta, 8)
    got = graphed.run(0, q, k, v)
    _, eager = load_layout(layout, "cpu")
    oracle = TorchBackend(pool, hq, batched_decode=False)
    oracle.plan(eager)
    assert torch.allclose(got[:3], oracle.run(0, q[:3], k[:3], v[:3]), atol=1e-6)


class ReplayEagerly:
    """Stands in for a captured CUDA graph on the CPU: replay() re-runs the captured body on the
    input views of the step it was captured on, into the same output tensor (as a graph reads
    the addresses its capture saw), then `after` on it (the runner's input advance), which
    the capture does not run."""

    def __init__(self, body, after=None):
        self.body, self.after = body, after
        self.logits = body()

    def replay(self):
        self.logits.copy_(self.body())
        if self.after is not None:
            self.after(self.logits)


def graphs_on_the_cpu(engine):
    runner = engine.runner
    runner.use_graphs = True

    def capture(input_ids, meta, tokens=False, moves=False):
        after = runner._input_advance(input_ids, meta) if moves else None
        graph = ReplayEagerly(lambda: runner._decode_body(input_ids, meta.positions, tokens), after)
        return graph, graph.logits

    runner._capture = capture


@pytest.mark.parametrize("overlap", [True, False])
def test_graph_path_gives_the_eager_tokens(tiny_qwen2, overlap):
    """The runner's CUDA-graph path (padding in load, plan_graph, the body reading the buffers at
    the padded size, logits of the real rows) on the CPU, against eager steps."""
    cfg = EngineConfig(model=str(tiny_qwen2), device="cpu", max_num_seqs=8,
                       max_num_batched_tokens=32, overlap=overlap)
    prompts = [[3, 5, 7, 9, 11] * 3, [2, 4, 6], [8] * 9, [1, 2]]
    outs = []
    for graphs in (False, True):
        engine = Engine(cfg)
        if graphs:
            graphs_on_the_cpu(engine)
        ids = [engine.add_request(p, SamplingParams(max_new_tokens=10 + 3 * i, ignore_eos=True))
               for i, p in enumerate(prompts)]
        done = {}
        while engine.has_unfinished():
            done.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
        outs.append([done[i] for i in ids])
        if graphs:
            sizes = {key[0] for key in engine.runner.graphs}
            assert sizes >= {4, 2, 1} and sizes <= {1, 2, 4, 8}, sizes
            # plain greedy requests: the graphs that end in the argmax, never the logits'
            assert {key[1] for key in engine.runner.graphs} == {"tokens"}
    assert outs[0] == outs[1]


@pytest.mark.parametrize("page_size", [16, 4])
def test_steady_replay_gives_the_loaded_steps_tokens(tiny_qwen2, monkeypatch, page_size):
    """Steady replay (model_runner.STEADY_REPLAY) with every decode graph moving its inputs on
    (on CUDA only the fused path's do; here the per-op graphs stand in, replayed eagerly):
    requests of different lengths (rows leave one by one; 3 rows padded to 4, whose padding
    row stays on the scratch page), pages starting every 16 or 4 tokens. The same tokens as
    every step loaded, and the steady steps skipped their load."""
    from flashlet.runner import model_runner

    cfg = EngineConfig(model=str(tiny_qwen2), device="cpu", max_num_seqs=8, page_size=page_size,
                       max_num_batched_tokens=64)
    prompts = [[3, 5, 7, 9, 11] * 3, [2, 4, 6], [8] * 9]
    outs, loads = [], []
    for steady in (False, True):
        monkeypatch.setattr(model_runner, "STEADY_REPLAY", steady)
        engine = Engine(cfg)
        graphs_on_the_cpu(engine)
        runner = engine.runner
        monkeypatch.setattr(runner, "_moves_inputs_on", lambda size: model_runner.STEADY_REPLAY)
        count, real_load = [0], runner.buffers.load

        def counted(*args, count=count, real_load=real_load, **kwargs):
            count[0] += 1
            return real_load(*args, **kwargs)

        runner.buffers.load = counted
        ids = [engine.add_request(p, SamplingParams(max_new_tokens=20 + 9 * i, ignore_eos=True))
               for i, p in enumerate(prompts)]
        done = {}
        while engine.has_unfinished():
            done.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
        engine.check_integrity()
        outs.append([done[i] for i in ids])
        loads.append(count[0])
    assert outs[0] == outs[1]
    assert loads[1] < loads[0] * (0.5 if page_size == 16 else 0.9), loads


def test_graph_steps_keep_the_logits_where_a_request_or_observer_needs_them(tiny_qwen2):
    """A decode step replays the logits graph where a request's sampling needs the logits (here
    logprobs) or an observer reads them, the greedy-token graph otherwise; the same tokens."""
    cfg = EngineConfig(model=str(tiny_qwen2), device="cpu", dtype="bfloat16", max_num_seqs=8)
    prompts = [[3, 5, 7, 9, 11] * 3, [2, 4, 6], [8] * 9]
    outs, kinds = [], []
    for case in ("greedy", "logprobs", "observed"):
        engine = Engine(cfg)
        graphs_on_the_cpu(engine)
        if case == "observed":
            engine.observe_steps(lambda meta, logits: None)
        ids = [engine.add_request(p, SamplingParams(max_new_tokens=8, ignore_eos=True,
                                                    logprobs=1 if case == "logprobs" and i == 1 else None))
               for i, p in enumerate(prompts)]
        done = {}
        while engine.has_unfinished():
            done.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
        outs.append([done[i] for i in ids])
        kinds.append({key[1] for key in engine.runner.graphs})
    assert kinds == [{"tokens"}, {"logits"}, {"logits"}]
    assert outs[0] == outs[1] == outs[2]


def test_a_graph_step_not_loaded_by_the_runner_is_refused(tiny_qwen2):
    engine = Engine(EngineConfig(model=str(tiny_qwen2), device="cpu", max_num_seqs=8))
    graphs_on_the_cpu(engine)
    layout = build_layout([StepRow([5], 3, [0]), StepRow([6], 2, [1]), StepRow([7], 1, [2])], 16)
    with pytest.raises(ValueError, match="ModelRunner.load"):
        engine.runner.forward(*load_layout(layout, "cpu"))
    logits = engine.runner.forward(*engine.runner.load(layout))
    assert logits.shape[0] == 3


def test_a_replay_whose_inputs_moved_is_refused(tiny_qwen2):
    """A graph reads the addresses its capture saw: a step whose inputs sit elsewhere must
    fail loudly instead of replaying on stale data."""
    engine = Engine(EngineConfig(model=str(tiny_qwen2), device="cpu", max_num_seqs=8))
    graphs_on_the_cpu(engine)
    runner = engine.runner
    layout = build_layout([StepRow([5], 3, [0]), StepRow([6], 2, [1]), StepRow([7], 1, [2])], 16)
    assert runner.forward(*runner.load(layout)).shape[0] == 3  # captures batch 4
    input_ids, meta = runner.load(layout)
    moved = dataclasses.replace(meta, slot_mapping=meta.slot_mapping.clone())
    with pytest.raises(RuntimeError, match="other addresses"):
        runner.forward(input_ids, moved)
    assert runner.forward(*runner.load(layout)).shape[0] == 3


# ---- mixed steps padded to a token bucket (mixed-step CUDA graphs) ---------------------------
def mixed_padded_reference(layout, ps, tokens, seqs):
    """`layout` padded to `tokens` tokens and `seqs` sequences, the obvious way: extra tokens
    id 0 at position 0 on the scratch page's first slot, in no sequence; extra sequences
    empty (no rows, no KV, no pages)."""
    want = {name: t.tolist() for name, t in layout.tensors().items()}
    extra_tokens, extra_seqs = tokens - layout.num_tokens, seqs - layout.num_seqs
    want["input_ids"] += [0] * extra_tokens
    want["positions"] += [0] * extra_tokens
    want["slot_mapping"] += [SCRATCH * ps] * extra_tokens
    want["qo_indptr"] += [want["qo_indptr"][-1]] * extra_seqs
    want["paged_kv_indptr"] += [want["paged_kv_indptr"][-1]] * extra_seqs
    want["paged_kv_last_page_len"] += [0] * extra_seqs
    want["kv_lens"] += [0] * extra_seqs
    return want


@pytest.mark.parametrize("ps", [1, 16])
def test_mixed_steps_padded_to_one_bucket_find_every_field_at_one_address(ps):
    """What a mixed-step graph captured at a 64-token bucket reads: for random steps of up to
    64 tokens and up to 8 sequences (decodes, chunks, fed rows, empty chunks), every field at
    the same address, whatever the step's token, sequence, page and sampled-row counts; the
    loaded layout is the step padded the obvious way."""
    rng = random.Random(20 + ps)
    buffers = StepBuffers(200, 8, 8 * 60, "cpu", scratch_page=SCRATCH, page_size=ps)
    fed_tokens = torch.arange(1000, 1008)
    seen = set()
    for trial in range(60):
        rows = random_rows(rng, ps, decode_only=trial % 5 == 0)
        layout = build_layout(rows, ps)
        bucket = 64 if layout.num_tokens <= 64 else 128
        input_ids, meta = buffers.load(layout, fed_tokens, pad_tokens=bucket)
        want = mixed_padded_reference(layout, ps, bucket, 8)
        for name, values in want.items():
            if name != "input_ids":  # the host copy keeps 0 in fed rows
                assert getattr(meta.host, name).tolist() == values, (name, rows)
            if hasattr(meta, name):
                assert getattr(meta, name).tolist() == values, (name, rows)
        fed = fed_reference(layout, fed_tokens).tolist()
        assert input_ids.tolist() == fed + [0] * (bucket - layout.num_tokens)
        assert meta.token_bucket == bucket and meta.num_padding == 8 - len(rows)
        if bucket == 64:  # (the LM head, outside the graph, reads logits_indices: any address)
            seen.add(graph_input_addresses(input_ids, meta))
        # An unpadded step in between goes elsewhere; the next padded one is back in place.
        buffers.load(build_layout([StepRow(list(range(1, 30)), 0, list(range(30)))], ps))
    assert len(seen) == 1


def test_a_small_bucket_pads_to_as_many_sequences_as_tokens():
    """With room for 64 sequences, a step padded to a 16-token bucket carries 16 sequences (each
    of a step's sequences has a row), so the prefill kernel's grid holds 16 spare tiles, not 64;
    a 128-token bucket carries all 64. Each bucket's fields stay at one address; the runner
    sends a step of more sequences than its bucket's tokens (one with no row) to eager."""
    ps = 4
    buffers = StepBuffers(256, 64, 64 * 20, "cpu", scratch_page=SCRATCH, page_size=ps)
    assert [buffers.mixed_seqs(t) for t in (16, 64, 128)] == [16, 64, 64]
    seen = set()
    for n in (1, 3, 9):
        rows = [StepRow([5 + b], b % 3, [b]) for b in range(n - 1)] + [StepRow([1, 2, 3], 0, [40])]
        layout = build_layout(rows, ps)
        input_ids, meta = buffers.load(layout, pad_tokens=16)
        assert meta.kv_lens.shape[0] == 16 and meta.num_padding == 16 - n
        want = mixed_padded_reference(layout, ps, 16, 16)
        for name, values in want.items():
            if name != "input_ids":
                assert getattr(meta.host, name).tolist() == values, (name, n)
        seen.add(graph_input_addresses(input_ids, meta))
    assert len(seen) == 1
    _, meta = buffers.load(layout, pad_tokens=128)
    assert meta.kv_lens.shape[0] == 64
    empty = build_layout([StepRow([], 4, [b]) for b in range(17)] + [StepRow([1], 0, [20])], ps)
    assert (empty.num_seqs, empty.num_tokens) == (18, 1)  # rows with no token
    with pytest.raises(ValueError, match="padded to 16 tokens holds 16"):
        buffers.load(empty, pad_tokens=16)


def test_a_step_of_more_sequences_than_its_buckets_tokens_runs_eagerly(tiny_qwen2):
    engine = Engine(EngineConfig(model=str(tiny_qwen2), device="cpu", backend="triton", max_num_seqs=32,
                                 max_num_batched_tokens=64, max_num_pages=64))
    runner = engine.runner
    runner.use_mixed_graphs = True  # as on CUDA
    rows = [StepRow([5], 1, [0]), StepRow([1, 2, 3, 4], 0, [1])]
    assert runner.token_bucket(build_layout(rows, 16)) == 16
    empty = [StepRow([], 4, [b]) for b in range(17)] + [StepRow([1], 0, [20])]
    assert runner.token_bucket(build_layout(empty, 16)) is None


def test_a_mixed_step_that_does_not_fit_its_bucket_is_refused():
    buffers = StepBuffers(64, 2, 20, "cpu", scratch_page=SCRATCH, page_size=4)
    layout = build_layout([StepRow(list(range(1, 18)), 0, list(range(5)))], 4)
    with pytest.raises(ValueError, match="cannot pad a step of 17 tokens to 16"):
        buffers.load(layout, pad_tokens=16)
    with pytest.raises(ValueError, match="scratch page"):
        StepBuffers(64, 2, 20, "cpu").load(layout, pad_tokens=32)


def _mixedgraphs_on_the_cpu(engine):
    """The runner's mixed-step graph path on the CPU: padding in load, planning outside, a
    stand-in graph re-running the captured body on the captured step's input views."""
    runner = engine.runner
    runner.use_graphs = runner.use_mixed_graphs = True

    def capture(input_ids, meta):
        graph = ReplayEagerly(lambda: runner.model(input_ids, meta.positions, runner.backend))
        return graph, graph.logits

    runner._capture_mixed = capture
    runner._capture = lambda *a, **k: pytest.fail("decode graphs are not under test here")
    runner.graph_batch_size = lambda layout, num_padding=0: None  # decodes stay eager


@CPU_ENGINE_THROUGH_THE_INTERPRETER
@pytest.mark.parametrize("overlap", [True, False])
def test_mixed_graph_path_gives_the_eager_tokens(tiny_qwen2, overlap):
    """Prompts longer than the step budget, so chunks share steps with decodes (fed rows under
    overlap): the Triton backend (interpreter) through padded mixed steps and the stand-in
    graphs gives the greedy tokens of unpadded eager steps on the torch backend (the oracle;
    Triton's eager steps are held to it in test_attention_backends.py)."""
    cfg = EngineConfig(model=str(tiny_qwen2), device="cpu", backend="triton", max_num_seqs=6,
                       max_num_batched_tokens=48, max_num_pages=64, overlap=overlap)
    prompts = [[3, 5, 7, 9, 11, 13] * 7, [2, 4, 6], [8] * 20, [1, 2, 9, 9, 4] * 6]  # 95 tokens
    outs = []
    for graphs, backend in ((False, "torch"), (True, "triton")):
        engine = Engine(cfg.replace(backend=backend))
        if graphs:
            _mixedgraphs_on_the_cpu(engine)
        ids = [engine.add_request(p, SamplingParams(max_new_tokens=4 + i, ignore_eos=True))
               for i, p in enumerate(prompts)]
        done = {}
        while engine.has_unfinished():
            done.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
            if engine.num_steps in (1, 4):  # late prompts: their chunks ride with fed decodes
                late = [5] * (33 if engine.num_steps == 1 else 9)
                ids.append(engine.add_request(late, SamplingParams(max_new_tokens=3, ignore_eos=True)))
        outs.append([done[i] for i in ids])
        if graphs:
            buckets = {key[1] for key in engine.runner.graphs}
            assert len(buckets) >= 2 and buckets <= {16, 32, 48}, buckets  # several buckets
    assert outs[0] == outs[1]


@CPU_ENGINE_THROUGH_THE_INTERPRETER
def test_padded_mixed_step_gives_the_unpadded_steps_logits(tiny_qwen2):
    """One mixed step (a chunk with a prefix, a decode, a chunk whose row is not sampled) run
    eagerly unpadded and padded to its bucket and max_num_seqs: the sampled rows' logits agree,
    and are finite."""
    engine = Engine(EngineConfig(model=str(tiny_qwen2), device="cpu", backend="triton",
                                 max_num_seqs=6, max_num_batched_tokens=64, max_num_pages=32))
    runner = engine.runner
    rows = [StepRow(list(range(3, 12)), 5, [0]), StepRow([7], 20, [1, 2]),
            StepRow([9, 8, 7], 0, [3], False), StepRow(list(range(20, 30)), 0, [4])]
    layout = build_layout(rows, 16)
    logits = []
    for bucket in (None, 32, 64):
        for page in range(5):  # the same prefix K/V before each run (the runs overwrite it)
            torch.manual_seed(page)
            engine.kv_pool.k_cache[:, page].normal_()
            engine.kv_pool.v_cache[:, page].normal_()
        input_ids, meta = runner.buffers.load(layout, pad_tokens=bucket)
        assert input_ids.shape[0] == (bucket or 23)
        logits.append(runner.forward(input_ids, meta))
    assert logits[0].shape[0] == 3 and torch.isfinite(logits[0]).all()
    torch.testing.assert_close(logits[1], logits[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits[2], logits[0], rtol=1e-5, atol=1e-5)


@CPU_ENGINE_THROUGH_THE_INTERPRETER
@pytest.mark.parametrize("splits", [None, "2,16,48,40"], ids=["default", "split"])
def test_warm_up_captures_every_mixed_graph_the_steps_replay(tiny_qwen2, monkeypatch, splits):
    """With stand-in graphs on the CPU (Triton through the interpreter): the warm-up captures
    one mixed graph per reachable (token bucket, prefill variant, split cap), and a run of
    chunked prompts mixed with decodes afterwards replays only those. "split": every bucket's
    steps split past 40 tokens of context (short chunks' and decodes' steps too), which these
    prompts reach."""
    from flashlet.attention.triton_backend import PREFILL_SPLITS_ENV
    from flashlet.core.warmup import warm_up

    if splits is None:
        monkeypatch.delenv(PREFILL_SPLITS_ENV, raising=False)
    else:
        monkeypatch.setenv(PREFILL_SPLITS_ENV, splits)
    engine = Engine(EngineConfig(model=str(tiny_qwen2), device="cpu", backend="triton",
                                 max_num_seqs=4, max_num_batched_tokens=48, max_num_pages=64))
    graphs_on_the_cpu(engine)
    runner = engine.runner
    runner.use_mixed_graphs = True

    def capture(input_ids, meta):
        graph = ReplayEagerly(lambda: runner.model(input_ids, meta.positions, runner.backend))
        return graph, graph.logits

    runner._capture_mixed = capture
    report = warm_up(engine)
    mixed = {key for key in runner.graphs if key[0] == "mixed"}
    assert report["mixed_graphs"] == len(mixed) >= 3
    # and two graphs a decode size: the one that ends in the logits, the one in greedy tokens
    assert runner.greedy_token_sizes() == runner.graph_sizes
    assert report["graphs"] == len(runner.graphs) == len(mixed) + 2 * len(runner.graph_sizes)
    captured = set(runner.graphs)
    params = SamplingParams(max_new_tokens=3, ignore_eos=True)
    for prompt in ([3, 5, 7] * 14, [2, 4], [8] * 20, [1, 2, 9, 9, 4] * 6, [6] * 17):
        engine.add_request(prompt, params)
    while engine.has_unfinished():
        engine.step()
    # a short chunk beside a decode 44+ tokens in: the short bucket's step, split where asked
    engine.add_request([5] * 44, SamplingParams(max_new_tokens=6, ignore_eos=True))
    for _ in range(3):
        engine.step()
    engine.add_request([7, 8, 9], params)
    while engine.has_unfinished():
        engine.step()
    assert set(runner.graphs) == captured, set(runner.graphs) - captured
    assert {key[-1] for key in mixed} == ({1, 2} if splits else {1})


@pytest.mark.parametrize("ps", [1, 4, 16])
def test_steady_decode_steps_move_the_last_columns_on_to_the_reference_layout(ps):
    """A run of steady updates (the same rows, each one token on: positions, slots and page
    indices moved on from the last step, not rebuilt) gives the reference layout each step:
    rows crossing into a new page, pages appended, the prefix cache swapping a row's indexed
    pages, tokens fed (None) or given."""
    from flashlet.core.scheduler import BatchUpdate

    rng = random.Random(200 + ps)
    batch = InputBatch(8, 200, ps)
    tables = {i: rng.sample(range(2000), rng.randrange(1, 4)) for i in range(6)}
    starts = {i: rng.randrange(0, len(t) * ps) for i, t in tables.items()}
    step = rng.sample(sorted(tables), 5)  # row order differs from id order; one id sits out
    update = BatchUpdate(added=[(i, t) for i, t in tables.items()], request_ids=step,
                         starts=[starts[i] for i in step],
                         token_ids=[rng.randrange(1, 100) for _ in step])
    steady = 0
    for _ in range(60):
        batch.apply(update)
        update = BatchUpdate(steady=True)
        for i in step:
            starts[i] += 1
            need = starts[i] // ps + 1
            if len(tables[i]) < need:  # its token starts a page: appended, as _reserve does
                update.pages.append((i, len(tables[i]), new := rng.sample(range(2000, 4000), 1)))
                tables[i] = tables[i] + new
            elif rng.random() < 0.05:  # the prefix cache swaps in its copies of full pages
                first = rng.randrange(0, need)
                tables[i] = tables[i][:first] + rng.sample(range(4000, 6000), need - first)
                update.pages.append((i, first, tables[i][first:]))
        fed = rng.random() < 0.5
        tokens = [PLACEHOLDER if fed else rng.randrange(1, 100) for _ in step]
        update.token_ids = None if fed else tokens
        layout = batch.apply(update)
        rows = [StepRow([t], starts[i], tables[i], True, n) for n, (i, t) in enumerate(zip(step, tokens))]
        want = reference_layout(rows, ps)
        for name, tensor in layout.tensors().items():
            assert tensor.tolist() == want[name], (name, rows)
        assert layout.is_pure_decode and layout.max_query_len == 1
        # each row samples output token kv_len - prompt (none here): a seeded row's noise key
        assert batch.sampled_output_index.tolist() == want["kv_lens"]
        steady += 1
        update.steady, update.pages = False, []  # the next loop's first apply: the same step
        update.request_ids, update.starts = step, [starts[i] + 1 for i in step]
        update.token_ids = [rng.randrange(1, 100) for _ in step]
        for i in step:
            starts[i] += 1
            if len(tables[i]) < starts[i] // ps + 1:
                update.pages.append((i, len(tables[i]), new := rng.sample(range(2000, 4000), 1)))
                tables[i] = tables[i] + new
    assert steady == 60


def test_a_steady_update_needs_the_last_step_to_be_a_decode_of_the_same_rows():
    from flashlet.core.scheduler import BatchUpdate

    batch = InputBatch(4, 4, 4)
    first = BatchUpdate(added=[(1, [5]), (2, [6])], request_ids=[1, 2], starts=[0, 0],
                        token_ids=[3, 4], query_lens=[1, 1], sample=[True, False])
    batch.apply(first)  # row 2 does not sample: the next step cannot be steady
    with pytest.raises(ValueError, match="steady update"):
        batch.apply(BatchUpdate(steady=True))
    batch.apply(BatchUpdate(request_ids=[1, 2], starts=[1, 1], token_ids=[3, 4]))
    with pytest.raises(ValueError, match="steady update"):  # a row left since
        batch.apply(BatchUpdate(removed=[2], steady=True, token_ids=[7]))
