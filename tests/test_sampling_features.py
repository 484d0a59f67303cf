"""Sampling features through LLM.generate on tiny random models: logprobs, n samples sharing
the prompt's pages, penalties, stop_token_ids, min_tokens, structured output (json_schema and a
named tool call, with a real tokenizer), bad parameters."""

import json
import shutil

import pytest

from flashlet import LLM, SamplingParams
from flashlet.core.request_check import RequestError
from flashlet.text.structured import tool_call_format

from tests.conftest import save_tiny_model

PROMPT = [5, 6, 7, 8, 9, 10, 11]


@pytest.fixture(scope="module")
def llm(tiny_qwen2):
    return LLM(str(tiny_qwen2))


@pytest.fixture(scope="module")
def tokenizer_llm(tmp_path_factory, demo_model_dir):
    """A tiny random Llama with the demo model's tokenizer (49152 tokens): a real vocabulary
    for grammars, at the speed of a tiny model."""
    folder = save_tiny_model("llama", tmp_path_factory.mktemp("tiny-tok"), vocab_size=49152)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(demo_model_dir / name, folder / name)
    return LLM(str(folder))


def greedy(llm, prompt=PROMPT, n=24, **kwargs):
    return llm.generate([prompt], SamplingParams(max_new_tokens=n, ignore_eos=True, **kwargs))[0]


def test_logprobs_one_per_token_and_the_greedy_token_is_top_1(llm):
    plain = greedy(llm)
    out = greedy(llm, logprobs=3)
    assert out.token_ids == plain.token_ids  # asking for logprobs changes no token
    assert len(out.logprobs) == len(out.token_ids)
    for token, lp in zip(out.token_ids, out.logprobs):
        assert lp.token_id == token and len(lp.top) == 3
        assert lp.top[0][0] == token and lp.top[0][1] == pytest.approx(lp.logprob)
        assert lp.top[0][1] >= lp.top[1][1] >= lp.top[2][1] and lp.logprob <= 0
    assert out.cumulative_logprob == pytest.approx(sum(lp.logprob for lp in out.logprobs))


def test_streamed_deltas_carry_their_tokens_logprobs(llm):
    engine = llm.engine
    rid = engine.add_request(PROMPT, SamplingParams(max_new_tokens=6, temperature=1.0, seed=3,
                                                    logprobs=0, ignore_eos=True))
    deltas, final = [], None
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == rid:
                deltas += out.new_logprobs or []
                final = out
    assert [lp.token_id for lp in deltas] == final.token_ids
    assert all(lp.top == [] for lp in deltas)


def test_n_samples_are_distinct_and_share_the_prompts_pages(llm):
    prompt = list(range(2, 42))  # 40 tokens: two full pages of 16 to share
    outs = llm.generate([prompt, [3, 4, 5]], SamplingParams(max_new_tokens=12, temperature=1.0,
                                                            n=3, ignore_eos=True))
    assert len(outs) == 6
    samples = [tuple(o.token_ids) for o in outs[:3]]
    assert len(set(samples)) == 3
    # The first sample computed the prompt; the other two adopted its two full pages.
    assert [o.num_cached_tokens for o in outs[1:3]] == [32, 32]
    assert all(o.prompt_token_ids == prompt for o in outs[:3])
    stats = llm.engine.stats()
    assert stats["kv_pages_used"] == stats["kv_pages_cached"]  # nothing leaked


def test_seeded_n_samples_reproduce(llm):
    params = SamplingParams(max_new_tokens=8, temperature=1.0, n=2, seed=11, ignore_eos=True)
    a = [o.token_ids for o in llm.generate([PROMPT], params)]
    b = [o.token_ids for o in llm.generate([PROMPT], params)]
    assert a == b and a[0] != a[1]


def test_best_of_keeps_the_most_likely_samples(llm):
    outs = llm.generate([PROMPT], SamplingParams(max_new_tokens=6, temperature=1.0, n=2,
                                                 best_of=5, seed=1, ignore_eos=True))
    assert len(outs) == 2 and all(o.logprobs is None for o in outs)
    ranked = llm.generate([PROMPT], SamplingParams(max_new_tokens=6, temperature=1.0, n=5,
                                                   seed=1, logprobs=0, ignore_eos=True))
    best = sorted(ranked, key=lambda o: o.cumulative_logprob, reverse=True)[:2]
    assert [o.token_ids for o in outs] == [o.token_ids for o in best]


def most_repeated(tokens):
    return max(tokens.count(t) for t in set(tokens))


def test_penalties_change_a_repetitive_greedy_output(llm):
    plain = greedy(llm, n=40).token_ids
    assert most_repeated(plain) >= 4  # the tiny model loops: the case penalties are for
    for kwargs in (dict(repetition_penalty=1.8), dict(frequency_penalty=1.5),
                   dict(presence_penalty=2.0)):
        tokens = greedy(llm, n=40, **kwargs).token_ids
        assert tokens != plain and most_repeated(tokens) < most_repeated(plain), kwargs


def test_stop_token_ids_end_the_request_and_keep_the_token(llm):
    plain = greedy(llm).token_ids
    stop = plain[3]
    first = plain.index(stop)
    out = greedy(llm, stop_token_ids=[stop])
    assert out.finish_reason == "stop" and out.token_ids == plain[: first + 1]


def test_min_tokens_holds_back_stop_token_ids(llm):
    plain = greedy(llm).token_ids
    stop = plain[0]
    out = greedy(llm, stop_token_ids=[stop], min_tokens=5)
    assert stop not in out.token_ids[:5]
    assert len(out.token_ids) >= 5


def test_logit_bias_forces_bans_and_leaves_the_rest(llm):
    """OpenAI's logit_bias: +100 on a token makes greedy (and sampling) pick it every time, -100
    on the greedy output's tokens keeps them out; a bias on a token the output never nears
    changes nothing; logprobs stay the model's own (raw), as vLLM's."""
    plain = greedy(llm, logprobs=0)
    forced = greedy(llm, logit_bias={42: 100.0})
    assert forced.token_ids == [42] * 24
    sampled = llm.generate([PROMPT], SamplingParams(max_new_tokens=24, ignore_eos=True, temperature=1.0, seed=3,
                                                    logit_bias={42: 100.0}))[0]
    assert sampled.token_ids == [42] * 24
    banned = set(plain.token_ids)
    avoided = greedy(llm, logit_bias={t: -100.0 for t in banned})
    assert not banned & set(avoided.token_ids)
    unused = next(t for t in range(2, 256) if t not in banned)
    assert greedy(llm, logit_bias={unused: -100.0}).token_ids == plain.token_ids  # a token never picked
    with_bias = greedy(llm, n=1, logit_bias={42: 100.0}, logprobs=0)
    scored = llm.generate([PROMPT + [42]], SamplingParams(max_new_tokens=1, prompt_logprobs=0))[0]
    assert with_bias.logprobs[0].logprob == pytest.approx(scored.prompt_logprobs[-1].logprob, abs=1e-4)
    assert with_bias.logprobs[0].logprob < -1  # the model's own, not the biased distribution's ~0


def test_logit_bias_is_checked(llm):
    for bad in ({5: 101.0}, {-1: 1.0}, {5: float("nan")}, {"5": 1.0}, [5]):
        with pytest.raises(ValueError, match="logit_bias"):
            SamplingParams(logit_bias=bad)
    with pytest.raises(ValueError, match="logit_bias: token id 999999 is not in the vocabulary"):
        greedy(llm, logit_bias={999999: 1.0})
    stats = llm.engine.stats()  # nothing queued (a step of an earlier call may still be in flight)
    assert stats["waiting"] == 0 and stats["running"] == 0


def test_temperatures_too_small_for_fp32_are_greedy(llm):
    """A temperature under GREEDY_TEMPERATURE (vLLM's 1e-5) is greedy: divided into the logits
    in fp32, 1e-40 overflowed them to inf and 5e-324 rounded to 0, and the NaN of their softmax
    drew token 0 every step. At the threshold itself the row still samples."""
    from flashlet.core.sampling import GREEDY_TEMPERATURE

    plain = greedy(llm).token_ids
    for temperature in (5e-324, 1e-40, GREEDY_TEMPERATURE / 2):
        assert SamplingParams(temperature=temperature).is_greedy
        assert greedy(llm, temperature=temperature).token_ids == plain
    assert not SamplingParams(temperature=GREEDY_TEMPERATURE).is_greedy
    out = greedy(llm, temperature=GREEDY_TEMPERATURE, seed=1)
    assert len(set(out.token_ids)) > 1  # not the NaN row's token 0 every step


def test_bad_sampling_parameters_are_clear_value_errors(llm):
    for kwargs, word in [(dict(min_p=1.5), "min_p"), (dict(presence_penalty=3), "presence"),
                         (dict(repetition_penalty=0), "repetition"), (dict(n=0), "n must"),
                         # fp32 makes 5e-324 a 0 (-inf x 0 = NaN) and 1e-40 overflows a logit
                         (dict(repetition_penalty=5e-324), "repetition"),
                         (dict(repetition_penalty=1e-40), "repetition"),
                         (dict(repetition_penalty=101), "repetition"),
                         (dict(temperature=1e300), "temperature"),  # inf in fp32: -inf / inf = NaN
                         (dict(n=3, best_of=2), "best_of"), (dict(logprobs=21), "logprobs"),
                         (dict(min_tokens=100, max_new_tokens=10), "min_tokens"),
                         (dict(stop_token_ids=[-1]), "stop_token_ids"),
                         (dict(response_format={"type": "xml"}), "response_format"),
                         (dict(response_format={"type": "json_schema"}), "json_schema")]:
        with pytest.raises(ValueError, match=word):
            SamplingParams(**kwargs)
    with pytest.raises(ValueError, match="vocabulary"):
        llm.generate([PROMPT], SamplingParams(stop_token_ids=[10**6]))
    with pytest.raises(ValueError, match="tokenizer"):  # this tiny model has none
        llm.generate([PROMPT], SamplingParams(response_format={"type": "json_object"}))


PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 8},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "tags": {"type": "array", "maxItems": 2,
                                  "items": {"enum": ["red", "blue"]}}}}


def test_a_stop_string_keeps_the_logprobs_and_the_best_of_ranking(tokenizer_llm):
    """A sample that a stop string ends keeps its logprobs and its prompt's (they were lost
    with the stop: None), so best_of ranks it by its own cumulative logprob (None had ranked
    it as 0.0, above every other sample)."""
    params = dict(max_new_tokens=8, temperature=1.0, seed=3, ignore_eos=True)
    free = tokenizer_llm.generate(["a b c"], SamplingParams(n=5, **params))
    stop = next(o.text[1:3] for o in free if len(o.text.strip()) >= 3)  # in that sample at least
    ranked = tokenizer_llm.generate(["a b c"], SamplingParams(n=5, logprobs=0, prompt_logprobs=0,
                                                              stop=[stop], **params))
    assert any(o.finish_reason == "stop" and len(o.token_ids) < 8 for o in ranked), ranked
    for o in ranked:
        assert o.logprobs is not None and len(o.logprobs) == len(o.token_ids), o
        assert o.prompt_logprobs is not None and len(o.prompt_logprobs) == len(ranked[0].prompt_token_ids)
    outs = tokenizer_llm.generate(["a b c"], SamplingParams(n=2, best_of=5, stop=[stop], **params))
    best = sorted(ranked, key=lambda o: o.cumulative_logprob, reverse=True)[:2]
    assert [o.token_ids for o in outs] == [o.token_ids for o in best]


def check_person(obj):
    assert set(obj) == {"name", "age", "tags"}
    assert isinstance(obj["name"], str) and len(obj["name"]) <= 8
    assert isinstance(obj["age"], int) and 0 <= obj["age"] <= 120
    assert len(obj["tags"]) <= 2 and all(t in ("red", "blue") for t in obj["tags"])


@pytest.mark.slow
def test_json_schema_output_parses_and_validates(tokenizer_llm):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    free = tokenizer_llm.generate(["A person:"], SamplingParams(max_new_tokens=20))[0]
    with pytest.raises(ValueError):  # the random model left alone writes no JSON
        json.loads(free.text)
    outs = tokenizer_llm.generate(["A person:", "Someone else:"], SamplingParams(
        max_new_tokens=60, temperature=1.0, seed=5, response_format=fmt))
    for out in outs:
        assert out.finish_reason == "stop", out.text
        check_person(json.loads(out.text))
    structured = tokenizer_llm.engine.structured
    before = structured.num_compiled
    tokenizer_llm.generate(["Again:"], SamplingParams(max_new_tokens=60, response_format=fmt))
    assert structured.num_compiled == before  # compiled once, cached by schema


def test_constrained_and_free_requests_share_a_batch(tokenizer_llm):
    """A constrained request turns overlap off while it runs; a free one beside it still gets
    exactly the tokens it gets alone."""
    fmt = {"type": "json_schema", "json_schema": {"schema": PERSON}}
    alone = tokenizer_llm.generate(["Hello"], SamplingParams(max_new_tokens=12, ignore_eos=True))
    engine = tokenizer_llm.engine
    free = engine.add_request("Hello", SamplingParams(max_new_tokens=12, ignore_eos=True))
    constrained = engine.add_request("A person:", SamplingParams(max_new_tokens=60,
                                                                 response_format=fmt))
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert done[free].token_ids == alone[0].token_ids
    check_person(json.loads(tokenizer_llm.tokenizer.decode(done[constrained].token_ids[:-1])))


def test_named_tool_call_has_valid_json_arguments(tokenizer_llm):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "required": ["city"], "additionalProperties": False,
        "properties": {"city": {"type": "string", "maxLength": 10}}}}}]
    fmt = tool_call_format(tools, {"type": "function", "function": {"name": "get_weather"}})
    out = tokenizer_llm.generate(["Weather in Paris?"], SamplingParams(
        max_new_tokens=60, response_format=fmt))[0]
    assert out.text.startswith('<tool_call>\n{"name": "get_weather", "arguments": ')
    assert out.text.rstrip().endswith("</tool_call>"), out.text
    call = json.loads(out.text.removeprefix("<tool_call>").strip().removesuffix("</tool_call>"))
    assert call["name"] == "get_weather" and isinstance(call["arguments"]["city"], str)


def test_required_tool_choice_ends_after_the_calls(tokenizer_llm):
    """Issue 33: the call list is the whole output, so the request ends on EOS right after it
    (it used to allow free text after the call, run to max_new_tokens on "length")."""
    tools = [{"type": "function", "function": {"name": name, "parameters": {
        "type": "object", "required": ["city"], "additionalProperties": False,
        "properties": {"city": {"type": "string", "maxLength": 10}}}}}
        for name in ("get_weather", "get_time")]
    fmt = tool_call_format(tools, "required")
    out = tokenizer_llm.generate(["Weather in Paris?"], SamplingParams(
        max_new_tokens=200, response_format=fmt))[0]
    assert out.finish_reason == "stop", out.text
    assert out.token_ids[-1] in tokenizer_llm.engine.eos_token_ids
    calls = [json.loads(block.strip().removesuffix("</tool_call>"))
             for block in out.text.strip().split("<tool_call>")[1:]]
    assert calls and out.text.startswith("<tool_call>\n")
    assert out.text.rstrip().endswith("</tool_call>")
    assert all(c["name"] in ("get_weather", "get_time") for c in calls)


def test_required_tool_choice_without_parallel_calls_makes_exactly_one(tokenizer_llm):
    """OpenAI's parallel_tool_calls: false under "required": the grammar ends after one call,
    so the output is that call and EOS."""
    tools = [{"type": "function", "function": {"name": name, "parameters": {
        "type": "object", "required": ["city"], "additionalProperties": False,
        "properties": {"city": {"type": "string", "maxLength": 10}}}}}
        for name in ("get_weather", "get_time")]
    one = tool_call_format(tools, "required", parallel=False)
    assert one["format"]["stop_after_first"] and not tool_call_format(tools, "required")["format"]["stop_after_first"]
    for prompt in ("Weather and time in Paris and in Rome?", "Tell me everything about Oslo."):
        out = tokenizer_llm.generate([prompt], SamplingParams(max_new_tokens=200, response_format=one))[0]
        assert out.finish_reason == "stop" and out.token_ids[-1] in tokenizer_llm.engine.eos_token_ids, out.text
        assert out.text.count("<tool_call>") == 1 and out.text.rstrip().endswith("</tool_call>"), out.text


def test_invalid_schemas_and_tools_are_clear_value_errors(tokenizer_llm):
    bad = {"type": "json_schema", "json_schema": {"schema": {"type": "no-such-type"}}}
    with pytest.raises(ValueError, match="invalid json_schema"):
        tokenizer_llm.generate(["x"], SamplingParams(response_format=bad))
    with pytest.raises(ValueError, match="invalid grammar"):
        tokenizer_llm.generate(["x"], SamplingParams(
            response_format={"type": "grammar", "grammar": "root ::= (("}))
    with pytest.raises(ValueError, match="tool_choice"):
        tool_call_format([], "auto")
    with pytest.raises(ValueError, match="ignore_eos"):
        tokenizer_llm.generate(["x"], SamplingParams(ignore_eos=True,
                                                     response_format={"type": "json_object"}))
    assert tokenizer_llm.engine.stats()["requests"] == 0


@pytest.mark.parametrize("speculative", [False, True])
def test_min_tokens_gives_way_where_the_response_format_can_only_end(tokenizer_llm, speculative):
    """A grammar whose output is complete allows nothing but EOS: there min_tokens' ban would
    leave no token at all, so the response format's end wins and the request stops short of
    min_tokens (it failed with "token 0 does not fit the response format", the server's 500,
    found by a long fuzz run). Where the grammar allows more, min_tokens still holds EOS back.
    With speculation too: its verify rows take the same rule."""
    llm = tokenizer_llm
    if speculative:
        llm = LLM(llm.engine.model_dir, speculative_config={
            "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2,
            "prompt_lookup_min": 1})
    eos = llm.engine.eos_token_ids
    one = {"type": "structural_tag", "format": {"type": "regex", "pattern": "7"}}
    out = llm.generate(["7 7 7 7 7"], SamplingParams(max_new_tokens=8, min_tokens=4, response_format=one))[0]
    assert out.error is None and out.finish_reason == "stop", out
    assert out.text == "7" and out.token_ids[-1] in eos
    digits = {"type": "structural_tag", "format": {"type": "regex", "pattern": "[0-9 ]{1,40}"}}
    out = llm.generate(["1 2 3 1 2 3"], SamplingParams(max_new_tokens=12, min_tokens=6,
                                                      response_format=digits))[0]
    assert out.error is None and len(out.token_ids) >= 6, out
    assert not set(out.token_ids[:6]) & set(eos)
    assert set(out.text) <= set("0123456789 ")
    llm.engine.check_integrity()


@pytest.mark.parametrize("speculative", [False, True])
def test_a_format_that_no_token_can_write_is_refused_or_ends_with_its_error(tokenizer_llm, speculative):
    """The demo tokenizer has no token for the UTF-8 lead byte 0xF1, so nothing can write U+40000:
    a format that begins with it is refused at once (its first mask is empty), and one that
    reaches it ends its request there with the request's own error (RequestError: a 400 through
    the server), not "token 0 does not fit" from a draw over no token. With speculation too: a
    verify row's refused token is judged the same way."""
    from flashlet.text.structured import DEAD_END

    llm = tokenizer_llm
    if speculative:
        llm = LLM(llm.engine.model_dir, speculative_config={
            "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2,
            "prompt_lookup_min": 1})
    start = {"type": "structural_tag", "format": {"type": "regex", "pattern": "\U00040000"}}
    with pytest.raises(RequestError, match="can begin") as refused:
        llm.generate(["a a a a"], SamplingParams(max_new_tokens=4, response_format=start))
    assert refused.value.param == "response_format"
    later = {"type": "structural_tag", "format": {"type": "regex", "pattern": "a\U00040000"}}
    out = llm.generate(["a a a a"], SamplingParams(max_new_tokens=6, response_format=later))[0]
    assert out.finish_reason == "error" and out.error == DEAD_END.format("continue"), out
    assert out.error_param == "response_format" and out.text == "a"
    llm.engine.check_integrity()


def test_ban_early_stops_keeps_the_stop_ids_only_of_a_row_left_with_nothing():
    """The rule itself, on the device-free path: a row whose only finite logits are the banned
    ids keeps them; a row with another finite logit loses them."""
    import torch

    from flashlet.runner.sampler import ban_early_stops

    inf = float("-inf")
    logits = torch.tensor([[inf, 1.0, inf, 2.0],   # only ids 1 and 3: both banned below
                           [0.5, 1.0, inf, 2.0],   # id 0 stays: the ban holds
                           [inf, 1.0, inf, 2.0]])  # only id 1 banned: id 3 stays
    ban_early_stops(logits, torch.tensor([0, 0, 1, 1, 2]), torch.tensor([1, 3, 1, 3, 1]))
    assert logits.tolist() == [[inf, 1.0, inf, 2.0], [0.5, inf, inf, inf], [inf, inf, inf, 2.0]]


def test_grammar_mask_leaves_exactly_the_allowed_tokens(tokenizer_llm):
    """apply_grammar_masks against a direct reading of the matcher: a row with a grammar keeps
    the tokens its grammar allows next (and only those), a free row keeps everything."""
    import torch
    import xgrammar as xgr

    from flashlet.core.request import Request
    from flashlet.text.structured import apply_grammar_masks

    structured = tokenizer_llm.engine.structured
    fmt = {"type": "grammar", "grammar": 'root ::= "yes" | "no"'}
    params = SamplingParams(response_format=fmt)
    constrained = Request(0, [1], params)
    constrained.grammar = structured.matcher(fmt)
    free = Request(1, [1], SamplingParams())
    logits = torch.randn(2, 49152, generator=torch.Generator().manual_seed(0))
    masked = logits.clone()
    apply_grammar_masks(masked, [free, constrained], {})
    assert torch.equal(masked[0], logits[0])
    allowed = masked[1].isfinite().nonzero().flatten().tolist()
    texts = {tokenizer_llm.tokenizer.decode([t]) for t in allowed}
    assert allowed and all("yes".startswith(t) or "no".startswith(t) for t in texts), texts
    reference = xgr.allocate_token_bitmask(1, 49152)
    structured.matcher(fmt).fill_next_token_bitmask(reference, 0)
    bits = [(int(reference[0, t // 32]) >> (t % 32)) & 1 for t in range(49152)]
    assert allowed == [t for t, bit in enumerate(bits) if bit]


def test_penalised_requests_reusing_rows_sample_as_alone(tiny_qwen2):
    """Penalty state lives in the runner's batch rows: a request that takes the row another
    left starts afresh (nothing released by hand), so each of six penalised requests through
    two rows gives the tokens it gives alone, and the state never outgrows the rows."""
    from flashlet import Engine, EngineConfig

    def engine():
        return Engine(EngineConfig(model=str(tiny_qwen2), max_num_seqs=2))

    kinds = (dict(repetition_penalty=1.8), dict(frequency_penalty=1.5),
             dict(presence_penalty=2.0))
    requests = [(PROMPT[i:] + PROMPT[:i], SamplingParams(max_new_tokens=8 + i, ignore_eos=True,
                                                         **kinds[i % 3])) for i in range(6)]
    shared = engine()
    ids = [shared.add_request(prompt, params) for prompt, params in requests]
    done = {}
    while shared.has_unfinished():
        done.update((out.request_id, out.token_ids) for out in shared.step() if out.finished)
    assert set(shared.sampler.row_owner) <= {0, 1}
    for rid, (prompt, params) in zip(ids, requests):
        alone = engine()
        alone.add_request(prompt, params)
        tokens = None
        while alone.has_unfinished():
            tokens = next((o.token_ids for o in alone.step() if o.finished), tokens)
        assert done[rid] == tokens, rid
