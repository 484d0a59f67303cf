"""GPU checks of the batched sampler: the same distribution, greedy tokens and logprobs on
CUDA as the per-row references on the CPU (tests/test_sampler.py), with the logprobs copied
through pinned memory and penalties counted on the device across overlapped steps; and the
sampling kernel (flashlet/kernels/sampling.py) at the real size, 128 rows of Qwen2.5's 151,936
tokens: its kept set is the reference's, its draws follow the reference distribution."""

import math

import pytest
import torch

from flashlet.core.sampling import SamplingParams
from flashlet.runner.sampler import Sampler
from flashlet.runner.sampler import sampling_probs
from tests.test_sampler import (VOCAB, ref_kept, ref_penalties, ref_probs, request,
                                total_variation)

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_cuda_draws_greedy_and_logprobs_match_the_references():
    logits = torch.randn(VOCAB, generator=torch.Generator().manual_seed(2)) * 2
    sampled = SamplingParams(temperature=0.7, top_p=0.9, min_p=0.02, logprobs=2,
                             presence_penalty=0.5, repetition_penalty=1.2)
    greedy = SamplingParams(logprobs=2, frequency_penalty=0.7)
    n = 20000
    reqs = [request(i, sampled if i % 2 else greedy, output=[]) for i in range(n)]
    sampler = Sampler(torch.device("cuda"), {1})
    out = sampler.sample(logits.cuda().expand(n, VOCAB).contiguous(), reqs)
    torch.cuda.synchronize()
    tokens = out.tokens.cpu().tolist()
    want = ref_probs(ref_penalties(logits, [3, 4, 5], [], sampled), sampled)
    assert total_variation(tokens[1::2], want) < 0.03
    assert set(tokens[0::2]) == {int(ref_penalties(logits, [3, 4, 5], [], greedy).argmax())}
    raw = torch.log_softmax(logits, -1)
    for row in (0, 1, n - 1):
        lp = out.logprobs.get(row)
        assert lp.token_id == tokens[row]
        assert lp.logprob == pytest.approx(raw[tokens[row]].item(), abs=1e-5)
        assert [t for t, _ in lp.top] == raw.topk(2).indices.tolist()


def test_engine_on_cuda_with_penalties_and_logprobs_overlapped(tiny_qwen2):
    from flashlet import LLM

    params = SamplingParams(max_new_tokens=16, ignore_eos=True, repetition_penalty=1.5,
                            logprobs=1)
    outs = {}
    for overlap in (False, True):
        llm = LLM(str(tiny_qwen2), device="cuda", overlap=overlap)
        outs[overlap] = llm.generate([[5, 6, 7], [9, 9]], params)
    for a, b in zip(outs[False], outs[True]):
        assert a.token_ids == b.token_ids  # counts updated on the device, in time for overlap
        assert len(b.logprobs) == len(b.token_ids)


def test_engine_on_cuda_with_logit_bias_greedy_and_sampled(tiny_qwen2):
    """logit_bias on CUDA (one flat index_add_ before the sampling kernel), overlapped steps,
    greedy and sampled rows of one batch: +100 forces the token in each, -100 keeps the plain
    greedy output's first token out."""
    from flashlet import LLM

    llm = LLM(str(tiny_qwen2), device="cuda")
    plain = llm.generate([[5, 6, 7]], SamplingParams(max_new_tokens=8, ignore_eos=True))[0].token_ids
    outs = llm.generate([[5, 6, 7], [9, 9], [5, 6, 7]], [
        SamplingParams(max_new_tokens=8, ignore_eos=True, logit_bias={42: 100.0}),
        SamplingParams(max_new_tokens=8, ignore_eos=True, temperature=1.0, logit_bias={42: 100.0}),
        SamplingParams(max_new_tokens=8, ignore_eos=True, logit_bias={plain[0]: -100.0})])
    assert outs[0].token_ids == outs[1].token_ids == [42] * 8
    assert plain[0] not in outs[2].token_ids


QWEN_VOCAB, ROWS = 151936, 128
FILTERS = [  # temperature, top_k, top_p, min_p
    (0.7, 0, 0.9, 0.0), (1.0, 0, 1.0, 0.0), (1.3, 5, 1.0, 0.0), (0.8, 0, 1.0, 0.05),
    (0.7, 50, 0.9, 0.0), (1.0, 20, 0.5, 0.02), (0.5, 0, 0.6, 0.1), (1.5, 70000, 0.95, 0.001),
]


def real_rows(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """128 rows: flat, peaked and banned (-inf) rows under each filter combination."""
    logits = torch.randn(ROWS, QWEN_VOCAB, generator=gen)
    logits[ROWS // 3 : 2 * ROWS // 3] *= 6
    logits[2 * ROWS // 3 :, ::3] = float("-inf")
    params = torch.tensor([FILTERS[r % len(FILTERS)] for r in range(ROWS)], dtype=torch.float32)
    return logits, params


def test_kernel_kept_set_at_the_real_vocabulary():
    """Each row's least likely kept token is accepted, its most likely dropped one is not."""
    from flashlet.kernels.sampling import accepts

    logits, params = real_rows(torch.Generator().manual_seed(20))
    last_kept, first_dropped, checked = [], [], 0
    for r in range(ROWS):
        kept, borderline = ref_kept(logits[r], *params[r].tolist())
        order = logits[r].argsort(descending=True)
        n = int(kept[order].sum())
        last_kept.append(int(order[n - 1]) if not borderline[order[n - 1]] else -1)
        below = order[n] if n < QWEN_VOCAB else order[-1]
        ok = n < QWEN_VOCAB and not borderline[below] and logits[r, below] > float("-inf")
        first_dropped.append(int(below) if ok else -1)
        checked += (last_kept[-1] >= 0) + (first_dropped[-1] >= 0)
    # Near-flat rows at 151,936 tokens put many boundaries within rounding of each other
    # (borderline: skipped); a GPU run had 182 clear checks of 256.
    assert checked > ROWS, f"only {checked} clear boundary checks in {ROWS} rows"
    cuda_logits, cuda_params = logits.cuda(), params.cuda()
    for candidates, want in ((last_kept, True), (first_dropped, False)):
        got = accepts(cuda_logits, cuda_params,
                      torch.tensor([max(c, 0) for c in candidates]).cuda()).cpu()
        bad = [r for r, c in enumerate(candidates) if c >= 0 and bool(got[r]) != want]
        assert not bad, [(params[r].tolist(), candidates[r]) for r in bad]


@pytest.mark.parametrize("scale, filters", [(1.0, (0.7, 0, 0.9, 0.0)),
                                            (4.0, (1.0, 50, 0.8, 0.0))])
def test_kernel_draws_follow_the_reference_at_the_real_vocabulary(scale, filters):
    """51,200 draws (400 launches of 128 rows with one row's logits, fixed seeds: deterministic)
    binned into 40 groups of tokens of equal reference mass: Pearson's chi-square below its 0.9999
    quantile, and no draw outside the kept set."""
    from flashlet.kernels.sampling import sample_rows

    gen = torch.Generator().manual_seed(21)
    row = torch.randn(QWEN_VOCAB, generator=gen) * scale
    row[::97] = float("-inf")
    logits = row.cuda().expand(ROWS, QWEN_VOCAB).contiguous()
    params = torch.tensor([filters] * ROWS, dtype=torch.float32).cuda()
    out = torch.empty(ROWS, dtype=torch.int64, device="cuda")
    draws = []
    for launch in range(400):
        seeds = 1 + launch * ROWS + torch.arange(ROWS)
        ids = torch.stack([torch.arange(ROWS), seeds * 2654435761], 1).cuda()
        sample_rows(logits, params, ids, out)
        draws.append(out.clone())
    tokens = torch.cat(draws).cpu()
    want = sampling_probs(row[None].double(), *params[:1].cpu().double().unbind(1))[0]
    kept, borderline = ref_kept(row, *filters)
    assert bool((kept | borderline)[tokens].all()), "a draw outside the kept set"
    order = want.argsort(descending=True)
    bins = 40
    group = torch.empty(QWEN_VOCAB, dtype=torch.int64)  # tokens of equal mass, by rank
    group[order] = (want[order].cumsum(0) * bins).clamp(max=bins - 1e-9).long()
    expected = torch.zeros(bins, dtype=torch.float64).index_add_(0, group, want) * len(tokens)
    observed = torch.bincount(group[tokens], minlength=bins).double()
    used = expected > 5
    stat = float(((observed[used] - expected[used]) ** 2 / expected[used]).sum())
    dof = int(used.sum()) - 1
    assert dof >= 2, "too few groups to test"
    limit = dof * (1 - 2 / (9 * dof) + 3.72 * math.sqrt(2 / (9 * dof))) ** 3  # 0.9999 quantile
    assert stat < limit, (stat, limit, dof)


def test_kernel_seed_mixing_and_penalties_match_the_host_and_torch():
    """Compiled for the GPU (the interpreter checks the same on the CPU): the sampling kernel's
    splitmix64 of (seed, position) is the host's, and the penalty kernel writes exactly what the
    torch ops of the CPU path write."""
    from flashlet.kernels.sampling import STEP_SEEDS, sample_rows
    from flashlet.core.sampling import _splitmix64

    gen = torch.Generator().manual_seed(31)
    logits = torch.randn(6, 4096, generator=gen).cuda()
    params = torch.tensor([[1.0, 0, 0.95, 0.0]] * 6).cuda()
    mixed = torch.tensor([[0, 123, 5], [1, -77, 0], [2, 2**62 + 5, 9], [3, 0, -1], [4, 0, -1],
                          [5, 7, 3]])
    step_seed = STEP_SEEDS[0] + 999
    direct = torch.tensor([[r, _splitmix64(s, p) if p >= 0 else _splitmix64(step_seed, r)]
                           for r, s, p in mixed.tolist()]).cuda()
    mixed = mixed.cuda()
    got, want = (torch.empty(6, dtype=torch.int64, device="cuda") for _ in range(2))
    sample_rows(logits, params, mixed, got, step_seed=step_seed)
    sample_rows(logits, params, direct, want)
    assert got.tolist() == want.tolist() and mixed[:, 2].tolist() == [6, 1, 10, -1, -1, 4]

    reqs = [request(i, SamplingParams(temperature=1.0, presence_penalty=0.5 * i,
                                      frequency_penalty=0.3, repetition_penalty=1.1 + i / 10),
                    prompt=[3, 4, 4, 9 + i], output=[5, 5, 7 + i]) for i in range(4)]
    source = torch.randn(4, VOCAB, generator=gen) * 3
    penalised = {}
    for use_kernel in (False, True):
        sampler = Sampler(torch.device("cuda"), {1}, use_kernel=use_kernel)
        out = source.cuda()
        sampler._apply_penalties(out, sampler.batch_state(reqs, VOCAB))
        penalised[use_kernel] = out.cpu()
    assert torch.equal(penalised[True], penalised[False])
    assert not torch.equal(penalised[True], source)
