"""The reply parsers (flashlet/server/parsers.py) on text: each family's tool-call syntax,
Qwen3 / DeepSeek-R1 reasoning, and a streamed reply cut anywhere giving the whole one's message."""

from __future__ import annotations

import json
import random

import pytest

from flashlet.server.parsers import (ReplyParsers, default_tool_parser, reasoning_parser,
                                     reply_parsers, tool_parser)

HERMES = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
          '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n'
          '</tool_call>')
LLAMA = '{"name": "get_weather", "parameters": {"city": "Paris"}}; ' \
        '{"name": "get_time", "parameters": {"tz": "CET"}}'
MISTRAL = 'Sure. [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, ' \
          '{"name": "get_time", "arguments": {"tz": "CET"}}]'
MISTRAL_V11 = ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}'
               '[TOOL_CALLS]get_time[ARGS]{"tz": "CET"}')
EXPECTED = [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET"})]


def _named(calls):
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


@pytest.mark.parametrize("name,text,content", [
    ("hermes", HERMES, "Let me check."), ("llama3_json", LLAMA, None),
    ("llama3_json", "<|python_tag|>" + LLAMA, None), ("mistral", MISTRAL, "Sure."),
    ("mistral", MISTRAL_V11, None),
    ("mistral", MISTRAL.split("[TOOL_CALLS]")[1], None)])  # the marker dropped as special
def test_each_family_parses_its_calls(name, text, content):
    got_content, calls = tool_parser(name).extract(text)
    assert got_content == content
    assert _named(calls) == EXPECTED
    assert all(c["type"] == "function" and c["id"] for c in calls)
    if name == "mistral":  # its templates want 9 alphanumeric characters
        assert all(len(c["id"]) == 9 and c["id"].isalnum() for c in calls)


@pytest.mark.parametrize("name,text", [
    ("hermes", "<tool_call>{not json}</tool_call>"),
    ("hermes", '<tool_call>{"arguments": {}}</tool_call>'),  # no name
    ("hermes", "plain text, no call"),
    ("llama3_json", '{"name": "f", "parameters": [1]}'),
    ("llama3_json", 'The answer is {"name": "f"}'),  # JSON inside prose is not a call
    ("llama3_json", '{"city": "Paris"}'),
    ("mistral", "[TOOL_CALLS][{oops"), ("mistral", "[1, 2]")])
def test_malformed_calls_stay_content(name, text):
    assert tool_parser(name).extract(text) == (text, [])


def test_reasoning_splits():
    qwen3, r1 = reasoning_parser("qwen3"), reasoning_parser("deepseek_r1")
    assert qwen3.split("<think>\nhmm\n</think>\n\nParis.") == ("\nhmm\n", "Paris.")
    assert qwen3.split("Paris.") == (None, "Paris.")  # enable_thinking false: no block
    assert qwen3.split("<think>still going") == ("still going", None)  # cut by max_tokens
    assert r1.split("hmm</think>Paris.") == ("hmm", "Paris.")  # its prompt opened the block
    assert r1.split("hmm") == ("hmm", None)


def test_default_tool_parser_follows_the_template():
    assert default_tool_parser("... <tool_call> ... <|im_start|>") == "hermes"
    assert default_tool_parser("<|start_header_id|>ipython<|end_header_id|>") == "llama3_json"
    assert default_tool_parser("[AVAILABLE_TOOLS] [TOOL_CALLS]") == "mistral"
    assert default_tool_parser(None) == "hermes"
    with pytest.raises(ValueError, match="unknown tool-call parser"):
        tool_parser("nope")


def _streamed(parsers: ReplyParsers, text: str, rng: random.Random) -> tuple[dict, list]:
    """Push `text` in random pieces; the message the deltas add up to, and the deltas."""
    stream, deltas, pos = parsers.stream(), [], 0
    while pos < len(text):
        end = min(len(text), pos + rng.randint(1, 6))
        deltas.append(stream.push(text[pos:end]))
        pos = end
    deltas.append(stream.push("", final=True))
    message = {"content": "", "reasoning_content": "", "tool_calls": []}
    for d in deltas:
        for key in ("content", "reasoning_content"):
            message[key] += d.get(key, "")
        message["tool_calls"] += d.get("tool_calls", [])
    return message, deltas


@pytest.mark.parametrize("tool,reasoning,text", [
    ("hermes", None, HERMES), ("llama3_json", None, "  " + LLAMA), ("mistral", None, MISTRAL),
    ("hermes", "qwen3", "<think>\nweather? call it\n</think>\n\n" + HERMES),
    ("hermes", "qwen3", "<think>\nplain</think>\n\nNo tools <tool needed."),
    ("llama3_json", None, "A {curly} answer, not a call."),
    ("hermes", None, "Broken <tool_call>{nope</tool_call> stays text"),
    (None, "deepseek_r1", "think think</think>answer"),
    (None, "qwen3", "<thinking is not a tag"),
])
def test_streamed_reply_adds_up_to_the_whole_one(tool, reasoning, text):
    parsers = ReplyParsers(tool and tool_parser(tool), reasoning and reasoning_parser(reasoning))
    whole, _ = parsers.message(text, "stop")
    for seed in range(20):
        streamed, deltas = _streamed(parsers, text, random.Random(seed))
        assert streamed["content"].strip() == (whole["content"] or "").strip()
        assert streamed["reasoning_content"] == (whole.get("reasoning_content") or "")
        calls = streamed["tool_calls"]
        assert [c["index"] for c in calls] == list(range(len(calls)))
        assert _named(calls) == _named(whole.get("tool_calls", []))
        for d in deltas[:-1]:  # a marker is never half sent as content
            assert "<tool_call" not in d.get("content", "") and "</think" not in str(d)


def test_hermes_calls_stream_as_each_closes():
    stream = ReplyParsers(tool_parser("hermes")).stream()
    first, second = HERMES.split("<tool_call>")[1:]
    assert stream.push("Let me check.\n") == {"content": "Let me check.\n"}
    assert stream.push("<tool_call>" + first[:-3]) == {}  # not closed yet
    delta = stream.push(first[-3:] + "<tool_call>")
    assert [c["index"] for c in delta["tool_calls"]] == [0] and "content" not in delta
    assert _named(delta["tool_calls"]) == EXPECTED[:1]
    last = stream.push(second, final=True)
    assert [c["index"] for c in last["tool_calls"]] == [1]
    assert _named(last["tool_calls"]) == EXPECTED[1:]
    # A malformed call after a sent one: the text after the sent one is content.
    stream = ReplyParsers(tool_parser("hermes")).stream()
    assert len(stream.push("<tool_call>" + first)["tool_calls"]) == 1
    assert stream.push("<tool_call>{oops</tool_call>") == {}
    assert stream.push("", final=True) == {"content": "\n<tool_call>{oops</tool_call>"}


def test_reply_message_and_finish_reason():
    parsers = reply_parsers(None, "qwen3", "{{ '<tool_call>' }}", "auto")
    message, reason = parsers.message("<think>x</think>" + HERMES, "stop")
    assert reason == "tool_calls" and message["reasoning_content"] == "x"
    assert message["content"] == "Let me check." and len(message["tool_calls"]) == 2
    _, reason = parsers.message("<think>x</think>" + HERMES, "length")
    assert reason == "length"
    none = reply_parsers("llama3_json", None, None, "none")
    assert none.message(LLAMA, "stop") == ({"role": "assistant", "content": LLAMA}, "stop")
    assert not none.active
    forced = reply_parsers("llama3_json", None, None, "required")  # the grammar writes hermes
    assert forced.tool.name == "hermes"


def test_without_parallel_tool_calls_a_reply_keeps_its_first_call():
    """OpenAI's parallel_tool_calls: false under "auto" (no grammar can hold the model to one
    call): the message and the stream both carry the first call only."""
    one = reply_parsers(None, None, "{{ '<tool_call>' }}", "auto", parallel_tool_calls=False)
    message, reason = one.message(HERMES, "stop")
    assert reason == "tool_calls" and _named(message["tool_calls"]) == EXPECTED[:1]
    assert reply_parsers(None, None, "{{ '<tool_call>' }}", "auto", True).max_calls is None
    for seed in range(5):
        streamed, _ = _streamed(one, HERMES, random.Random(seed))
        assert _named(streamed["tool_calls"]) == EXPECTED[:1]


def test_server_flags_choose_the_parsers_and_pooling():
    from flashlet.server.cli import _check_server_args, build_parser, make_app

    class NoEngine:  # create_app only keeps it
        is_ready, error, tokenizer, limits = False, None, None, None

        def core_stats(self):
            return [{}]

    args = build_parser().parse_args(["--tool-call-parser", "llama3_json", "--reasoning-parser",
                                      "qwen3", "--enable-auto-tool-choice", "--pooling", "mean"])
    app, _ = make_app(args, NoEngine(), "m", _check_server_args(args), None, 0, 0)
    config = app.state.server.config
    assert (config.tool_call_parser, config.reasoning_parser, config.pooling) == (
        "llama3_json", "qwen3", "mean")
    defaults = build_parser().parse_args([])
    assert (defaults.tool_call_parser, defaults.reasoning_parser, defaults.pooling) == (
        None, None, "last")
    for flag in ("--tool-call-parser", "--reasoning-parser", "--pooling"):
        with pytest.raises(SystemExit) as e:
            build_parser().parse_args([flag, "nope"])
        assert e.value.code == 2
