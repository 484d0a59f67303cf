"""Issue #33's parsers and new endpoints through the official `openai` client: Qwen3 reasoning
and Llama 3 / hermes tool calls (real chat templates from templates/), chat_template_kwargs,
/tokenize and /detokenize, and /v1/responses, each whole and streamed.

Random weights never write a tool call or a <think> block, so the replies that need one come
from `ScriptedLoop`, an engine client that answers every request with a set text's tokens:
the route, parsers, SSE and client are all real. The real tiny engine serves the rest."""

from __future__ import annotations

import asyncio
import json
import shutil
import threading
from pathlib import Path

import httpx
import pytest
from server_helpers import ServerThread, assert_no_leaks, idle_stats

from flashlet import LLM
from flashlet.core.request import RequestOutput
from flashlet.core.request_check import RequestLimits
from flashlet.server import EngineLoop, ServerConfig, create_app
from flashlet.server.engine_loop import EngineClient
from tests.conftest import save_tiny_model

openai = pytest.importorskip("openai", reason="the openai client is not installed")
pytestmark = pytest.mark.slow

TEMPLATES = Path(__file__).parent / "templates"
QWEN3 = (TEMPLATES / "qwen3.jinja").read_text()
LLAMA3 = (TEMPLATES / "llama3.jinja").read_text()
MODEL = "tiny"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
ASK = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def tiny_llm(tmp_path_factory, demo_model_dir):
    """A tiny random Llama with the demo model's tokenizer (a real vocabulary, tiny speed)."""
    folder = save_tiny_model("llama", tmp_path_factory.mktemp("tiny-extra"), vocab_size=49152)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(demo_model_dir / name, folder / name)
    return LLM(str(folder))


class ScriptedLoop(EngineClient):
    """An engine client whose every request is answered with `reply`'s tokens, one per
    output (cut at max_tokens), each handed over once the one before was taken (so each is
    its own delta, as engine steps are), recording the prompts it was sent."""

    def __init__(self, llm: LLM):
        self.tokenizer = llm.engine.tokenizer
        self.limits = RequestLimits.of_engine(llm.engine)
        self.ready, self.stopped, self.error = threading.Event(), threading.Event(), None
        self.ready.set()
        self.is_ready, self._stopping, self.num_waiting = True, False, 0
        self.reply, self.prompts, self.feeders = "", [], set()

    def submit_group(self, streams, max_waiting=None):
        ids = self.tokenizer.encode(self.reply, add_special_tokens=False)
        for stream in streams:
            self.prompts.append(self.tokenizer.decode(stream.prompt_token_ids))
            out = ids[:stream.params.max_new_tokens]
            reason = "stop" if len(out) == len(ids) else "length"
            outputs = [RequestOutput(0, [token], k == len(out) - 1,
                                     reason if k == len(out) - 1 else None)
                       for k, token in enumerate(out)]
            feeder = asyncio.ensure_future(self._feed(stream, outputs))
            self.feeders.add(feeder)  # held until done (the loop keeps weak references only)
            feeder.add_done_callback(self.feeders.discard)

    async def _feed(self, stream, outputs):
        for out in outputs:
            while stream.items and not stream.cancelled:
                await asyncio.sleep(0)
            if stream.cancelled:
                return
            stream.push(out)

    def abort(self, stream, finish_reason="abort"):
        stream.cancelled = True

    @property
    def num_streams(self):
        return len(self.feeders)

    def core_stats(self):
        return [{}]


def _serve(loop, **config):
    return ServerThread(create_app(loop, ServerConfig(model_name=MODEL, **config))).start()


@pytest.fixture(scope="module")
def scripted(tiny_llm):
    """Servers on one scripted loop: Qwen3's template with the qwen3 reasoning parser, and
    Llama 3's with its default (llama3_json) tool parser."""
    loop = ScriptedLoop(tiny_llm)
    qwen3 = _serve(loop, chat_template=QWEN3, reasoning_parser="qwen3")
    llama3 = _serve(loop, chat_template=LLAMA3)
    yield loop, qwen3, llama3
    qwen3.stop()
    llama3.stop()


@pytest.fixture(scope="module")
def real(tiny_llm):
    """The tiny engine itself, with Qwen3's template."""
    loop = EngineLoop(engine=tiny_llm.engine).start()
    assert loop.wait_ready(30)
    srv = _serve(loop, chat_template=QWEN3, reasoning_parser="qwen3")
    yield loop, srv
    srv.stop()
    try:
        assert_no_leaks(idle_stats(loop))
    finally:
        loop.stop()


def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                         timeout=120)


def _stream_message(chunks) -> tuple[dict, str]:
    """The message a chat stream's deltas add up to, and its finish reason."""
    message = {"content": "", "reasoning_content": "", "tool_calls": []}
    finish = None
    for c in chunks:
        for choice in c.choices:
            delta = choice.delta.model_dump()
            message["content"] += delta.get("content") or ""
            message["reasoning_content"] += delta.get("reasoning_content") or ""
            message["tool_calls"] += delta.get("tool_calls") or []
            finish = choice.finish_reason or finish
    return message, finish


# ---- reasoning and tool calls --------------------------------------------------------------
def test_qwen3_reasoning_reply_whole_and_streamed(scripted):
    loop, qwen3, _ = scripted
    loop.reply = "<think>\nThe user wants Paris.\n</think>\n\nIt is sunny in Paris."
    r = client(qwen3).chat.completions.create(model=MODEL, messages=ASK, max_tokens=64)
    message = r.choices[0].message
    assert message.reasoning_content == "\nThe user wants Paris.\n"
    assert message.content == "It is sunny in Paris." and r.choices[0].finish_reason == "stop"
    chunks = list(client(qwen3).chat.completions.create(model=MODEL, messages=ASK,
                                                        max_tokens=64, stream=True))
    streamed, finish = _stream_message(chunks)
    assert streamed["reasoning_content"] == message.reasoning_content
    assert streamed["content"] == message.content and finish == "stop"
    assert all("<think>" not in (c.choices[0].delta.content or "") for c in chunks if c.choices)


def test_qwen3_tool_call_after_reasoning(scripted):
    loop, qwen3, _ = scripted
    loop.reply = ('<think>\nuse the tool\n</think>\n\n<tool_call>\n{"name": "get_weather", '
                  '"arguments": {"city": "Paris"}}\n</tool_call>')
    kwargs = dict(model=MODEL, messages=ASK, max_tokens=64, tools=[WEATHER])
    r = client(qwen3).chat.completions.create(**kwargs)
    call = r.choices[0].message.tool_calls[0]
    assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content is None
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    assert r.choices[0].message.reasoning_content == "\nuse the tool\n"
    assert "<tools>" in loop.prompts[-1] and '"get_weather"' in loop.prompts[-1]
    loop.reply += "\n"  # the call closes a token before the reply ends (as EOS would)
    chunks = list(client(qwen3).chat.completions.create(**kwargs, stream=True))
    streamed, finish = _stream_message(chunks)
    assert finish == "tool_calls" and streamed["content"] == ""
    assert chunks[-1].choices[0].delta.tool_calls is None  # it went out before the last chunk
    [call] = streamed["tool_calls"]
    assert call["index"] == 0 and call["id"].startswith("call_")
    assert call["function"]["name"] == "get_weather"


def test_llama3_template_tool_call_whole_and_streamed(scripted):
    loop, _, llama3 = scripted
    loop.reply = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
    kwargs = dict(model=MODEL, messages=ASK, max_tokens=64, tools=[WEATHER])
    r = client(llama3).chat.completions.create(**kwargs)
    assert "Given the following functions" in loop.prompts[-1]  # Llama 3's tool prompt
    [call] = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content is None
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    streamed, finish = _stream_message(client(llama3).chat.completions.create(**kwargs,
                                                                             stream=True))
    assert finish == "tool_calls" and streamed["content"] == ""
    assert [c["function"]["name"] for c in streamed["tool_calls"]] == ["get_weather"]
    # The call and its result go back through the template, and plain text stays text.
    loop.reply = "It is sunny."
    history = ASK + [r.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    r = client(llama3).chat.completions.create(model=MODEL, messages=history, max_tokens=64,
                                               tools=[WEATHER])
    assert r.choices[0].message.content == "It is sunny." and not r.choices[0].message.tool_calls
    assert '"parameters": {"city": "Paris"}' in loop.prompts[-1]
    assert "ipython<|end_header_id|>" in loop.prompts[-1]


def test_chat_template_kwargs_reach_the_template(scripted):
    loop, qwen3, _ = scripted
    loop.reply = "Paris."
    r = client(qwen3).chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=8,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert loop.prompts[-1].endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    message = r.choices[0].message
    assert message.content == "Paris." and message.reasoning_content is None
    for bad in ({"tokenize": True}, {"add_generation_prompt": False}, {"no-ident": 1}):
        r = httpx.post(qwen3.url + "/v1/chat/completions", json={
            "model": MODEL, "messages": ASK, "chat_template_kwargs": bad}, timeout=60)
        assert r.status_code == 400 and "chat_template_kwargs" in r.json()["error"]["param"]


# ---- /tokenize, /detokenize ----------------------------------------------------------------
def test_tokenize_and_detokenize(real, tiny_llm):
    _, srv = real
    tok = tiny_llm.engine.tokenizer
    r = httpx.post(srv.url + "/tokenize", json={"prompt": "Hello world"}, timeout=60).json()
    assert r["tokens"] == tok.encode("Hello world") and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == tiny_llm.engine.max_model_len
    strs = httpx.post(srv.url + "/tokenize", json={"prompt": "Hello world",
                                                   "return_token_strs": True}, timeout=60).json()
    assert strs["token_strs"] == tok.convert_ids_to_tokens(r["tokens"])
    r = httpx.post(srv.url + "/detokenize", json={"tokens": r["tokens"]}, timeout=60).json()
    assert r == {"prompt": "Hello world"}
    chat = httpx.post(srv.url + "/tokenize", json={"messages": ASK, "model": MODEL}, timeout=60).json()
    expected = tok.encode(tok.apply_chat_template(ASK, chat_template=QWEN3, tokenize=False,
                                                  add_generation_prompt=True),
                          add_special_tokens=False)
    assert chat["tokens"] == expected
    bare = httpx.post(srv.url + "/tokenize", json={
        "messages": ASK, "add_generation_prompt": False,
        "chat_template_kwargs": {"enable_thinking": False}}, timeout=60).json()
    assert tok.decode(bare["tokens"]).endswith("<|im_end|>\n")
    for path, body, param in [("/detokenize", {"tokens": [10**6]}, "tokens"),
                              ("/tokenize", {"prompt": 5}, "prompt"),
                              ("/tokenize", {}, "prompt"),
                              ("/tokenize", {"prompt": "x", "tools": [WEATHER]}, "tools"),
                              ("/tokenize", {"messages": ASK, "add_special_tokens": True},
                               "add_special_tokens"),
                              ("/tokenize", {"prompt": "x", "model": "nope"}, "model")]:
        r = httpx.post(srv.url + path, json=body, timeout=60)
        assert r.status_code in (400, 404), r.text
        assert param in (r.json()["error"]["param"] or "") + r.json()["error"]["message"]


def test_a_prefilled_reply_is_continued(real, tiny_llm):
    """vLLM's continue_final_message (with add_generation_prompt false): the last message is left
    open, as apply_chat_template leaves it, and the reply continues it (its usage counts that
    prompt); without add_generation_prompt false it is a 400 naming the field."""
    _, srv = real
    tok = tiny_llm.engine.tokenizer
    prefill = [*ASK, {"role": "assistant", "content": "The answer is"}]
    ending = {"add_generation_prompt": False, "continue_final_message": True}
    r = httpx.post(srv.url + "/tokenize", json={"messages": prefill, **ending}, timeout=60).json()
    expected = tok.apply_chat_template(prefill, chat_template=QWEN3, tokenize=False, **ending)
    assert r["tokens"] == tok.encode(expected, add_special_tokens=False)
    assert tok.decode(r["tokens"]).endswith("The answer is")
    reply = httpx.post(srv.url + "/v1/chat/completions", json={
        "messages": prefill, "max_tokens": 3, **ending}, timeout=60)
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["prompt_tokens"] == r["count"]
    for body in ({"continue_final_message": True}, {"continue_final_message": True, "add_generation_prompt": True}):
        bad = httpx.post(srv.url + "/v1/chat/completions", json={"messages": prefill, **body}, timeout=60)
        assert bad.status_code == 400 and "continue_final_message" in bad.json()["error"]["message"], bad.text


# ---- /v1/responses -------------------------------------------------------------------------
def test_responses_text_whole_and_streamed(real):
    _, srv = real
    c = client(srv)
    r = c.responses.create(model=MODEL, input="Say hi.", instructions="Be brief.",
                           max_output_tokens=6, temperature=0)
    assert r.object == "response" and r.status == "incomplete"  # random weights: cut at 6
    assert r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 6 and r.usage.input_tokens > 0
    text = r.output_text
    assert text and r.output[0].type == "message"
    events = list(c.responses.create(model=MODEL, input="Say hi.", instructions="Be brief.",
                                     max_output_tokens=6, temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.incomplete" and "response.output_text.done" in kinds
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == text
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[-1].response.output_text == text


def test_responses_tool_call_and_reasoning(scripted):
    loop, qwen3, llama3 = scripted
    loop.reply = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
    tool = {"type": "function", **WEATHER["function"]}
    r = client(llama3).responses.create(model=MODEL, input="Weather in Paris?", tools=[tool])
    [call] = r.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert json.loads(call.arguments) == {"city": "Paris"} and r.status == "completed"
    events = list(client(llama3).responses.create(model=MODEL, input="Weather in Paris?",
                                                  tools=[tool], stream=True))
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(done) == 1 and json.loads(done[0].arguments) == {"city": "Paris"}
    assert events[-1].type == "response.completed"
    # A call and its output sent back as input items become the template's tool turns.
    loop.reply = "<think>\nchecked\n</think>\n\nSunny."
    r = client(qwen3).responses.create(model=MODEL, tools=[tool], input=[
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather",
         "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}])
    assert "<tool_response>\nsunny\n</tool_response>" in loop.prompts[-1]
    assert [o.type for o in r.output] == ["reasoning", "message"]
    assert r.output_text == "Sunny." and r.output[0].content[0].text == "\nchecked\n"
    # The next turn sends the whole output back (the stateless way), reasoning included.
    loop.reply = "You're welcome."
    history = [{"role": "user", "content": "Weather?"}] + [
        o.model_dump(exclude_none=True) for o in r.output] + [
        {"role": "user", "content": "Thanks!"}]
    again = client(qwen3).responses.create(model=MODEL, input=history)
    assert again.output_text == "You're welcome."
    assert "Sunny.<|im_end|>" in loop.prompts[-1] and "checked" not in loop.prompts[-1]
    loop.reply = "<think>\nchecked\n</think>\n\nSunny."
    events = list(client(qwen3).responses.create(model=MODEL, input="hi", stream=True))
    kinds = [e.type for e in events]
    assert kinds.index("response.reasoning_text.delta") < kinds.index(
        "response.output_text.delta")
    assert events[-1].response.output_text == "Sunny."
    # The SDK's own stream helper, which rebuilds the response from the events.
    with client(qwen3).responses.stream(model=MODEL, input="hi") as stream:
        for _ in stream:
            pass
        final = stream.get_final_response()
    assert final.output_text == "Sunny." and final.output[0].type == "reasoning"
    loop.reply = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
    with client(llama3).responses.stream(model=MODEL, input="hi", tools=[tool]) as stream:
        final = stream.get_final_response()
    assert final.output[0].type == "function_call" and final.output[0].name == "get_weather"


@pytest.mark.parametrize("body,param", [
    ({"input": []}, "input"), ({"input": "x", "previous_response_id": "resp_1"},
                               "previous_response_id"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools"),
    ({"input": "x", "tool_choice": "required"}, "tool_choice"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "[]"}]},
     "input"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input"),  # nothing left for the model
    ({"input": "word " * 600}, "input"),  # longer than the context (the chat check's "messages")
    ({"input": "x", "text": {"format": {"type": "json_object"}},  # a check of the whole request
      "tools": [{"type": "function", "name": "f"}]}, "text")])
def test_responses_bad_requests_are_400_naming_the_field(scripted, body, param):
    _, qwen3, _ = scripted
    r = httpx.post(qwen3.url + "/v1/responses", json={"model": MODEL, **body}, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"].startswith(param) and error["message"].startswith(param), error
    assert not error["message"].startswith(f"{param}: {param}:"), error


def test_a_request_without_model_or_with_null_sampling_fields_is_served(real):
    """vLLM's `model: Optional[str] = None`: chat, completions, responses and embeddings
    leave `model` out and get the served model (each response names it); a wrong name is
    still a 404. Sampling fields OpenAI's API lets be null (temperature, top_p, n, stream, ...)
    sent as null mean their defaults (`protocol.NullIsTheDefault`)."""
    _, srv = real
    asks = {"/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
            "/v1/completions": {"prompt": "hi", "max_tokens": 2},
            "/v1/responses": {"input": "hi", "max_output_tokens": 2},
            "/v1/embeddings": {"input": "hi", "encoding_format": "float"}}
    for path, body in asks.items():
        r = httpx.post(srv.url + path, json=body, timeout=60)
        assert r.status_code == 200, (path, r.text)
        assert r.json()["model"] == MODEL, path
        if path != "/v1/embeddings":  # OpenAI's nullable sampling fields, sent as null: defaults
            nulls = {"temperature": None, "top_p": None, "stream": None}
            nulls.update({"n": None, "top_k": None} if path != "/v1/responses" else {})
            r = httpx.post(srv.url + path, json={**body, **nulls}, timeout=60)
            assert r.status_code == 200 and r.json()["model"] == MODEL, (path, r.text)
        wrong = httpx.post(srv.url + path, json={**body, "model": "gpt-9"}, timeout=60)
        assert wrong.status_code == 404 and wrong.json()["error"]["code"] == "model_not_found", path


def test_openai_fields_that_change_nothing_and_a_reply_sent_back_are_served(real):
    """What OpenAI's clients send beside the essentials: store, metadata, service_tier,
    prompt_cache_key, safety_identifier, parallel_tool_calls, modalities ["text"] (accepted,
    ignored), and a history holding a reply as a client got it (refusal, annotations, audio,
    function_call, an empty tool_calls, reasoning_content)."""
    _, srv = real
    reply = {"role": "assistant", "content": "Hello.", "refusal": None, "annotations": [], "audio": None,
             "function_call": None, "tool_calls": [], "reasoning_content": "greet back"}
    body = {"messages": [{"role": "user", "content": "hi"}, reply, {"role": "user", "content": "again"}],
            "max_tokens": 2, "store": False, "metadata": {"app": "test"}, "service_tier": "auto",
            "prompt_cache_key": "k", "safety_identifier": "u1", "parallel_tool_calls": False,
            "modalities": ["text"], "reasoning_effort": None, "audio": None}
    r = httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 2


# ---- /v1/embeddings ------------------------------------------------------------------------
def _hf_embedding(folder, ids: list[int], mode: str) -> list[float]:
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        hidden = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0]
    vector = hidden[-1] if mode == "last" else hidden.mean(0)
    return torch.nn.functional.normalize(vector, dim=0).tolist()


def test_embeddings_through_the_engine_loop(real, tiny_llm):
    loop, srv = real
    c = client(srv)
    tok = tiny_llm.engine.tokenizer
    texts = ["Hello world", "A longer sentence about the weather in Paris."]
    r = c.embeddings.create(model=MODEL, input=texts)  # the client asks for base64
    floats = c.embeddings.create(model=MODEL, input=texts, encoding_format="float")
    ids = c.embeddings.create(model=MODEL, input=[tok.encode(t) for t in texts],
                              encoding_format="float")
    assert [d.index for d in r.data] == [0, 1]
    assert r.usage.prompt_tokens == r.usage.total_tokens == sum(len(tok.encode(t))
                                                                for t in texts)
    for k, text in enumerate(texts):
        expected = _hf_embedding(tiny_llm.engine.model_dir, tok.encode(text), "last")
        for got in (r.data[k].embedding, floats.data[k].embedding, ids.data[k].embedding):
            assert got == pytest.approx(expected, abs=1e-4)
    one = c.embeddings.create(model=MODEL, input=tok.encode("Hello world"),
                              encoding_format="float")
    assert one.data[0].embedding == pytest.approx(floats.data[0].embedding, abs=1e-6)
    for body, param in [({"input": ""}, "input"), ({"input": [[]]}, "input"),
                        ({"input": "x", "encoding_format": "hex"}, "encoding_format"),
                        ({"input": "x", "dimensions": 8}, "dimensions"),
                        ({"input": [[10**7]]}, "input")]:
        r = httpx.post(srv.url + "/v1/embeddings", json={"model": MODEL, **body}, timeout=60)
        assert r.status_code == 400, r.text
        assert param in (r.json()["error"]["param"] or "") + r.json()["error"]["message"]


def test_embeddings_through_an_engine_core_process(tiny_qwen2):
    from flashlet import EngineConfig
    from flashlet.server import CoreClient

    core = CoreClient(EngineConfig(model=str(tiny_qwen2), max_num_pages=64,
                                   max_num_batched_tokens=16, max_num_seqs=4)).start()
    srv = None
    try:
        assert core.wait_ready(180), core.error
        srv = _serve(core, pooling="mean")
        prompts = [list(range(3, 40)), [7, 8, 9]]  # the first in three prefill chunks
        r = httpx.post(srv.url + "/v1/embeddings", timeout=120,
                       json={"model": MODEL, "input": prompts}).json()
        for k, ids in enumerate(prompts):
            assert r["data"][k]["embedding"] == pytest.approx(
                _hf_embedding(tiny_qwen2, ids, "mean"), abs=1e-4)
        stats = core.probe()[0]
        assert stats["running"] == stats["waiting"] == stats["num_requests"] == 0, stats
        assert stats["kv_pages_used"] == stats["kv_pages_cached"], stats
    finally:
        if srv is not None:
            srv.stop()
        core.stop()
