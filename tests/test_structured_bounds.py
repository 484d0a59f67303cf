"""Issue 35's bounds on structured output, without a model: what a schema may say at all
(check_json_schema: $ref only inside it, 64-bit integers, something it admits), the static
limits before a compile (StructuredLimits: each refusal names its flag), and the compile worker
(a child process with a time limit, cancelled by an abort; slow: it starts xgrammar)."""

from __future__ import annotations

import threading
import time

import pytest

from flashlet import EngineConfig
from flashlet.text.structured import (CompileCancelled, StructuredLimits, StructuredOutputs,
                                 check_json_schema, pattern_size)


def nested_objects(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def fmt_of(schema) -> dict:
    return {"type": "json_schema", "json_schema": {"schema": schema}}


# ---- check_json_schema ---------------------------------------------------------------------
@pytest.mark.parametrize("schema, words", [
    ({"$ref": "http://127.0.0.1:9/schema.json"}, "only references inside this schema"),
    ({"$ref": "file:///etc/passwd"}, "only references inside this schema"),
    ({"properties": {"a": {"$ref": "other.json#/x"}}}, "/properties/a"),
    ({"$defs": {"a": {"$dynamicRef": "https://x/y"}}}, "$dynamicRef"),
    ({"$ref": "#/$defs/missing"}, "points to nothing"),
    ({"type": "integer", "maximum": 2**70}, "/maximum is beyond 64 bits"),
    ({"enum": [1, -2**64]}, "/enum/1 is beyond 64 bits"),
    ({"not": {}}, "admits no value"),
    ({"not": True}, "admits no value"),
    (False, "admits no value"),
    ({"enum": []}, "admits no value"),
    ({"anyOf": [False, {"not": {"description": "anything"}}]}, "admits no value"),
    ({"type": "object", "properties": {"a": False}, "required": ["a"]}, "admits no value"),
])
def test_schemas_that_reach_out_overflow_or_admit_nothing_are_refused(schema, words):
    with pytest.raises(ValueError, match=words.replace("$", r"\$")):
        check_json_schema(schema)


@pytest.mark.parametrize("schema", [
    {"$defs": {"name": {"type": "string"}}, "type": "object",
     "properties": {"n": {"$ref": "#/$defs/name"}, "self": {"$ref": "#"}}},
    {"definitions": {"a/b": {"type": "integer"}}, "$ref": "#/definitions/a~1b"},
    {"type": "integer", "minimum": -2**63, "maximum": 2**63 - 1},
    {"type": "object", "properties": {"a": False}},  # a forbidden property, not a required one
    {"not": {"type": "string"}},
    True,
])
def test_local_refs_64_bit_integers_and_satisfiable_schemas_pass(schema):
    check_json_schema(schema)


def test_a_schema_deeper_than_pythons_recursion_limit_is_walked():
    check_json_schema(nested_objects(3000))  # iterative: no RecursionError


# ---- StructuredLimits ----------------------------------------------------------------------
LIMITS = StructuredLimits()


@pytest.mark.parametrize("schema, flag", [
    ({"type": "string", "pattern": "^a{10000}$"}, "max-pattern-size"),
    ({"type": "string", "pattern": "^(a{100}){100}$"}, "max-pattern-size"),
    ({"type": "object", "patternProperties": {"^x{9000}$": {}}}, "max-pattern-size"),
    ({"enum": list(range(100_000))}, "max-enum"),
    ({"enum": ["x" * 200] * 5000}, "max-enum-chars"),
    ({"anyOf": [{"const": i} for i in range(9000)]}, "max-enum"),
    (nested_objects(500), "max-depth"),
    ({"type": "object", "description": "x" * 300_000}, "max-bytes"),
])
def test_a_format_past_a_static_limit_is_refused_naming_its_flag(schema, flag):
    fmt = fmt_of(schema)
    with pytest.raises(ValueError, match=f"--structured-output-{flag}"):
        LIMITS.check(fmt)


@pytest.mark.parametrize("pattern", ["^(a|a?)+b$", "(a*)*", "^(x?)+$", "(?:|b)+"])
def test_a_repeated_group_that_can_match_nothing_is_refused(pattern):
    with pytest.raises(ValueError, match="empty string"):
        LIMITS.check(fmt_of({"type": "string", "pattern": pattern}), "{}")


def test_ordinary_patterns_and_schemas_pass_and_sizes_count_repetitions():
    assert pattern_size("^[0-9]{3}-[a-z]+$") == 1 + 3 + 1 + 1 + 1  # ^, [0-9] x3, -, [a-z], $
    assert pattern_size("(ab){10}") == 20
    assert pattern_size(r"\p{L}+") is None  # not Python's syntax: the time limit bounds it
    for schema in ({"type": "string", "pattern": r"^(\d{3}-)+\d{4}$"},
                   {"enum": [f"v{i}" for i in range(1000)]}, nested_objects(40),
                   {"type": "string", "maxLength": 100_000}):
        LIMITS.check(fmt_of(schema))


def test_the_limits_come_from_the_engine_config():
    config = EngineConfig(structured_output_timeout_s=2.5, structured_output_max_enum=3)
    limits = StructuredLimits.of(config)
    assert limits.timeout_s == 2.5 and limits.max_enum == 3
    with pytest.raises(ValueError, match="structured_output_timeout_s"):
        EngineConfig(structured_output_timeout_s=-1)
    with pytest.raises(ValueError, match="max-enum"):
        limits.check(fmt_of({"enum": [1, 2, 3, 4]}), "{}")


def test_a_tool_calls_parameter_schemas_are_bounded_too():
    tag = {"type": "structural_tag", "format": {"type": "triggered_tags", "tags": [
        {"begin": "<tool_call>", "end": "</tool_call>", "content": {
            "type": "json_schema", "json_schema": {"enum": list(range(10_000))}}}]}}
    with pytest.raises(ValueError, match="max-enum"):
        LIMITS.check(tag, "{}")


def test_a_structural_tags_regexes_are_bounded_too():
    """A regex node anywhere in a structural tag (vLLM's guided_regex arrives as one) meets the
    pattern bounds a schema's patterns do, named by where it sits."""
    nested = {"type": "structural_tag", "format": {"type": "sequence", "elements": [
        {"type": "const_string", "value": "id: "}, {"type": "regex", "pattern": "[0-9]{5000}"}]}}
    with pytest.raises(ValueError, match=r"format\.elements\[1\]\.pattern.*max-pattern-size"):
        LIMITS.check(nested, "{}")
    with pytest.raises(ValueError, match="empty string"):
        LIMITS.check({"type": "structural_tag", "format": {"type": "regex", "pattern": "(a|a?)+"}}, "{}")
    LIMITS.check({"type": "structural_tag", "format": {"type": "regex", "pattern": "[0-9]{3}-[a-z]+"}}, "{}")


# ---- the compile worker --------------------------------------------------------------------
@pytest.fixture(scope="module")
def demo_tokenizer(demo_model_dir):
    from flashlet.models.weights import load_tokenizer

    return load_tokenizer(str(demo_model_dir))


@pytest.mark.slow
def test_a_compile_past_its_time_limit_is_refused_and_the_worker_serves_on(demo_tokenizer):
    outputs = StructuredOutputs(demo_tokenizer, 49152, {2}, limits=StructuredLimits(
        timeout_s=1.0, max_pattern_size=10**9))  # static bounds off: the time limit alone
    try:
        outputs.compile({"type": "json_object"})  # starts the worker
        slow = fmt_of({"type": "string", "pattern": "^a{10000}$"})  # ~12 s to compile here
        t0 = time.monotonic()
        with pytest.raises(ValueError, match="--structured-output-timeout-s"):
            outputs.compile(slow)
        assert time.monotonic() - t0 < 5  # the limit, plus killing the worker
        assert not outputs.is_cached(slow)
        grammar = outputs.compile(fmt_of({"type": "object", "properties": {
            "a": {"type": "integer"}}}))  # a fresh worker
        assert grammar is not None and outputs._worker.num_started == 2
        with pytest.raises(ValueError, match="invalid json_schema"):
            outputs.compile(fmt_of({"type": "string", "pattern": "(unclosed"}))
    finally:
        outputs.close()


@pytest.mark.slow
def test_the_worker_started_ahead_serves_the_first_compile(demo_tokenizer):
    """start_worker (a server's core at start-up) runs the process the first compile uses: no
    second start; closed first, it starts nothing."""
    outputs = StructuredOutputs(demo_tokenizer, 49152, {2})
    try:
        outputs.start_worker()
        worker = outputs._worker
        assert worker.num_started == 1 and worker._proc.poll() is None
        assert outputs.compile({"type": "json_object"}) is not None
        assert outputs._worker is worker and worker.num_started == 1
    finally:
        outputs.close()
    closed = StructuredOutputs(demo_tokenizer, 49152, {2})
    closed.close()
    closed.start_worker()
    assert closed._worker is None
    in_process = StructuredOutputs(demo_tokenizer, 49152, {2}, limits=StructuredLimits(timeout_s=0))
    in_process.start_worker()  # compiles in this process: no worker to start
    assert in_process._worker is None


@pytest.mark.slow
def test_a_cancelled_compile_stops_and_close_ends_the_worker(demo_tokenizer):
    outputs = StructuredOutputs(demo_tokenizer, 49152, {2}, limits=StructuredLimits(
        timeout_s=120, max_pattern_size=10**9))
    outputs.compile({"type": "json_object"})
    slow = fmt_of({"type": "string", "pattern": "^a{9999}$"})
    stopped = []

    def cancel_once_running():
        while not outputs.cancel(slow):  # False until the worker runs this compile
            time.sleep(0.05)
        stopped.append(time.monotonic())

    threading.Thread(target=cancel_once_running, daemon=True).start()
    with pytest.raises(CompileCancelled):
        outputs.compile(slow)
    assert stopped and time.monotonic() - stopped[0] < 5
    outputs.close()
    with pytest.raises(CompileCancelled):  # closed for good: no new worker
        outputs.compile(fmt_of({"type": "boolean"}))


# ---- masking -------------------------------------------------------------------------------
class _Grammar:
    def __init__(self, cpu_s: float = 0.0):
        self.cpu_s = cpu_s

    def fill_next_token_bitmask(self, bitmask, row: int) -> None:
        started = time.thread_time()
        while time.thread_time() - started < self.cpu_s:
            pass  # a grammar whose mask is slow to compute
        bitmask[row].fill_(0)
        bitmask[row, 0] = 1  # allows token 0 only


def test_a_grammar_whose_mask_is_too_slow_ends_its_row_not_the_batch(monkeypatch):
    import torch
    from types import SimpleNamespace

    from flashlet.text import structured

    monkeypatch.setattr(structured, "MASK_CPU_BUDGET_S", 0.02)
    reqs = [SimpleNamespace(grammar=_Grammar()), SimpleNamespace(grammar=None),
            SimpleNamespace(grammar=_Grammar(cpu_s=0.05))]
    logits = torch.zeros(3, 64)
    errors: dict = {}
    structured.apply_grammar_masks(logits, reqs, errors)
    assert list(errors) == [2] and "over the limit" in str(errors[2])
    from flashlet.core.request_check import RequestError
    assert isinstance(errors[2], RequestError)  # the request's own: a 400 through the server
    assert torch.isinf(logits[0, 1:]).all() and logits[0, 0] == 0  # masked
    assert not torch.isinf(logits[1]).any() and not torch.isinf(logits[2]).any()
