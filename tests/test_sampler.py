"""The batched sampler against slow per-row references on random logits: the same distribution,
exact greedy tokens, exact logprobs, penalties, min_tokens, seeds."""

import math

import pytest
import torch

from flashlet.core.request import Request
from flashlet.core.sampling import SamplingParams, make_generator, sample_one
from flashlet.runner.batch import InputBatch
from flashlet.runner.sampler import Sampler, apply_penalties, sampling_probs

VOCAB = 24
EOS = 1


# ---- slow, obvious references (one row at a time, plain Python where it reads better) -----
def ref_penalties(logits, prompt, output, p: SamplingParams):
    """vLLM's semantics: repetition over prompt+output tokens, then frequency and presence
    over output tokens only."""
    logits = logits.clone()
    for t in set(prompt) | set(output):
        x = logits[t].item()
        logits[t] = x / p.repetition_penalty if x > 0 else x * p.repetition_penalty
    for t in set(output):
        logits[t] -= p.frequency_penalty * output.count(t) + p.presence_penalty
    return logits


def ref_probs(logits, p: SamplingParams):
    """The distribution of sample_one's draws, with min_p applied after temperature (vLLM)."""
    logits = logits / p.temperature
    if p.min_p > 0:
        probs = torch.softmax(logits, -1)
        logits = torch.where(probs < probs.max() * p.min_p, float("-inf"), logits)
    if p.top_k > 0:
        kth = torch.topk(logits, min(p.top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, -1)
    if p.top_p < 1:
        kept, total = torch.zeros_like(probs), 0.0
        for i in probs.argsort(descending=True).tolist():
            if total >= p.top_p:
                break
            kept[i], total = probs[i], total + probs[i].item()
        probs = kept / kept.sum()
    return probs


MARGIN = 1e-4  # a token this close to a min_p or top_p boundary may fall either side (fp32)


def ref_kept(logits: torch.Tensor, t: float, k: int, p: float, min_p: float):
    """-> (kept [vocab] bool, borderline [vocab] bool) in float64, one row: the sampling
    kernel's semantics (flashlet/kernels/sampling.py). Temperature, min_p on exp(l - max), top_k
    with ties kept, then top_p keeping a token when the kept mass strictly above it is below
    top_p (ties at the boundary all kept); borderline tokens are within rounding of a boundary."""
    l = (logits / t).double()  # the same fp32 division as the kernel, then float64
    w = torch.exp(l - l.max())
    kept = w >= min_p
    borderline = (w - min_p).abs() < MARGIN * min_p
    finite = l > float("-inf")
    k = int(k)
    if 0 < k < int((kept & finite).sum()):
        kth = l[kept].sort(descending=True).values[k - 1]
        kept &= l >= kth
    if p < 1:
        values, order = l.sort(descending=True)
        kept_w = (w * kept)[order]
        before = kept_w.cumsum(0) - kept_w  # kept mass of the tokens sorted before each
        first_tie = torch.searchsorted(-values, -values)  # the first of each run of equal values
        above = torch.empty_like(w).scatter_(0, order, before[first_tie])
        mass = kept_w.sum()
        borderline |= kept & ((above / mass - p).abs() < MARGIN)
        kept &= (above < p * mass) | (l == l.max())
    return kept & finite, borderline


def request(rid, params, prompt=(3, 4, 5), output=()):
    req = Request(rid, list(prompt), params, make_generator(params, "cpu"))
    req.output_token_ids = list(output)
    return req


def random_params(gen: torch.Generator):
    pick = lambda *xs: xs[int(torch.randint(len(xs), (1,), generator=gen))]  # noqa: E731
    return SamplingParams(temperature=pick(0.0, 0.5, 1.0, 1.7), top_k=pick(0, 0, 3, 10),
                          top_p=pick(1.0, 0.9, 0.5), min_p=pick(0.0, 0.0, 0.1),
                          presence_penalty=pick(0.0, 0.5, -1.0),
                          frequency_penalty=pick(0.0, 0.3, 1.5),
                          repetition_penalty=pick(1.0, 1.3, 0.8), ignore_eos=True)


# ---- the pure pieces, exactly -------------------------------------------------------------
def test_penalties_match_the_per_row_reference():
    gen = torch.Generator().manual_seed(0)
    rows = 12
    logits = torch.randn(rows, VOCAB, generator=gen) * 3
    params = [random_params(gen) for _ in range(rows)]
    histories = [torch.randint(VOCAB, (int(torch.randint(0, 10, (1,), generator=gen)),),
                               generator=gen).tolist() for _ in range(rows)]
    prompts = [torch.randint(VOCAB, (5,), generator=gen).tolist() for _ in range(rows)]
    counts = torch.zeros(rows, VOCAB, dtype=torch.int32)
    mask = torch.zeros(rows, VOCAB, dtype=torch.bool)
    for r in range(rows):
        for t in histories[r]:
            counts[r, t] += 1
        mask[r, prompts[r]] = True
    column = lambda name: torch.tensor([getattr(p, name) for p in params])  # noqa: E731
    got = apply_penalties(logits, counts, mask, column("presence_penalty"),
                          column("frequency_penalty"), column("repetition_penalty"))
    for r in range(rows):
        want = ref_penalties(logits[r], prompts[r], histories[r], params[r])
        torch.testing.assert_close(got[r], want)


def test_sampling_probs_match_the_per_row_reference():
    gen = torch.Generator().manual_seed(1)
    rows = 40
    logits = torch.randn(rows, VOCAB, generator=gen) * 2.5
    params = [random_params(gen) for _ in range(rows)]
    for p in params:
        p.temperature = p.temperature or 0.9
    column = lambda name: torch.tensor([float(getattr(p, name)) for p in params])  # noqa: E731
    got = sampling_probs(logits, column("temperature"), column("top_k"), column("top_p"),
                         column("min_p"))
    for r in range(rows):
        torch.testing.assert_close(got[r], ref_probs(logits[r], params[r]), atol=1e-6, rtol=1e-5)


# ---- the sampler, end to end --------------------------------------------------------------
def total_variation(tokens: list[int], probs: torch.Tensor) -> float:
    freq = torch.bincount(torch.tensor(tokens), minlength=probs.numel()).double() / len(tokens)
    return 0.5 * (freq - probs.double()).abs().sum().item()


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_p=0.9),
    SamplingParams(temperature=1.3, top_k=5, min_p=0.05),
    SamplingParams(temperature=0.8, top_p=0.8, presence_penalty=0.6, repetition_penalty=1.2,
                   frequency_penalty=0.4),
])
def test_batched_draws_follow_the_reference_distribution(params):
    """Many rows with the same logits, drawn in one batch: their histogram is the reference
    distribution (and so is the old per-row sample_one's), within sampling noise. With these
    sizes the total variation of a correct sampler stays below ~0.025; a wrong one is far off."""
    torch.manual_seed(0)
    logits = torch.randn(VOCAB, generator=torch.Generator().manual_seed(2)) * 2
    prompt, output = [3, 4, 5], [4, 7, 7]
    want = ref_probs(ref_penalties(logits, prompt, output, params), params)
    n = 8000
    sampler = Sampler(torch.device("cpu"), {EOS})
    reqs = [request(i, params, prompt, output) for i in range(n)]  # penalties count `output`
    tokens = sampler.sample(logits.expand(n, VOCAB).contiguous(), reqs).tokens.tolist()
    assert total_variation(tokens, want) < 0.04
    if not params.has_penalties:  # the old sampler, for comparison
        gen = torch.Generator().manual_seed(3)
        old = [int(sample_one(logits, params, gen)) for _ in range(2000)]
        assert total_variation(old, want) < 0.07


def test_greedy_rows_are_exact_argmax_beside_sampled_rows():
    gen = torch.Generator().manual_seed(4)
    rows = 30
    logits = torch.randn(rows, VOCAB, generator=gen)
    params = [random_params(gen) for _ in range(rows)]
    reqs = [request(i, p, output=[2, 2, 9]) for i, p in enumerate(params)]
    sampler = Sampler(torch.device("cpu"), {EOS})
    tokens = sampler.sample(logits.clone(), reqs).tokens  # the sampler writes into its logits
    for r, p in enumerate(params):
        if p.is_greedy:
            want = ref_penalties(logits[r], [3, 4, 5], [2, 2, 9], p).argmax()
            assert tokens[r] == want


def test_all_greedy_without_extras_is_the_plain_argmax():
    logits = torch.randn(7, VOCAB, generator=torch.Generator().manual_seed(5))
    reqs = [request(i, SamplingParams()) for i in range(7)]
    out = Sampler(torch.device("cpu"), {EOS}).sample(logits, reqs)
    assert torch.equal(out.tokens, logits.argmax(-1)) and out.logprobs is None


def test_logprobs_are_the_models_log_softmax_of_the_chosen_and_top_tokens():
    gen = torch.Generator().manual_seed(6)
    logits = torch.randn(6, VOCAB, generator=gen) * 2
    ks = [None, 0, 1, 5, 20, 3]
    reqs = [request(i, SamplingParams(temperature=0.0 if i % 2 else 1.0, logprobs=k,
                                      presence_penalty=0.5))
            for i, k in enumerate(ks)]
    out = Sampler(torch.device("cpu"), {EOS}).sample(logits, reqs)
    want = torch.log_softmax(logits, -1)
    for r, k in enumerate(ks):
        lp = out.logprobs.get(r)
        if k is None:
            assert lp is None
            continue
        token = int(out.tokens[r])
        assert lp.token_id == token and lp.logprob == pytest.approx(want[r, token].item(), abs=1e-6)
        top = want[r].topk(k) if k else None
        assert [t for t, _ in lp.top] == (top.indices.tolist() if k else [])
        assert all(math.isclose(v, w, abs_tol=1e-6) for (_, v), w in
                   zip(lp.top, top.values.tolist() if k else []))


def test_penalty_counts_follow_the_sampled_tokens_on_the_device():
    sampler = Sampler(torch.device("cpu"), {EOS})
    params = SamplingParams(temperature=1.0, frequency_penalty=0.5)
    reqs = [request(0, params), request(1, params)]
    batch = InputBatch.holding(reqs)
    seen = [[], []]
    for step in range(5):
        logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(step))
        tokens = sampler.sample(logits, reqs, batch).tokens.tolist()
        for r in range(2):
            seen[r].append(tokens[r])
    for r, req in enumerate(reqs):
        row = batch.row_of[req.request_id]
        want = torch.bincount(torch.tensor(seen[r]), minlength=VOCAB).to(torch.int32)
        assert torch.equal(sampler.counts[row], want)
        filled = int(sampler.seen_lens[row])
        assert sampler.seen_ids[row, :filled].tolist() == [3, 4, 5] + seen[r]
    # Request 0 leaves and another takes its row: the row's state starts afresh, nothing to
    # release (request 1's row goes on counting).
    row = batch.row_of[0]
    newcomer = request(7, params, prompt=[6])
    batch.hold([newcomer, reqs[1]])
    assert batch.row_of[7] == row
    tokens = sampler.sample(torch.randn(2, VOCAB), [newcomer, reqs[1]], batch).tokens.tolist()
    assert sampler.seen_ids[row, : int(sampler.seen_lens[row])].tolist() == [6, tokens[0]]
    assert int(sampler.counts[row].sum()) == 1
    assert int(sampler.counts[batch.row_of[1]].sum()) == 6


def test_min_tokens_masks_eos_and_stop_token_ids_until_reached():
    logits = torch.full((3, VOCAB), -5.0)
    logits[:, EOS] = 10.0  # EOS is by far the most likely
    logits[:, 7] = 9.0  # then a stop token id
    params = SamplingParams(min_tokens=3, stop_token_ids=[7])
    reqs = [request(0, params, output=[]), request(1, params, output=[2, 2]),
            request(2, params, output=[2, 2, 2])]
    tokens = Sampler(torch.device("cpu"), {EOS}).sample(logits, reqs).tokens.tolist()
    assert tokens[0] not in (EOS, 7) and tokens[1] not in (EOS, 7) and tokens[2] == EOS


def test_seeded_rows_do_not_depend_on_their_batch():
    logits = torch.randn(5, VOCAB, generator=torch.Generator().manual_seed(7))
    seeded = SamplingParams(temperature=1.0, top_p=0.95, seed=123)

    def draws(companions: int):
        sampler = Sampler(torch.device("cpu"), {EOS})
        req = request(0, seeded)
        others = [request(i + 1, SamplingParams(temperature=1.0)) for i in range(companions)]
        out = []
        for _ in range(20):
            rows = [req] + others
            out.append(int(sampler.sample(logits[: len(rows)], rows).tokens[0]))
        return out

    assert draws(0) == draws(4)
    other_seed = SamplingParams(temperature=1.0, top_p=0.95, seed=124)
    sampler = Sampler(torch.device("cpu"), {EOS})
    req = request(0, other_seed)
    assert draws(2) != [int(sampler.sample(logits[:1], [req]).tokens[0]) for _ in range(20)]


def test_sparse_penalties_equal_the_dense_reference():
    """The sampler penalises only seen ids (prompt, then output, repeats and -inf included);
    the result is apply_penalties' dense one, exactly, and rows without penalties are left alone."""
    gen = torch.Generator().manual_seed(8)
    rows = 10
    logits = torch.randn(rows, VOCAB, generator=gen) * 3
    logits[2, 4] = float("-inf")  # a grammar-banned token that was also in the prompt
    params = [random_params(gen) for _ in range(rows)]
    params[0] = SamplingParams(temperature=1.0)  # no penalties
    prompts = [torch.randint(VOCAB, (int(torch.randint(1, 8, (1,), generator=gen)),),
                             generator=gen).tolist() for _ in range(rows)]
    prompts[2] = [4, 4, 6]
    outputs = [torch.randint(VOCAB, (int(torch.randint(0, 12, (1,), generator=gen)),),
                             generator=gen).tolist() for _ in range(rows)]
    reqs = [request(i, p, prompts[i], outputs[i]) for i, p in enumerate(params)]
    penalised = [i for i, p in enumerate(params) if p.has_penalties]
    got = logits.clone()
    sampler = Sampler(torch.device("cpu"), {EOS})
    sampler._apply_penalties(got, sampler.batch_state(reqs, VOCAB))
    counts = torch.zeros(rows, VOCAB, dtype=torch.int32)
    mask = torch.zeros(rows, VOCAB, dtype=torch.bool)
    for r in range(rows):
        for t in outputs[r]:
            counts[r, t] += 1
        mask[r, prompts[r]] = True
    column = lambda name: torch.tensor([float(getattr(p, name)) for p in params])  # noqa: E731
    want = apply_penalties(logits, counts, mask, column("presence_penalty"),
                           column("frequency_penalty"), column("repetition_penalty"))
    for r in range(rows):
        assert torch.equal(got[r], want[r] if r in penalised else logits[r]), r


def test_batch_state_is_reused_until_the_batch_changes():
    """The torch path with the cached batch state: the same requests in the same order reuse it,
    a join, a leave or a reorder rebuilds it; seeded requests draw what they draw alone, a
    penalised one keeps its own counts, and a top_k 1 row stays the argmax of its own row."""
    gen = torch.Generator().manual_seed(9)
    rows = {rid: torch.randn(VOCAB, generator=gen) * 0.5 for rid in range(3)}
    params = {0: SamplingParams(temperature=1.0, seed=3, frequency_penalty=0.4),
              1: SamplingParams(temperature=1.0, seed=4),
              2: SamplingParams(temperature=1.0, top_k=1)}
    schedule = [[0, 1], [0, 1], [1, 0, 2], [1, 0, 2], [0], [2, 0]]

    def run(steps):
        sampler = Sampler(torch.device("cpu"), {EOS})
        reqs = {rid: request(rid, p) for rid, p in params.items()}
        batch = InputBatch(4, 0, 1)
        out = {rid: [] for rid in params}
        states = []
        for step in steps:
            logits = torch.stack([rows[rid] for rid in step])
            held = [reqs[rid] for rid in step]
            tokens = sampler.sample(logits.clone(), held, batch.hold(held)).tokens.tolist()
            states.append(sampler.state)
            for r, rid in enumerate(step):
                out[rid].append(tokens[r])
        return out, states, sampler, reqs, batch

    together, states, sampler, reqs, batch = run(schedule)
    assert states[1] is states[0] and states[3] is states[2]
    assert len({id(s) for s in states}) == 4
    assert sampler.state.random_rows == [1] and sampler.state.penalised == [1]  # top_k 1: greedy
    assert together[2] == [int(rows[2].argmax())] * 3
    for rid in (0, 1):
        assert together[rid] == run([[rid]] * len(together[rid]))[0][rid]
    want = torch.bincount(torch.tensor(together[0]), minlength=VOCAB).to(torch.int32)
    assert torch.equal(sampler.counts[batch.row_of[0]], want)
    last = sampler.state
    fresh = request(2, SamplingParams(temperature=1.0, top_k=2))  # an old id, new parameters
    batch.remove(2)  # it left and came back: the same rows, in the same order, but a new version
    held = [fresh, reqs[0]]
    sampler.sample(torch.stack([rows[2], rows[0]]), held, batch.hold(held))
    assert sampler.state is not last and sampler.state.random_rows == [0, 1]


def test_uploads_parts_are_exact_and_16_byte_aligned():
    """Every part of one upload comes back as given, and starts on a 16-byte boundary (Triton
    compiles a kernel variant per pointer alignment: an 8-byte offset would compile mid-work)."""
    from flashlet.runner.sampler import Uploads

    uploads = Uploads()
    given = [[1, 2, 3], [(4, 5, 6)], [7], [], [[8, 9], [10, 11]]]
    handles = [uploads.ints(v) for v in given]
    floats = uploads.floats([(0.5, 0.25, 1.5)])
    more = uploads.ints([12])
    uploads.send(torch.device("cpu"))
    base = uploads.device_buffer.data_ptr()
    for values, h in zip(given, handles):
        part = h.get()
        assert part.tolist() == torch.tensor(values, dtype=torch.int64).view(-1).tolist()
        assert (part.data_ptr() - base) % 16 == 0
    assert floats.get().tolist() == [0.5, 0.25, 1.5] and (floats.get().data_ptr() - base) % 16 == 0
    assert more.get().tolist() == [12] and (more.get().data_ptr() - base) % 16 == 0


def test_seeds_of_any_64_bit_pattern_sample():
    """A seed in [2**63, 2**64) (the server reduces negative seeds modulo 2**64) goes to the
    device as the int64 of the same bits; it samples, reproducibly, beside a small seed."""
    from flashlet.core.sampling import as_int64 as _as_int64

    assert [_as_int64(v) for v in (0, 5, 2**63 - 1, 2**63, 2**64 - 1, -1, 2**70 + 3)] == [
        0, 5, 2**63 - 1, -2**63, -1, -1, 3]
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(3))

    def draws():
        sampler = Sampler(torch.device("cpu"), {EOS})
        rows = [request(0, SamplingParams(temperature=1.0, seed=2**64 - 1)),
                request(1, SamplingParams(temperature=1.0, seed=9))]
        return [sampler.sample(logits, rows).tokens.tolist() for _ in range(5)]

    assert draws() == draws()


# ---- the sampler's state from the persistent batch's columns ----------------------------
def step_update(request_ids, starts, removed=(), added=()):
    """A decode step's BatchUpdate over these requests (one token each, every one sampling)."""
    from flashlet.core.scheduler import BatchUpdate

    return BatchUpdate(removed=list(removed), added=list(added), request_ids=list(request_ids),
                       starts=list(starts), token_ids=[2] * len(request_ids))


def test_the_sampler_state_is_built_from_the_batch_columns_not_the_requests():
    """The rows' parameters come with the update that adds them; the sampler reads those
    columns, so the requests it is handed are not consulted for parameters."""
    from flashlet.core.scheduler import NewRow

    batch = InputBatch(4, 2, 16)
    sampled = SamplingParams(temperature=1.0, top_k=2, seed=5, logprobs=3)
    batch.apply(step_update([0, 1], [4, 4], added=[NewRow(0, [0], SamplingParams(), 4),
                                                   NewRow(1, [1], sampled, 4)]))
    assert batch.sampled_output_index.tolist() == [1, 1]  # after 4 prompt tokens and one more
    greedy_reqs = [request(0, SamplingParams()), request(1, SamplingParams())]
    state = Sampler(torch.device("cpu"), {EOS}).batch_state(greedy_reqs, VOCAB, batch)
    assert not state.plain_greedy
    assert state.random_rows == [1] and state.lp_rows == [1] and state.lp_ks == [3]
    assert state.columns.tolist() == [[1.0, 2.0, 1.0, 0.0]]
    assert state.noise_ids.tolist() == [[1, 5, 1]]  # row, seed, output position


def test_a_row_taken_by_another_request_keeps_none_of_its_old_parameters():
    from flashlet.core.scheduler import NewRow

    batch, sampler = InputBatch(1, 2, 16), Sampler(torch.device("cpu"), {EOS})
    penalised = SamplingParams(temperature=1.0, repetition_penalty=1.5, logprobs=2, min_tokens=3)
    first = request(0, penalised)
    batch.apply(step_update([0], [3], added=[NewRow(0, [0], penalised, 3)]))
    state = sampler.batch_state([first], VOCAB, batch)
    assert state.penalised == [0] and state.lp_rows == [0] and state.early_stop_rows == [0]
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(3))
    plain = request(1, SamplingParams())
    batch.apply(step_update([1], [3], removed=[0], added=[NewRow(1, [1], plain.params, 3)]))
    assert batch.row_of[1] == 0  # the same row
    out = sampler.sample(logits.clone(), [plain], batch)
    assert sampler.state.plain_greedy and out.logprobs is None
    assert out.tokens.tolist() == [int(logits.argmax())]
