"""The sort-free sampling kernel (flashlet/kernels/sampling.py) against the torch reference
(flashlet.runner.sampler.sampling_probs) and a float64 kept-set reference (tests/test_sampler.py): the
same kept set on flat, peaked, tied and -inf rows under every filter combination; draws that follow the
reference distribution; seeded rows independent of their batch. On the CPU the kernel runs in
Triton's interpreter (about 0.1 s a row), so the rows are few and the vocabularies small."""

import math

import pytest
import torch

from flashlet.core.request import Request
from flashlet.core.sampling import SamplingParams, _splitmix64
from flashlet.kernels.sampling import STEP_SEEDS, accepts, sample_rows
from flashlet.runner.batch import InputBatch
from flashlet.runner.sampler import Sampler, apply_penalties, sampling_probs
from tests.test_sampler import ref_kept

SUB = 256  # sub-tiles of 256 draws: the interpreter's cost grows with the tile, not the vocabulary


def make_rows(kind: str, rows: int, vocab: int, gen: torch.Generator) -> torch.Tensor:
    logits = torch.randn(rows, vocab, generator=gen)
    if kind == "peaked":
        logits = logits * 6
    elif kind == "ties":  # a few distinct values, each shared by many tokens
        logits = (logits * 2).round() / 2
    elif kind == "banned":  # grammar / min_tokens bans, the row max among them on one row
        logits = logits * 3
        logits[:, ::3] = float("-inf")
        logits[0, logits[0].argmax()] = float("-inf")
    return logits


FILTERS = [  # temperature, top_k, top_p, min_p
    (1.0, 0, 1.0, 0.0), (0.7, 0, 0.9, 0.0), (1.3, 5, 1.0, 0.0), (0.8, 0, 1.0, 0.05),
    (0.7, 50, 0.9, 0.0), (1.0, 20, 0.5, 0.02), (0.5, 0, 0.6, 0.1), (1.5, 500, 0.95, 0.001),
]


@pytest.mark.parametrize("kind", ["flat", "peaked", "ties", "banned"])
def test_accepted_set_is_the_reference_kept_set(kind):
    """The kernel's accept decision (the one its sampling loop makes) on the boundary of the
    reference kept set: the least likely kept token is accepted, the most likely dropped one is
    not; with the decision monotone in the logit, that pins the whole set."""
    gen = torch.Generator().manual_seed(["flat", "peaked", "ties", "banned"].index(kind))
    vocab = 1000
    logits = make_rows(kind, len(FILTERS), vocab, gen)
    params = torch.tensor(FILTERS, dtype=torch.float32)
    rows, candidates, want = [], [], []
    for r, (t, k, p, min_p) in enumerate(FILTERS):
        kept, borderline = ref_kept(logits[r], t, k, p, min_p)
        order = logits[r].argsort(descending=True)
        kept_order = kept[order]
        last_kept = order[kept_order.nonzero().max()]
        tests = [(last_kept, True), (order[0], bool(kept[order[0]]))]
        if not kept_order.all() and logits[r, order[kept_order.sum()]] > float("-inf"):
            tests.append((order[kept_order.sum()], False))  # the first dropped token
        for token, accepted in tests:
            if not borderline[token]:
                rows.append(r)
                candidates.append(int(token))
                want.append(accepted)
    assert len(rows) >= 2 * len(FILTERS)  # borderline skips stay rare, so the test can fail
    index = torch.tensor(rows)
    got = accepts(logits[index].contiguous(), params[index].contiguous(),
                  torch.tensor(candidates), sub=SUB)
    assert got.tolist() == want, [(FILTERS[r], c) for r, c, g, w in
                                  zip(rows, candidates, got.tolist(), want) if g != w]


def test_reference_kept_set_is_sampling_probs_support_without_ties():
    """The float64 reference above agrees with the torch sampler's (sort-based) reference."""
    gen = torch.Generator().manual_seed(11)
    logits = make_rows("flat", len(FILTERS), 1500, gen)
    columns = torch.tensor(FILTERS, dtype=torch.float32).unbind(1)
    support = sampling_probs(logits, *columns) > 0
    for r, f in enumerate(FILTERS):
        kept, borderline = ref_kept(logits[r], *f)
        assert torch.equal(kept & ~borderline, support[r] & ~borderline), f


def chi_square(tokens: list[int], probs: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic over the tokens of nonzero probability, and its degrees of freedom;
    a token of zero probability drawn even once makes it infinite."""
    counts = torch.bincount(torch.tensor(tokens), minlength=probs.numel()).double()
    support = probs > 0
    if counts[~support].sum() > 0:
        return math.inf, 0
    expected = probs[support].double() * len(tokens)
    return float(((counts[support] - expected) ** 2 / expected).sum()), int(support.sum()) - 1


@pytest.mark.slow
@pytest.mark.parametrize("sub,filters,draws", [(16, (0.7, 0, 0.9, 0.0), 200),
                                               (4, (0.9, 6, 0.8, 0.05), 64)],
                         ids=["one-block-top-p", "three-blocks-top-k-top-p-min-p"])
def test_draws_follow_the_reference_distribution(filters, sub, draws):
    """Many rows with one row's logits, each its own Philox seed (fixed: the result is
    deterministic, it cannot flake): Pearson's chi-square against sampling_probs stays below the
    0.999 quantile (a wrong renormalisation or draw is far above it at these sizes). sub 16:
    the row is one block; sub 4: three blocks of 16, so the draw picks a block first, after
    the k-th largest search over all three. (The other two pairings add no code path: each
    interpreted row costs ~0.1-1 s, so the suite runs these two.) The three-block rows cost
    most (each searches the k-th largest value; ~0.7 s a row): their kept set is 4 tokens, so
    64 draws still expect 7 of the least likely one (p 0.11), and a token outside the set, what
    a filter or floor bug draws, makes the statistic infinite however few draws there are."""
    gen = torch.Generator().manual_seed(12)
    vocab = 48
    row = torch.randn(vocab, generator=gen) * 1.5
    row[7] = float("-inf")
    logits = row.expand(draws, vocab).contiguous()
    params = torch.tensor([filters] * draws, dtype=torch.float32)
    ids = torch.stack([torch.arange(draws), 1000 + 7919 * torch.arange(draws)], 1)
    tokens = torch.empty(draws, dtype=torch.int64)
    sample_rows(logits, params, ids, tokens, sub=sub)
    want = sampling_probs(row[None], *params[:1].unbind(1))[0]
    stat, dof = chi_square(tokens.tolist(), want)
    assert dof >= 2
    # Wilson-Hilferty: the chi-square(dof) 0.999 quantile, within a few percent
    z = 3.09
    limit = dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3
    assert stat < limit, (stat, limit, dof)


def test_seeded_rows_do_not_depend_on_their_batch():
    """Through the Sampler's kernel path: a seeded request draws the same tokens beside other
    rows or alone, a different seed draws others, and its noise changes with its position."""
    gen = torch.Generator().manual_seed(13)
    vocab = 200
    logits = torch.randn(4, vocab, generator=gen) * 0.5  # flat: many tokens possible

    def draws(seed: int, companions: int) -> list[int]:
        sampler = Sampler(torch.device("cpu"), {1}, use_kernel=True)
        seeded = Request(0, [3, 4], SamplingParams(temperature=1.0, top_p=0.95, seed=seed))
        others = [Request(i + 1, [5], SamplingParams(temperature=0.8)) for i in range(companions)]
        out = []
        for _ in range(4):
            reqs = others[:1] + [seeded] + others[1:]
            rows = [1, 0, 2, 3][: len(reqs)] if others else [0]  # the seeded row: logits[0]
            tokens = sampler.sample(logits[rows].clone(), reqs).tokens.tolist()
            out.append(tokens[1 if others else 0])
            seeded.output_token_ids.append(out[-1])
        return out

    alone = draws(123, 0)
    assert alone == draws(123, 2)
    assert alone != draws(124, 0)
    assert len(set(alone)) > 1


def test_kernel_path_keeps_greedy_rows_exact_and_penalties_sparse():
    """A mixed batch on the kernel path: greedy rows are the argmax of the penalised logits;
    a sampled row with top_k 2 only ever draws one of its two most likely penalised tokens."""
    gen = torch.Generator().manual_seed(14)
    vocab = 300
    logits = torch.randn(3, vocab, generator=gen) * 2
    logits[:, 10] = 20.0  # the favourite everywhere, but in the prompt: repetition 50 sinks it
    params = [SamplingParams(repetition_penalty=50.0),
              SamplingParams(temperature=1.0, top_k=2, repetition_penalty=50.0),
              SamplingParams(frequency_penalty=0.5)]
    reqs = [Request(i, [10, 11], p) for i, p in enumerate(params)]
    sampler = Sampler(torch.device("cpu"), {1}, use_kernel=True)
    tokens = sampler.sample(logits.clone(), reqs).tokens.tolist()
    penalised = logits[0].clone()
    penalised[10] /= 50
    penalised[11] = penalised[11] / 50 if penalised[11] > 0 else penalised[11] * 50
    assert tokens[0] == int(penalised.argmax())
    second = logits[1].clone()
    second[10], second[11] = penalised[10], (logits[1, 11] / 50 if logits[1, 11] > 0
                                             else logits[1, 11] * 50)
    assert tokens[1] in second.topk(2).indices.tolist()
    assert tokens[2] == 10  # frequency counts output tokens only: the prompt's 10 stays on top
    row = 0  # without a batch, a request's penalty row is its place in the call
    assert sampler.seen_ids[row, : int(sampler.seen_lens[row])].tolist() == [10, 11, tokens[0]]


def test_mixed_seeds_equal_the_host_splitmix():
    """ids (row, seed, position): the kernel's own splitmix64 gives the noise the host's
    (flashlet.core.sampling.noise_seed) would, seeded rows advance their position, unseeded rows
    (position -1) take (step seed, row)."""
    gen = torch.Generator().manual_seed(15)
    logits = torch.randn(6, 64, generator=gen)
    params = torch.tensor([[1.0, 0, 0.95, 0.0]] * 6)
    mixed = torch.tensor([[0, 123, 5], [1, -77, 0], [2, 2**62 + 5, 9], [3, 0, -1], [4, 0, -1],
                          [5, 7, 3]])
    step_seed = STEP_SEEDS[0] + 12345
    direct = torch.tensor([[r, _splitmix64(s, p) if p >= 0 else _splitmix64(step_seed, r)]
                           for r, s, p in mixed.tolist()])
    got, want = torch.empty(6, dtype=torch.int64), torch.empty(6, dtype=torch.int64)
    sample_rows(logits, params, mixed, got, sub=16, step_seed=step_seed)
    sample_rows(logits, params, direct, want, sub=16)
    assert got.tolist() == want.tolist()
    assert mixed[:, 2].tolist() == [6, 1, 10, -1, -1, 4]


def test_cached_batch_state_follows_joins_leaves_and_reorders():
    """Through the kernel path, with the batch state reused while the batch stays the same and
    rebuilt when it changes: each request's tokens (seeded, penalised or top_k 1) are the ones
    it draws alone, and every penalised row equals the dense reference at every step."""
    gen = torch.Generator().manual_seed(16)
    vocab = 96
    rows = {rid: torch.randn(vocab, generator=gen) * 0.5 for rid in range(3)}  # flat rows
    params = {0: SamplingParams(temperature=1.0, top_p=0.95, seed=5, frequency_penalty=0.3,
                                presence_penalty=0.2, repetition_penalty=1.3),
              1: SamplingParams(temperature=0.9, seed=6),
              2: SamplingParams(temperature=1.0, top_k=1, repetition_penalty=2.0)}
    prompts = {0: [3, 4, 4], 1: [5], 2: [int(rows[2].argmax()), 7]}
    schedule = [[0, 1], [0, 1], [0, 1], [1, 2, 0], [1, 2, 0], [2, 0], [0, 2], [0]]

    def run(batches):
        sampler = Sampler(torch.device("cpu"), {1}, use_kernel=True)
        reqs = {rid: Request(rid, prompts[rid], params[rid]) for rid in params}
        runner_batch = InputBatch(4, 0, 1)  # the model runner's rows, as the steps change them
        states = []
        for batch in batches:
            logits = torch.stack([rows[rid] for rid in batch])
            before = logits.clone()
            held = [reqs[rid] for rid in batch]
            tokens = sampler.sample(logits, held, runner_batch.hold(held)).tokens.tolist()
            states.append(sampler.state)
            for r, rid in enumerate(batch):
                p, req = params[rid], reqs[rid]
                if p.has_penalties:
                    out = req.output_token_ids
                    counts = torch.bincount(torch.tensor(out, dtype=torch.int64),
                                            minlength=vocab).to(torch.int32)[None]
                    mask = torch.zeros(1, vocab, dtype=torch.bool)
                    mask[0, prompts[rid]] = True
                    want = apply_penalties(before[r:r + 1], counts, mask,
                                           torch.tensor([p.presence_penalty]),
                                           torch.tensor([p.frequency_penalty]),
                                           torch.tensor([p.repetition_penalty]))[0]
                    assert torch.equal(logits[r], want), (batch, rid)
                if p.top_k == 1:
                    assert tokens[r] == int(logits[r].argmax())
                req.output_token_ids.append(tokens[r])
        return {rid: reqs[rid].output_token_ids for rid in params}, states

    together, states = run(schedule)
    assert states[1] is states[0] and states[2] is states[0]  # reused while the batch stays
    assert states[3] is not states[2] and states[4] is states[3]  # rebuilt on a change
    alone = {rid: run([[rid]] * len(together[rid]))[0][rid] for rid in (0, 1)}
    assert together[0] == alone[0] and together[1] == alone[1]
    assert len(set(together[0])) > 1
