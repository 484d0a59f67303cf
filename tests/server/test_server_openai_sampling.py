"""Sampling features through the OpenAI API (the official `openai` client): logprobs, n and best_of,
penalties, structured output, tool calls, echo and prompt lists, stream usage, and the 400s
for what does not go together."""

from __future__ import annotations

import collections
import json
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from server_helpers import MODEL_NAME, parse_sse

openai = pytest.importorskip("openai", reason="the openai client is not installed")
jsonschema_rs = pytest.importorskip("jsonschema_rs", reason="jsonschema-rs is not installed")
pytestmark = pytest.mark.slow

MESSAGES = [{"role": "user", "content": "Name three colors."}]
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120}}}
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city"],
                   "properties": {"city": {"type": "string", "maxLength": 20}}}}}


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                         timeout=300)


def chat(client, **kwargs):
    kwargs.setdefault("messages", MESSAGES)
    return client.chat.completions.create(model=MODEL_NAME, **kwargs)


def concurrently(*calls):
    """Each call's result, in order; the requests run side by side, so their decode steps are
    shared (on the CPU a step of several rows costs about what one row's does)."""
    with ThreadPoolExecutor(len(calls)) as pool:
        return [f.result() for f in [pool.submit(call) for call in calls]]


def test_chat_logprobs_one_per_token_greedy_is_top1(client, idle):
    r = chat(client, max_tokens=8, temperature=0, logprobs=True, top_logprobs=3)
    entries = r.choices[0].logprobs.content
    assert len(entries) == r.usage.completion_tokens == 8
    assert "".join(e.token for e in entries) == r.choices[0].message.content
    for e in entries:
        assert len(e.top_logprobs) == 3
        assert e.top_logprobs[0].token == e.token  # greedy: the sampled token is the top one
        assert e.top_logprobs[0].logprob == pytest.approx(e.logprob)
        assert e.logprob <= 0 and e.bytes == list(e.token.encode())
        assert [t.logprob for t in e.top_logprobs] == sorted(
            (t.logprob for t in e.top_logprobs), reverse=True)


def test_completion_logprobs_and_stream(client, idle):
    r = client.completions.create(model=MODEL_NAME, prompt="The sky is", max_tokens=6,
                                  temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert max(top.values()) == pytest.approx(logprob) and token in top
    # Streamed: the same tokens and logprobs, chunk by chunk.
    chunks = list(client.completions.create(model=MODEL_NAME, prompt="The sky is", max_tokens=6,
                                            temperature=0, logprobs=2, stream=True))
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs
                for t in c.choices[0].logprobs.token_logprobs]
    assert streamed == pytest.approx(lp.token_logprobs)


def test_n_samples_are_distinct_and_share_the_prompt(client, idle):
    r = chat(client, max_tokens=8, temperature=1.0, n=3, seed=7,
             messages=[{"role": "user", "content": "Write a random word: " + "x" * 40}])
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert len({c.message.content for c in r.choices}) == 3
    assert 3 <= r.usage.completion_tokens <= 24  # summed over the choices
    # A new prompt: the two later samples found the first one's prompt pages in the cache.
    assert r.usage.prompt_tokens_details.cached_tokens >= 32
    # Seeded samples reproduce.
    again = chat(client, max_tokens=8, temperature=1.0, n=3, seed=7,
                 messages=[{"role": "user", "content": "Write a random word: " + "x" * 40}])
    assert [c.message.content for c in again.choices] == [c.message.content for c in r.choices]


def test_logit_bias_forces_a_token_and_bad_entries_are_named(server, client, idle):
    """OpenAI's logit_bias ({token id as a string: bias}): +100 on a token makes every output
    token that token; a key that is no token id, a bias past 100 and an id past the vocabulary
    are each a 400 naming logit_bias."""
    tok = httpx.post(server.url + "/tokenize", json={"prompt": " yes"}, timeout=60).json()["tokens"][-1]
    r = client.completions.create(model=MODEL_NAME, prompt="Answer:", max_tokens=4, temperature=0,
                                  logit_bias={str(tok): 100})
    assert r.choices[0].text == " yes" * 4
    r = chat(client, max_tokens=3, temperature=1.0, logit_bias={str(tok): 100},
             messages=[{"role": "user", "content": "Say no."}])
    assert r.choices[0].message.content.replace(" ", "") == "yes" * 3
    for bad in ({"abc": 1}, {str(tok): 101}, {"99999999": 1}):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=1, logit_bias=bad)
        assert e.value.body["param"].startswith("logit_bias"), e.value.body


def test_a_seed_past_64_bits_samples_and_reproduces(client, idle):
    """OpenAI's seed is any integer; the server takes it modulo 2**64 before the engine sees it
    (the Python API's SamplingParams now does the same in the torch sampler: test_bad_input)."""
    texts = [chat(client, max_tokens=6, temperature=1.0, seed=2**70 + 5,
                  messages=[{"role": "user", "content": "Say anything."}]).choices[0].message.content
             for _ in range(2)]
    assert texts[0] and texts[0] == texts[1]


def test_n_streamed_with_choice_index_and_usage(client, idle):
    chunks = list(chat(client, max_tokens=5, temperature=0, n=2, stream=True,
                       stream_options={"include_usage": True}))
    text = collections.defaultdict(str)
    finished = {}
    for c in chunks[:-1]:
        assert c.usage is None and len(c.choices) == 1
        choice = c.choices[0]
        text[choice.index] += choice.delta.content or ""
        if choice.finish_reason:
            finished[choice.index] = choice.finish_reason
    assert finished == {0: "length", 1: "length"}
    assert text[0] == text[1]  # greedy
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10


def test_best_of_keeps_the_most_likely(client, idle):
    r = client.completions.create(model=MODEL_NAME, prompt="Once upon a time", max_tokens=6,
                                  temperature=1.0, n=1, best_of=4, seed=3, logprobs=0)
    assert len(r.choices) == 1
    best = sum(r.choices[0].logprobs.token_logprobs)
    samples = client.completions.create(model=MODEL_NAME, prompt="Once upon a time",
                                        max_tokens=6, temperature=1.0, n=4, seed=3, logprobs=0)
    sums = [sum(c.logprobs.token_logprobs) for c in samples.choices]
    assert best == pytest.approx(max(sums))
    assert r.usage.completion_tokens == 24  # every sample counts


def test_penalties_change_a_repetitive_output(client, idle):
    prompt = "I like cats. I like cats. I like cats. I like cats."
    penalties = ({"frequency_penalty": 2.0}, {"presence_penalty": 2.0},
                 {"extra_body": {"repetition_penalty": 3.0}})
    plain, *penalized = concurrently(*[
        lambda kwargs=kwargs: client.completions.create(model=MODEL_NAME, prompt=prompt,
                                                        max_tokens=12, temperature=0, **kwargs)
        for kwargs in ({}, *penalties)])
    most = collections.Counter(plain.choices[0].text.split()).most_common(1)[0][1]
    assert most >= 3  # the model repeats itself
    for kwargs, r in zip(penalties, penalized):
        assert r.choices[0].text != plain.choices[0].text, kwargs
        words = collections.Counter(r.choices[0].text.split())
        assert not words or words.most_common(1)[0][1] < most, (kwargs, r.choices[0].text)


def test_min_tokens_min_p_and_stop_token_ids(client, engine_loop, idle):
    eos = engine_loop.tokenizer.eos_token_id
    r = chat(client, max_tokens=12, temperature=0,
             extra_body={"min_tokens": 12, "min_p": 0.1, "stop_token_ids": [eos]})
    assert r.usage.completion_tokens == 12 and r.choices[0].finish_reason == "length"
    first = client.completions.create(model=MODEL_NAME, prompt="The sky is", max_tokens=4,
                                      temperature=0, logprobs=0)
    stop_id = engine_loop.tokenizer.convert_tokens_to_ids(
        engine_loop.tokenizer.tokenize(first.choices[0].logprobs.tokens[1])[0])
    stopped = client.completions.create(model=MODEL_NAME, prompt="The sky is", max_tokens=4,
                                        temperature=0, extra_body={"stop_token_ids": [stop_id]})
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.usage.completion_tokens == 2  # the stop token is kept


def test_json_schema_output_parses_and_validates(client, idle):
    # The demo model opens the object and does not close it in 60 tokens (what this asked
    # before) either: a few tokens show the grammar applies; a closed one must be valid JSON.
    person, free = concurrently(
        lambda: chat(client, max_tokens=60, temperature=0,
                     messages=[{"role": "user", "content": "Describe a person as JSON."}],
                     response_format={"type": "json_schema",
                                      "json_schema": {"name": "person", "schema": PERSON}}),
        lambda: chat(client, max_tokens=12, temperature=0, response_format={"type": "json_object"},
                     messages=[{"role": "user", "content": "Give me a JSON object."}]))
    assert person.choices[0].finish_reason == "stop"
    value = json.loads(person.choices[0].message.content)
    jsonschema_rs.validate(PERSON, value)
    content = free.choices[0].message.content
    assert content.startswith("{")  # a small model may not close a free-form object in time
    if free.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(content), dict)


def test_vllm_structured_outputs_guide_chat_and_completions(client, idle):
    """vLLM's guided_choice / guided_regex / guided_json / guided_grammar (extra_body) and its
    newer structured_outputs hold the output, on both endpoints, as its clients send them."""
    choices = ["positive", "negative", "neutral"]
    calls = [
        lambda: chat(client, max_tokens=8, temperature=0, extra_body={"guided_choice": choices}),
        lambda: client.completions.create(model=MODEL_NAME, prompt="Sentiment of 'great day':", max_tokens=8,
                                          temperature=0, extra_body={"structured_outputs": {"choice": choices}}),
        lambda: chat(client, max_tokens=12, temperature=0, extra_body={"guided_regex": "[0-9]{3}-[0-9]{4}"}),
        lambda: chat(client, max_tokens=60, temperature=0,
                     extra_body={"guided_json": json.dumps(PERSON)}),  # the schema as JSON text
        lambda: client.completions.create(model=MODEL_NAME, prompt="Answer:", max_tokens=6, temperature=0,
                                          extra_body={"guided_grammar": 'root ::= "yes" | "no"'})]
    choice, choice_completion, regex, person, grammar = concurrently(*calls)
    assert choice.choices[0].message.content in choices and choice.choices[0].finish_reason == "stop"
    assert choice_completion.choices[0].text in choices
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", regex.choices[0].message.content)
    jsonschema_rs.validate(PERSON, json.loads(person.choices[0].message.content))
    assert grammar.choices[0].text in ("yes", "no")
    for extra, word in [({"guided_regex": "a{5000}"}, "max-pattern-size"),
                        ({"guided_choice": ["a"], "guided_regex": "b"}, "one structured-output constraint"),
                        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "exactly one")]:
        with pytest.raises(openai.BadRequestError, match=word):
            chat(client, max_tokens=4, extra_body=extra)
    # No token of the demo model's vocabulary spells U+40000 (no token for the UTF-8 byte 0xF1):
    # refused at once where the format must begin with it, and a 400 naming response_format
    # where an output reaches it (both were 500s: a long fuzz run found them)
    for extra, word in [({"guided_regex": "\U00040000"}, "can begin"),
                        ({"guided_regex": "a\U00040000"}, "can continue")]:
        with pytest.raises(openai.BadRequestError, match=word) as e:
            chat(client, max_tokens=4, extra_body=extra)
        assert e.value.body["param"] == "response_format"


def test_vllm_text_options_keep_the_stop_string_and_special_tokens(client, idle):
    """vLLM's include_stop_str_in_output and skip_special_tokens: the same tokens, the text
    made as asked (the EOS's text, and its logprob entry, with skip_special_tokens false)."""
    ask = [{"role": "user", "content": "What is the capital of France?"}]
    plain, kept = concurrently(
        lambda: chat(client, messages=ask, max_tokens=24, temperature=0, logprobs=True),
        lambda: chat(client, messages=ask, max_tokens=24, temperature=0, logprobs=True,
                     extra_body={"skip_special_tokens": False}))
    assert plain.choices[0].finish_reason == "stop"
    assert kept.choices[0].message.content == plain.choices[0].message.content + "<|im_end|>"
    tokens = [e.token for e in kept.choices[0].logprobs.content]
    assert "".join(tokens) == kept.choices[0].message.content and tokens[-1] == "<|im_end|>"
    word = plain.choices[0].message.content.split()[1]
    cut, with_stop = concurrently(
        lambda: chat(client, messages=ask, max_tokens=24, temperature=0, stop=[word]),
        lambda: chat(client, messages=ask, max_tokens=24, temperature=0, stop=[word],
                     extra_body={"include_stop_str_in_output": True}))
    assert with_stop.choices[0].message.content == cut.choices[0].message.content + word


def test_named_tool_call_has_valid_arguments(client, idle):
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    named = dict(max_tokens=80, temperature=0, messages=messages, tools=[WEATHER_TOOL],
                 tool_choice={"type": "function", "function": {"name": "get_weather"}})
    # The call and its result go back into the history, through the chat template.
    history = messages + [
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    whole, chunks, again = concurrently(
        lambda: chat(client, **named), lambda: list(chat(client, stream=True, **named)),
        lambda: chat(client, max_tokens=80, temperature=0, tools=[WEATHER_TOOL],
                     tool_choice="required", messages=history))
    streamed_calls = [t for c in chunks if c.choices and c.choices[0].delta.tool_calls
                      for t in c.choices[0].delta.tool_calls]
    streamed_finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
    for calls, finish in ((whole.choices[0].message.tool_calls, whole.choices[0].finish_reason),
                          (streamed_calls, streamed_finish)):
        assert finish == "tool_calls" and len(calls) == 1
        assert calls[0].type == "function" and calls[0].function.name == "get_weather"
        assert calls[0].id.startswith("call_")
        jsonschema_rs.validate(WEATHER_TOOL["function"]["parameters"],
                               json.loads(calls[0].function.arguments))
    assert again.choices[0].message.tool_calls[0].function.name == "get_weather"
    assert again.choices[0].finish_reason == "tool_calls"  # the grammar ends after the calls


def test_echo_and_prompt_lists(client, engine_loop, idle):
    ids = engine_loop.tokenizer.encode("Hello there")
    r = client.completions.create(model=MODEL_NAME, prompt=["The sky is", ids], max_tokens=3,
                                  temperature=0, n=2, echo=True)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert r.choices[0].text.startswith("The sky is") and r.choices[0].text == r.choices[1].text
    assert r.choices[2].text.startswith("Hello there")
    assert r.usage.prompt_tokens == len(engine_loop.tokenizer.encode("The sky is")) + len(ids)
    assert r.usage.completion_tokens == 12
    chunks = list(client.completions.create(model=MODEL_NAME, prompt="The sky is", max_tokens=3,
                                            temperature=0, echo=True, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == r.choices[0].text


def test_generate_accepts_max_tokens(server, idle):
    r = httpx.post(server.url + "/generate", json={"prompt": "Hi", "max_tokens": 3}, timeout=120)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    r = httpx.post(server.url + "/generate",
                   json={"prompt": "Hi", "max_tokens": 3, "max_new_tokens": 3})
    assert r.status_code == 400 and "max_tokens" in r.json()["error"]["message"]


def test_min_tokens_over_max_tokens_names_the_bound_and_the_cap_lowers_both(server, fuzz_server,
                                                                         idle):
    """min_tokens past max_tokens is a 400 that says the bound; a server's --max-tokens-cap
    lowers a request's min_tokens with its max_tokens (the request itself was valid)."""
    body = {"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 4, "min_tokens": 9}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 400 and "(4), got 9" in r.json()["error"]["message"], r.text
    body["max_tokens"] = 9  # valid; the fuzz server caps every request at 1 token
    r = httpx.post(fuzz_server.url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 1


def test_a_reply_cut_off_inside_a_character_ends_with_its_bytes_text(server, idle):
    """max_tokens reached on a byte token that begins no whole character (SmolLM2's 111: the
    byte 0xA1): the text is the one decode of the tokens gives, U+FFFD, streamed or not (it
    was "": the detokenizer held the byte for a character that never came)."""
    body = {"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 1, "temperature": 0,
            "logit_bias": {"111": 100}}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "\ufffd", r.text
    with httpx.stream("POST", server.url + "/v1/completions", timeout=120,
                      json={**body, "stream": True}) as r:
        events = parse_sse(r.iter_lines())
    assert "".join(e["choices"][0]["text"] for e in events[:-1] if e["choices"]) == "\ufffd"


BAD = [  # (endpoint, body, a word the message must contain)
    ("chat", {"top_logprobs": 2}, "logprobs"),
    ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("chat", {"n": 17}, "n"),
    ("chat", {"tools": [WEATHER_TOOL]}, "tool"),  # SmolLM2's template shows no tools: no "auto"
    ("chat", {"tool_choice": "required"}, "tools"),
    ("chat", {"tools": [WEATHER_TOOL],
              "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "nope"),
    ("chat", {"tools": [WEATHER_TOOL], "tool_choice": "required",
              "response_format": {"type": "json_object"}}, "response_format"),
    ("chat", {"response_format": {"type": "json_object"}, "ignore_eos": True}, "ignore_eos"),
    ("chat", {"response_format": {"type": "json_schema",
                                  "json_schema": {"name": "x", "schema": {"type": "objekt"}}}},
     "JSON schema"),
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "schema"),
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {  # never fetched
        "name": "x", "schema": {"$schema": "http://127.0.0.1:9/meta"}}}}, "$schema"),
    ("chat", {"response_format": {"type": "xml"}}, "response_format"),
    ("chat", {"min_tokens": 9, "max_tokens": 4}, "min_tokens"),
    ("chat", {"stop_token_ids": [10**7]}, "stop_token_ids"),
    ("chat", {"repetition_penalty": 0}, "repetition_penalty"),
    ("chat", {"frequency_penalty": 2.5}, "frequency_penalty"),
    ("chat", {"logit_bias": {"1": 200.0}}, "logit_bias"),
    ("chat", {"messages": [{"role": "assistant", "tool_calls": [{
        "id": "c", "type": "function", "function": {"name": "f", "arguments": "[1]"}}]}]},
     "arguments"),
    ("completions", {"best_of": 1, "n": 2}, "best_of"),
    ("completions", {"best_of": 3, "n": 1, "stream": True}, "best_of"),
    ("completions", {"max_tokens": 0, "stream": True}, "max_tokens"),
    ("completions", {"prompt_logprobs": 21}, "prompt_logprobs"),
    ("completions", {"echo": True, "logprobs": 1, "n": 2, "stream": True}, "prompt_logprobs"),
    ("completions", {"logprobs": True}, "logprobs"),
    ("completions", {"prompt": ["a"] * 65}, "prompt"),
    ("completions", {"prompt": ["a", ""]}, "prompt"),
    ("completions", {"suffix": "x"}, "suffix"),
]


@pytest.mark.parametrize("endpoint,extra,word", BAD, ids=[f"{e}-{w}" for e, _, w in BAD])
def test_bad_combinations_are_400(server, endpoint, extra, word, idle):
    if endpoint == "chat":
        body = {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 4, **extra}
        path = "/v1/chat/completions"
    else:
        body = {"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 4, **extra}
        path = "/v1/completions"
    r = httpx.post(server.url + path, json=body, timeout=120)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert word.lower() in error["message"].lower(), error


def test_stream_without_usage_has_no_usage_field(server, idle):
    with httpx.stream("POST", server.url + "/v1/chat/completions", timeout=120,
                      json={"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 3,
                            "stream": True, "n": 2}) as r:
        events = parse_sse(r.iter_lines())
    assert events[-1] == "[DONE]"
    assert all("usage" not in e for e in events[:-1])
    assert {e["choices"][0]["index"] for e in events[:-1]} == {0, 1}
