"""The draft-model proposer: its proposals are the draft's own greedy continuation (batched,
chunked, after rollbacks), it never leaks a page, and it refuses a draft that cannot serve."""

import random

import pytest
import torch
from torch.overrides import TorchFunctionMode

from flashlet import EngineConfig, LLM, SamplingParams
from flashlet.core.request import PLACEHOLDER, Request
from flashlet.runner import fused_decode
from flashlet.spec.draft import DraftProposer, draft_runner_config
from flashlet.spec.api import SpeculativeConfig
from tests.conftest import save_near_copy, save_tiny_model

PAGE_SIZE = 4


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory):
    """A Llama draft, smaller than the tiny Qwen2 target, on the same 256-token vocabulary."""
    return save_tiny_model("llama", tmp_path_factory.mktemp("draft"), seed=3, hidden_size=32,
                           intermediate_size=64, num_hidden_layers=1)


@pytest.fixture(scope="module")
def greedy():
    """greedy(model folder)(prompt, n): n greedy tokens of a plain LLM on that model."""
    llms, memo = {}, {}

    def of(folder):
        def continuation(prompt, n):
            key = (str(folder), tuple(prompt), n)
            if str(folder) not in llms:
                llms[str(folder)] = LLM(str(folder), enable_prefix_cache=False)
            if key not in memo:
                params = SamplingParams(max_new_tokens=n, ignore_eos=True)
                memo[key] = llms[str(folder)].generate([list(prompt)], params)[0].token_ids
            return memo[key]

        return continuation

    return of


def make_proposer(target, draft, k=4, num_pages=None, **config):
    config = {"page_size": PAGE_SIZE, "max_num_pages": 64, "max_num_seqs": 4,
              "max_num_batched_tokens": 16, **config}
    spec = SpeculativeConfig("draft", k, model=str(draft))
    return DraftProposer(EngineConfig(model=str(target), **config), spec, num_pages=num_pages)


def prompt_of(length, seed=0):
    rng = random.Random(seed)
    return [rng.randrange(2, 256) for _ in range(length)]


def request(request_id, prompt):
    return Request(request_id, list(prompt), SamplingParams())


def test_proposals_are_the_drafts_greedy_tokens(tiny_qwen2, draft_dir, greedy):
    proposer = make_proposer(tiny_qwen2, draft_dir)
    prompt = prompt_of(11)
    assert proposer.propose([request(0, prompt)], 4) == [greedy(draft_dir)(prompt, 4)]
    proposer.check_integrity()


def test_a_batch_of_ragged_requests_each_gets_its_own_continuation(tiny_qwen2, draft_dir, greedy):
    """Three requests in one call, one prompt longer than the step budget (chunked catch-up)."""
    proposer = make_proposer(tiny_qwen2, draft_dir)
    prompts = [prompt_of(n, seed=n) for n in (5, 37, 1)]
    reqs = [request(i, p) for i, p in enumerate(prompts)]
    assert proposer.propose(reqs, 3) == [greedy(draft_dir)(p, 3) for p in prompts]
    proposer.check_integrity()
    for req, prompt in zip(reqs, prompts):  # context and d1, d2 fed; d3 only proposed
        assert proposer.num_tokens_held(req) == len(prompt) + 2


@pytest.mark.parametrize("num_accepted", [0, 2, 4])
def test_after_partial_acceptance_the_next_proposals_follow_the_new_context(
        tiny_qwen2, draft_dir, greedy, num_accepted):
    proposer = make_proposer(tiny_qwen2, draft_dir)
    prompt = prompt_of(9, seed=1)
    req = request(0, prompt)
    drafted = proposer.propose([req], 4)[0]
    # The target keeps num_accepted proposals and appends a token of its own after them.
    own = (drafted[num_accepted] + 1) % 256 if num_accepted < 4 else 7
    req.output_token_ids += drafted[:num_accepted] + [own]
    proposer.on_accepted(req, num_accepted)
    proposer.check_integrity()
    assert proposer.num_tokens_held(req) == len(prompt) + min(num_accepted, 3)
    context = req.prompt_token_ids + req.output_token_ids
    assert proposer.propose([req], 4) == [greedy(draft_dir)(context, 4)]
    proposer.check_integrity()


def test_rejected_positions_free_their_pages(tiny_qwen2, draft_dir):
    proposer = make_proposer(tiny_qwen2, draft_dir)
    req = request(0, prompt_of(8))  # two whole pages; d1..d7 fed would take two more
    free_before = proposer.num_free_pages
    drafted = proposer.propose([req], 8)[0]
    assert proposer.num_free_pages == free_before - 4
    req.output_token_ids += [(drafted[0] + 1) % 256]
    proposer.on_accepted(req, 0)
    assert proposer.num_tokens_held(req) == 8 and proposer.num_free_pages == free_before - 2
    proposer.check_integrity()


def test_a_diverged_request_is_corrected_without_on_accepted(tiny_qwen2, draft_dir, greedy):
    """The draft compares what it holds with the request: a missed on_accepted, or an output
    other than its proposals, costs recomputation, never a wrong proposal."""
    proposer = make_proposer(tiny_qwen2, draft_dir)
    prompt = prompt_of(6, seed=2)
    req = request(0, prompt)
    drafted = proposer.propose([req], 4)[0]
    req.output_token_ids += [drafted[0], (drafted[1] + 1) % 256]
    context = req.prompt_token_ids + req.output_token_ids
    assert proposer.propose([req], 3) == [greedy(draft_dir)(context, 3)]
    proposer.check_integrity()


def test_a_released_request_starts_over_and_a_reused_id_is_a_new_request(
        tiny_qwen2, draft_dir, greedy):
    """After release (preemption) the draft recomputes the whole context; a new request under
    an id whose request was never released shares only the K/V of a common prefix."""
    proposer = make_proposer(tiny_qwen2, draft_dir)
    prompt = prompt_of(10, seed=6)
    req = request(0, prompt)
    drafted = proposer.propose([req], 4)[0]
    proposer.release(req)
    req.output_token_ids += drafted[:2]
    context = req.prompt_token_ids + req.output_token_ids
    assert proposer.propose([req], 4) == [greedy(draft_dir)(context, 4)]
    other = prompt[:5] + prompt_of(3, seed=7)  # a new request under the same id
    assert proposer.propose([request(0, other)], 4) == [greedy(draft_dir)(other, 4)]
    proposer.check_integrity()


def test_warm_up_touches_no_page_and_changes_no_proposal(tiny_qwen2, draft_dir, greedy):
    proposer = make_proposer(tiny_qwen2, draft_dir)
    proposer.warm_up()
    assert proposer.num_free_pages == proposer.kv_pool.num_pages
    prompt = prompt_of(6, seed=8)
    assert proposer.propose([request(0, prompt)], 4) == [greedy(draft_dir)(prompt, 4)]


def test_release_frees_every_page(tiny_qwen2, draft_dir):
    proposer = make_proposer(tiny_qwen2, draft_dir)
    reqs = [request(i, prompt_of(3 + 7 * i, seed=i)) for i in range(3)]
    for _ in range(3):
        for req, drafted in zip(reqs, proposer.propose(reqs, 4)):
            req.output_token_ids += drafted[:1] + [(drafted[1] + 1) % 256]
            proposer.on_accepted(req, 1)
        proposer.check_integrity()
    assert proposer.num_free_pages < proposer.kv_pool.num_pages
    for req in reqs:
        proposer.release(req)
        proposer.check_integrity()
    proposer.release(reqs[0])  # a second release is a no-op
    assert proposer.num_free_pages == proposer.kv_pool.num_pages
    assert not proposer.batch.row_of


def test_proposals_stop_at_the_context_end_and_the_pools(tiny_qwen2, draft_dir, greedy):
    """n + k - 1 tokens must fit the context and the pool: fewer proposals, a prefix of the
    same continuation, and none at all where not even one fits."""
    at_end = make_proposer(tiny_qwen2, draft_dir, max_model_len=40)
    prompt = prompt_of(38)
    assert at_end.propose([request(0, prompt)], 4) == [greedy(draft_dir)(prompt, 3)]
    assert at_end.propose([request(1, prompt_of(41))], 4) == [[]]
    near_end = request(2, prompt_of(30))
    drafted = at_end.propose([near_end], 4)[0]
    near_end.output_token_ids += drafted + [5] + [6] * 6  # past the context's end
    at_end.on_accepted(near_end, 4)
    assert at_end.propose([near_end], 4) == [[]]
    at_end.on_accepted(near_end, 0)  # after no proposal: keeps the K/V it holds
    assert at_end.num_tokens_held(near_end) == 30 + 3
    at_end.check_integrity()
    small = make_proposer(tiny_qwen2, draft_dir, num_pages=3)
    prompt = prompt_of(3 * PAGE_SIZE - 2)
    assert small.propose([request(0, prompt)], 4) == [greedy(draft_dir)(prompt, 3)]
    starved = request(1, prompt_of(5))
    assert small.propose([starved], 4) == [[]]  # nothing left for another
    small.on_accepted(starved, 0)  # after no proposal: a no-op
    small.check_integrity()


def test_a_draft_that_is_the_target_proposes_the_targets_greedy_tokens(tiny_qwen2, greedy):
    """Verified against the target's own greedy run, every proposal is accepted: rounds of
    propose, accept all k, append the target's next token reproduce its output."""
    proposer = make_proposer(tiny_qwen2, tiny_qwen2)
    prompt, k, n = prompt_of(7, seed=4), 3, 21
    target = greedy(tiny_qwen2)(prompt, n)
    req = request(0, prompt)
    while len(req.output_token_ids) + k < n:
        at = len(req.output_token_ids)
        assert proposer.propose([req], k) == [target[at : at + k]]
        req.output_token_ids += target[at : at + k + 1]
        proposer.on_accepted(req, k)
        proposer.check_integrity()
    assert req.output_token_ids == target[: len(req.output_token_ids)]


@pytest.mark.parametrize("fused", [False, True], ids=["per-op", "fused"])
def test_random_rounds_of_arrivals_acceptance_and_release(tiny_qwen2, draft_dir, greedy, fused,
                                                          monkeypatch):
    """Requests arrive, speculate with random acceptance, reach the context's end (fewer
    proposals than the others in the same call) and leave; every proposal is the draft's
    greedy continuation, and no page leaks (fused: the draft's steps and short catch-ups on
    the fused path, with reference GEMVs)."""
    if fused:
        use_fused_reference_kernels(monkeypatch)
    rng, k, max_len = random.Random(1), 4, 48
    proposer = make_proposer(tiny_qwen2, draft_dir, max_model_len=max_len)
    assert (proposer.runner.fused is not None) == fused
    running, next_id, uneven_calls = [], 0, 0
    for _ in range(12):
        while len(running) < 3:
            running.append(request(next_id, prompt_of(rng.randrange(1, 40), seed=next_id)))
            next_id += 1
        proposals = proposer.propose(running, k)
        uneven_calls += len({len(p) for p in proposals} - {0}) > 1
        for req, drafted in zip(running, proposals):
            context = req.prompt_token_ids + req.output_token_ids
            assert len(drafted) == max(0, min(k, max_len - len(context) + 1))
            assert not drafted or drafted == greedy(draft_dir)(context, len(drafted))
            accepted = rng.randrange(0, len(drafted) + 1)
            req.output_token_ids += drafted[:accepted] + [rng.randrange(2, 256)]
            proposer.on_accepted(req, accepted)
        proposer.check_integrity()
        for req in [r for r in running if r.num_tokens >= max_len or rng.random() < 0.2]:
            proposer.release(req)
            running.remove(req)
    for req in running:
        proposer.release(req)
    assert proposer.num_free_pages == proposer.kv_pool.num_pages
    assert uneven_calls, "no call mixed requests of different proposal counts"


@pytest.fixture(scope="module")
def near_copy_dir(tiny_qwen2, tmp_path_factory):
    """The target with slightly perturbed weights: it agrees with the target for a few tokens
    at a time, so verification accepts some proposals and rejects others."""
    return save_near_copy(tiny_qwen2, tmp_path_factory.mktemp("near-copy"))


def test_greedy_verification_rounds_with_partial_acceptance(tiny_qwen2, near_copy_dir, greedy):
    """The engine's loop on the proposer alone: propose, accept the prefix that agrees with the
    target's greedy tokens plus the target's next one; every round's proposals are the draft's
    greedy continuation of the context so far, through full, partial and no acceptance."""
    proposer = make_proposer(tiny_qwen2, near_copy_dir)
    prompt, k = prompt_of(9), 4
    target = greedy(tiny_qwen2)(prompt, 40)
    req, accepted = request(0, prompt), []
    while len(req.output_token_ids) + k + 1 <= len(target):
        context = req.prompt_token_ids + req.output_token_ids
        drafted = proposer.propose([req], k)[0]
        assert drafted == greedy(near_copy_dir)(context, k)
        at, a = len(req.output_token_ids), 0
        while a < k and drafted[a] == target[at + a]:
            a += 1
        req.output_token_ids += target[at : at + a + 1]
        proposer.on_accepted(req, a)
        proposer.check_integrity()
        accepted.append(a)
    assert k in accepted and 0 in accepted and any(0 < a < k for a in accepted), accepted


def test_a_preset_draft_at_the_targets_seed_is_the_target(tiny_qwen2, greedy):
    """A config.json draft gets random weights as --config does, from the target's seed."""
    from flashlet import Engine

    config_json = str(tiny_qwen2 / "config.json")
    target_config = EngineConfig(config=config_json, page_size=PAGE_SIZE, max_num_pages=32,
                                 max_num_seqs=2)
    proposer = DraftProposer(target_config, SpeculativeConfig("draft", 4, model=config_json))
    engine = Engine(target_config)
    prompt = prompt_of(10, seed=5)
    engine.add_request(prompt, SamplingParams(max_new_tokens=4, ignore_eos=True))
    expected = []
    while engine.has_unfinished():
        expected += [t for out in engine.step() for t in out.new_token_ids]
    assert proposer.propose([request(0, prompt)], 4) == [expected]


def test_a_draft_with_a_larger_vocabulary_is_refused_naming_both_sizes(tiny_qwen2, tmp_path):
    big = save_tiny_model("llama", tmp_path / "big", vocab_size=300, hidden_size=32,
                          num_hidden_layers=1)
    with pytest.raises(ValueError, match=r"vocabulary \(300 tokens\).*target's \(256 tokens\)"):
        make_proposer(tiny_qwen2, big)


def test_a_draft_with_a_padded_smaller_vocabulary_is_taken(tiny_qwen2, tmp_path, greedy):
    """Qwen2.5-0.5B (151,936 rows) drafts for Qwen2.5-7B (152,064): one tokenizer. A target
    token past the draft's rows is fed as a stand-in; proposals stay the draft's own ids."""
    small = save_tiny_model("llama", tmp_path / "small", vocab_size=200, hidden_size=32,
                            num_hidden_layers=1)
    proposer = make_proposer(tiny_qwen2, small)
    prompt = [t % 200 for t in prompt_of(5)]
    assert proposer.propose([request(0, prompt)], 4) == [greedy(small)(prompt, 4)]
    drafted = proposer.propose([request(1, prompt + [255])], 4)[0]
    assert len(drafted) == 4 and all(0 <= t < 200 for t in drafted)


def test_the_default_pool_holds_the_targets_pages_and_k_more_a_sequence(tiny_qwen2, draft_dir):
    proposer = make_proposer(tiny_qwen2, draft_dir, k=5, max_num_pages=10, max_num_seqs=3)
    assert proposer.kv_pool.num_pages == 10 + 3 * 2


def word_tokenizer(folder, ids):
    """A word-level tokenizer saved into a model folder: token "t{i}" has id ids[i]."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": ids[i] for i in range(len(ids))}
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t0")))
    tokenizer.save_pretrained(folder)
    return tokenizer


def test_a_draft_with_another_tokenizer_is_refused(tiny_qwen2, tmp_path):
    draft = save_tiny_model("llama", tmp_path / "draft", hidden_size=32, num_hidden_layers=1)
    target_tokenizer = word_tokenizer(tmp_path / "target-tok", list(range(256)))
    word_tokenizer(draft, [1, 0] + list(range(2, 256)))  # t0 and t1 swapped
    spec = SpeculativeConfig("draft", 4, model=str(draft))
    config = EngineConfig(model=str(tiny_qwen2), max_num_pages=16)
    with pytest.raises(ValueError, match=r"2 tokens have other ids \(e.g. 't1': 0 in the draft, "
                                         r"1 in the target\)"):
        DraftProposer(config, spec, target_tokenizer=target_tokenizer)
    word_tokenizer(draft, list(range(200)))  # a subset of the target's: the same ids
    DraftProposer(config, spec, target_tokenizer=target_tokenizer)


def test_bad_settings_are_refused_by_name(tiny_qwen2, draft_dir):
    with pytest.raises(ValueError, match="needs a `model`"):
        DraftProposer(EngineConfig(model=str(tiny_qwen2)), SpeculativeConfig("draft", 4))
    proposer = make_proposer(tiny_qwen2, draft_dir)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        proposer.propose([request(0, prompt_of(4))], 0)
    with pytest.raises(ValueError, match="appears twice"):
        proposer.propose([request(0, prompt_of(4)), request(0, prompt_of(5))], 4)
    pending = request(1, prompt_of(4))
    pending.output_token_ids.append(PLACEHOLDER)
    with pytest.raises(ValueError, match="newest token"):
        proposer.propose([pending], 4)
    with pytest.raises(ValueError, match="num_accepted"):
        proposer.on_accepted(pending, -1)
    assert proposer.num_free_pages == proposer.kv_pool.num_pages


class DeviceTraffic(TorchFunctionMode):
    """Counts reads of tensors to the host (tolist, item) and host lists put onto the device
    (torch.tensor(..., device=)): on CUDA each waits for the stream (a pageable copy does too),
    so the host can no longer queue the draft's next step while the device runs this one."""

    def __init__(self):
        super().__init__()
        self.reads = self.uploads = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.Tensor.tolist, torch.Tensor.item):
            self.reads += 1
        elif func in (torch.tensor, torch.as_tensor) and kwargs.get("device") is not None:
            self.uploads += 1
        return func(*args, **kwargs)


def steady_request(proposer, k: int, accepted: int = 1) -> Request:
    """A request the draft has seen: proposed for once, `accepted` of k accepted, the target's
    token on."""
    req = request(0, prompt_of(9, seed=2))
    proposed = proposer.propose([req], k)[0]
    req.output_token_ids += proposed[:accepted] + [5]
    proposer.on_accepted(req, accepted)
    return req


def test_a_steady_propose_reads_the_device_once_and_uploads_no_host_list(tiny_qwen2, draft_dir):
    """A catch-up of one token then k - 1 decode steps, each fed on the device: the host only
    waits for the proposals, at the end."""
    proposer, k = make_proposer(tiny_qwen2, draft_dir), 4
    req = steady_request(proposer, k)
    with DeviceTraffic() as traffic:
        proposer.propose([req], k)
    assert (traffic.reads, traffic.uploads) == (1, 0)


@pytest.fixture
def fused_reference_kernels(monkeypatch):
    use_fused_reference_kernels(monkeypatch)


def use_fused_reference_kernels(monkeypatch):
    """The fused decode path on the CPU with each GEMV its fp32 reference (test_fused_decode),
    and auto turning it on as on a GPU."""
    from tests.test_fused_decode import ReferenceGemv

    monkeypatch.setattr(fused_decode, "CuteGemv", ReferenceGemv)
    monkeypatch.setattr(fused_decode, "cute_available", lambda: (True, ""))
    monkeypatch.setattr(fused_decode, "check_fused_decode", lambda *a, **kw: None)
    monkeypatch.setattr(fused_decode, "auto_declines", lambda *a, **kw: None)


@pytest.mark.parametrize("accepted", [1, 3])
def test_the_drafts_steps_run_on_the_fused_path(tiny_qwen2, fused_reference_kernels, greedy, accepted):
    """Where the fused path applies every step of a steady propose takes the LM head's argmax
    on it: its catch-up (the target's token, after d3 when all 3 were accepted: two decode
    rows) and its k - 1 decodes; the proposals are the draft's greedy tokens."""
    proposer, k = make_proposer(tiny_qwen2, tiny_qwen2), 3
    assert proposer.runner.fused is not None
    req = steady_request(proposer, k, accepted)
    fused_steps, greedy_tokens = [0], proposer.runner.greedy_tokens

    def counted(*args):
        tokens = greedy_tokens(*args)
        fused_steps[0] += tokens is not None
        return tokens

    proposer.runner.greedy_tokens = counted
    context = req.prompt_token_ids + req.output_token_ids
    assert proposer.propose([req], k) == [greedy(tiny_qwen2)(context, k)]
    assert fused_steps[0] == k
    proposer.check_integrity()


def test_the_draft_follows_the_targets_fused_decode_setting():
    """On where the target's is (auto: the draft's shape decides), off where it is off; the
    draft's runner has one device."""
    target = EngineConfig(fused_decode=True, speculative_config={"model": "x", "num_speculative_tokens": 4})
    draft = draft_runner_config(target)
    assert (draft.fused_decode, draft.tensor_parallel_size) == (None, 1)
    assert draft.speculative_config.num_speculative_tokens == 1  # rows for 2-token catch-ups
    assert draft_runner_config(target.replace(fused_decode=False)).fused_decode is False
    tp = draft_runner_config(EngineConfig(tensor_parallel_size=2))
    assert tp.tensor_parallel_size == 1
