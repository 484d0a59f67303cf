"""Structured output with xgrammar: a response format (json_object, json_schema, an EBNF
grammar, a structural tag such as a tool call) is compiled once against the model's tokenizer
(cached by format), each constrained request gets its own matcher, and every step the matcher
fills the row's token bitmask, which the batched sampler applies before sampling.

Overlap: a constrained row's mask for step N depends on the token of step N-1, which the host
reads only after launching step N when steps overlap. The engine therefore finishes (reads) the
in-flight step before scheduling the next whenever that step sampled a constrained row: the
whole step runs without overlap while a constrained request is running. Holding back only the
constrained rows would also cost them every other step and make the scheduler depend on what
is in flight; the mask itself is filled after the forward pass has been launched, so on a GPU
the matcher's work runs while the model computes.

Bounds (issue 35): xgrammar's compile cannot be interrupted inside a process, and a pattern of
a few bytes (`^a{10000}$`) can keep it busy for far longer than a step, so a request's format
meets three checks. At the API (and
in `add_request`), check_json_schema: `$ref` only inside the schema itself (nothing is ever
fetched or read), no integer beyond 64 bits, not a schema that admits nothing. Before
compiling, StructuredLimits: cheap static bounds on size, nesting, enum values and regex
repetitions (each refusal names its limit and flag). And the compile itself runs in a
CompileWorker child process, killed (and started again for the next compile) when it passes
its time limit or its request is aborted; the grammar comes back serialized and is cached here.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import select
import signal
import struct
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from contextlib import contextmanager
from pathlib import Path

import torch

from flashlet.core.request_check import RequestError

FORMAT_PARAM = "response_format"  # the request field a format's errors name (RequestError.param)
TOOL_CALL_MODEL_FORMAT = "qwen_3"  # <tool_call>\n{"name": ..., "arguments": ...}\n</tool_call>
INT64_MIN, INT64_MAX = -2**63, 2**63 - 1  # xgrammar reads schema integers as int64

# ---- check_json_schema: what a schema may say at all -----------------------------------------
# Keywords whose value is one subschema, a list of them, or a map of names to them.
_ONE_SCHEMA = ("not", "if", "then", "else", "items", "additionalProperties", "additionalItems",
               "contains", "propertyNames", "unevaluatedItems", "unevaluatedProperties",
               "contentSchema")
_SCHEMA_LIST = ("allOf", "anyOf", "oneOf", "prefixItems", "items")  # items: a list before 2020-12
_SCHEMA_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas",
               "dependencies")
_REF_KEYS = ("$ref", "$dynamicRef", "$recursiveRef")
_ANNOTATIONS = {"title", "description", "$comment", "examples", "default", "deprecated",
                "readOnly", "writeOnly", "$id", "$schema", "$anchor"}


def _escape(name: str) -> str:
    return name.replace("~", "~0").replace("/", "~1")


def _subschemas(node: dict):
    """(pointer suffix, subschema) for each direct subschema of a schema object."""
    for key, value in node.items():
        if key in _ONE_SCHEMA and isinstance(value, (dict, bool)):
            yield f"/{key}", value
        elif key in _SCHEMA_LIST and isinstance(value, list):
            for i, child in enumerate(value):
                yield f"/{key}/{i}", child
        elif key in _SCHEMA_MAP and isinstance(value, dict):
            for name, child in value.items():
                if isinstance(child, (dict, bool)):
                    yield f"/{key}/{_escape(name)}", child


def walk_schema(schema):
    """(JSON pointer, schema node, depth) for every (sub)schema, iteratively: a schema nested
    deeper than Python's recursion limit is walked too."""
    stack = [("", schema, 1)]
    while stack:
        path, node, depth = stack.pop()
        yield path, node, depth
        if isinstance(node, dict):
            stack.extend((path + sub, child, depth + 1) for sub, child in _subschemas(node))


def check_json_schema(schema) -> None:
    """ValueError, naming the place, unless every `$ref` points inside this schema, every
    integer fits in 64 bits and the schema admits some value. Nothing is fetched or read."""
    _check_integers(schema)
    for path, node, _ in walk_schema(schema):
        if isinstance(node, dict):
            for key in _REF_KEYS:
                if key in node:
                    _check_ref(schema, key, node[key], path or "/")
    if _admits_nothing(schema):
        raise ValueError("admits no value at all (false, {\"not\": {}}, an empty enum, ...): "
                         "no output could match it")


def _check_integers(value) -> None:
    stack = [("", value)]
    while stack:
        path, v = stack.pop()
        if isinstance(v, int) and not isinstance(v, bool) and not INT64_MIN <= v <= INT64_MAX:
            raise ValueError(f"the integer at {path or '/'} is beyond 64 bits (at most "
                             f"{INT64_MAX} in magnitude)")
        if isinstance(v, dict):
            stack.extend((f"{path}/{_escape(str(k))}", child) for k, child in v.items())
        elif isinstance(v, list):
            stack.extend((f"{path}/{i}", child) for i, child in enumerate(v))


_MISSING = object()


def _check_ref(schema, key: str, ref, where: str) -> None:
    if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
        raise ValueError(f"{key} {ref!r} at {where}: only references inside this schema ('#' or "
                         "a '#/...' JSON pointer) are allowed; nothing is fetched or read")
    if _resolve_pointer(schema, ref) is _MISSING:
        raise ValueError(f"{key} {ref!r} at {where} points to nothing in this schema")


def _resolve_pointer(document, ref: str):
    from urllib.parse import unquote

    node = document
    for token in unquote(ref[2:]).split("/") if ref != "#" else ():
        token = token.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and token in node:
            node = node[token]
        elif isinstance(node, list) and token.isdigit() and int(token) < len(node):
            node = node[int(token)]
        else:
            return _MISSING
    return node


def _admits_everything(node) -> bool:
    return node is True or (isinstance(node, dict) and not set(node) - _ANNOTATIONS)


def _admits_nothing(node, depth: int = 0) -> bool:
    """The forms of a schema that no value matches (False where unsure: the grammar decides)."""
    if node is False:
        return True
    if not isinstance(node, dict) or depth > 32:
        return False
    if "not" in node and _admits_everything(node["not"]):
        return True
    if node.get("enum") == []:
        return True
    all_of, any_of, one_of = (node.get(k) for k in ("allOf", "anyOf", "oneOf"))
    if isinstance(all_of, list) and any(_admits_nothing(s, depth + 1) for s in all_of):
        return True
    for options in (any_of, one_of):
        if isinstance(options, list) and options and all(
                _admits_nothing(s, depth + 1) for s in options):
            return True
    properties, required = node.get("properties"), node.get("required")
    if isinstance(properties, dict) and isinstance(required, list):
        return any(name in properties and _admits_nothing(properties[name], depth + 1)
                   for name in required if isinstance(name, str))
    return False


# ---- StructuredLimits: what a format may cost to compile -------------------------------------
@dataclasses.dataclass(frozen=True)
class StructuredLimits:
    """Bounds on a response format, checked before it compiles (EngineConfig's
    structured_output_* fields; each refusal names the flag that raises its limit)."""

    timeout_s: float = 10.0  # 0: compile in this process, with no time limit
    max_bytes: int = 256 * 1024
    max_depth: int = 64
    max_enum: int = 8192
    max_enum_chars: int = 128 * 1024
    max_pattern_size: int = 4096

    @classmethod
    def of(cls, config) -> "StructuredLimits":
        """The limits an EngineConfig sets."""
        return cls(**{f.name: getattr(config, "structured_output_" + f.name)
                      for f in dataclasses.fields(cls)})

    def check(self, fmt: dict, text: str | None = None) -> None:
        """ValueError naming the limit if `fmt` (`text`: its JSON, if known) is past one."""
        for schema in schemas_in(fmt):
            self._check_schema(schema)  # first: a schema too deep for json.dumps is refused here
        for where, pattern in tag_patterns_in(fmt):  # a structural tag's regexes (vLLM's guided_regex)
            self._check_pattern(pattern, where)
        text = text if text is not None else StructuredOutputs.key(fmt)
        if len(text) > self.max_bytes:
            raise _over("is", f"{len(text)} bytes as JSON", self.max_bytes, "max-bytes")

    def _check_schema(self, schema) -> None:
        enum_values = enum_chars = 0
        for path, node, depth in walk_schema(schema):
            if depth > self.max_depth:
                where = path if len(path) <= 60 else path[:60] + "..."
                raise _over("nests", f"subschemas {depth} deep (at {where})", self.max_depth,
                            "max-depth")
            if not isinstance(node, dict):
                continue
            values = node["enum"] if isinstance(node.get("enum"), list) else []
            values = [*values, node["const"]] if "const" in node else values
            enum_values += len(values)
            if enum_values > self.max_enum:
                raise _over("has", f"more than {self.max_enum} enum and const values",
                            self.max_enum, "max-enum")
            enum_chars += sum(len(json.dumps(v)) for v in values)
            if enum_chars > self.max_enum_chars:
                raise _over("has", f"enum and const values of {enum_chars}+ characters",
                            self.max_enum_chars, "max-enum-chars")
            patterns = [(f"{path}/pattern", node.get("pattern"))]
            if isinstance(node.get("patternProperties"), dict):
                patterns += [(f"{path}/patternProperties", p) for p in node["patternProperties"]]
            for where, pattern in patterns:
                if isinstance(pattern, str):
                    self._check_pattern(pattern, where)

    def _check_pattern(self, pattern: str, where: str) -> None:
        size = pattern_size(pattern, where)
        if size is not None and size > self.max_pattern_size:
            raise _over("has", f"a pattern at {where} of size {size} with its repetitions "
                        "expanded", self.max_pattern_size, "max-pattern-size")


def _over(verb: str, what: str, limit: int, flag: str) -> ValueError:
    return ValueError(f"response_format {verb} {what}: over the limit of {limit} "
                      f"(--structured-output-{flag})")


def schemas_in(fmt: dict) -> list:
    """The JSON schemas a response format holds: its own, or a structural tag's (tool calls)."""
    if fmt.get("type") == "json_schema":
        return [fmt["json_schema"]["schema"]]
    found, stack = [], [fmt.get("format")] if fmt.get("type") == "structural_tag" else []
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            for key, value in node.items():
                if key == "json_schema" and isinstance(value, (dict, bool)):
                    found.append(value)
                else:
                    stack.append(value)
        elif isinstance(node, list):
            stack.extend(node)
    return found


def tag_patterns_in(fmt: dict) -> list[tuple[str, str]]:
    """(where, pattern) of each regex a structural tag holds outside its JSON schemas (those
    `schemas_in` gives, whose patterns `_check_schema` reads)."""
    found, stack = [], [("format", fmt.get("format"))] if fmt.get("type") == "structural_tag" else []
    while stack:
        where, node = stack.pop()
        if isinstance(node, dict):
            if node.get("type") == "regex" and isinstance(node.get("pattern"), str):
                found.append((f"{where}.pattern", node["pattern"]))
            stack += [(f"{where}.{k}", v) for k, v in node.items() if k != "json_schema"]
        elif isinstance(node, list):
            stack += [(f"{where}[{i}]", v) for i, v in enumerate(node)]
    return found


def pattern_size(pattern: str, where: str = "pattern") -> int | None:
    """A regex's size with its repetitions expanded (a{100} counts 100; an unbounded repeat its
    minimum, at least once); None if Python's parser cannot read it (the worker's time limit
    bounds it then). ValueError for a repeated group that can match the empty string
    ("(a|a?)+"): the ambiguous form whose matching blows up."""
    try:  # the stdlib's own regex parser (private, but stable since 3.11)
        from re import _constants, _parser
    except ImportError:  # pragma: no cover
        return None
    try:
        tree = _parser.parse(pattern)
    except (re.error, RecursionError, OverflowError, ValueError):
        return None
    return _expanded_size(tree, _constants, where)


def _expanded_size(sub, c, where: str) -> int:
    repeats = (c.MAX_REPEAT, c.MIN_REPEAT, getattr(c, "POSSESSIVE_REPEAT", c.MAX_REPEAT))
    total = 0
    for op, av in sub:
        if op in repeats:
            low, high, body = av
            if high == c.MAXREPEAT and body.getwidth()[0] == 0:
                raise ValueError(f"response_format has a pattern at {where} that repeats a "
                                 "group that can match the empty string (such as '(a|a?)+'): "
                                 "it cannot be compiled in bounded time")
            total += _expanded_size(body, c, where) * max(low if high == c.MAXREPEAT else high, 1)
        elif op is c.SUBPATTERN:
            total += _expanded_size(av[-1], c, where)
        elif op is c.BRANCH:
            total += sum(_expanded_size(b, c, where) for b in av[1])
        elif op in (c.ASSERT, c.ASSERT_NOT):
            total += _expanded_size(av[1], c, where)
        elif op is getattr(c, "ATOMIC_GROUP", None):
            total += _expanded_size(av, c, where)
        else:
            total += 1
    return total


# ---- CompileWorker: the compile, in a process that can be killed -----------------------------
class CompileCancelled(Exception):
    """The compile's request went away, or the engine shut down, and the worker was stopped."""

    def __init__(self, message: str = "the grammar compile was cancelled"):
        super().__init__(message)


class CompileWorker:
    """A child process that compiles grammars for one tokenizer, one at a time; killed when a
    compile passes its time limit, is cancelled or the owner closes it, and started again by
    the next compile. The grammar comes back serialized (CompiledGrammar.serialize_json)."""

    def __init__(self, tokenizer_info_json: str):
        self._info = tokenizer_info_json.encode()
        self._proc: subprocess.Popen | None = None
        self._compile_lock = threading.Lock()  # one compile at a time
        self._state_lock = threading.Lock()  # _proc, _key, _cancelled (cancel from any thread)
        self._key: str | None = None
        self._cancelled = self._closed = False
        self.num_started = 0

    def compile(self, key: str, fmt: dict, timeout_s: float) -> str:
        """The serialized grammar; ValueError with xgrammar's reason or past the time limit;
        CompileCancelled if cancel(key) stopped it."""
        with self._compile_lock:
            proc = self._started()
            with self._state_lock:
                self._key, self._cancelled = key, False
            try:
                _write_frame(proc.stdin, struct.pack("<d", timeout_s) + json.dumps(fmt).encode())
                reply = _read_frame(proc.stdout.fileno(), time.monotonic() + timeout_s)
            except TimeoutError:
                self._kill()
                raise ValueError(f"response_format: compiling its grammar took longer than the "
                                 f"limit of {timeout_s:g} s (--structured-output-timeout-s)"
                                 ) from None
            except (OSError, EOFError):
                cancelled = self._cancelled or self._closed
                self._kill()
                if cancelled:
                    raise CompileCancelled() from None
                raise RuntimeError("the grammar compile worker died") from None
            finally:
                with self._state_lock:
                    self._key = None
        if reply[:1] == b"E":
            raise ValueError(reply[1:].decode())
        return reply[1:].decode()

    def start(self) -> None:
        """Start the process now, if it is not running (what the next compile would do first:
        the process imports xgrammar and torch, seconds on a busy machine)."""
        with self._compile_lock:
            self._started()

    def cancel(self, key: str) -> bool:
        """Stop the compile of `key` if it is the one running (any thread); True if it was."""
        with self._state_lock:
            if self._key != key or self._proc is None:
                return False
            self._cancelled = True
            self._proc.kill()  # the compiling thread reads EOF
            return True

    def close(self) -> None:
        """Stop the worker for good (any thread): a compile under way ends CompileCancelled."""
        with self._state_lock:
            self._closed = True
            if self._proc is not None:
                self._proc.kill()

    def _started(self) -> subprocess.Popen:
        with self._state_lock:
            if self._closed:
                raise CompileCancelled()
            if self._proc is not None and self._proc.poll() is None:
                return self._proc
        # This flashlet, wherever the parent found it (an install, a checkout on sys.path).
        package_root = str(Path(__file__).resolve().parents[2])
        path = os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")]))
        proc = subprocess.Popen(
            [sys.executable, "-c", "from flashlet.text.structured import run_compile_worker; "
             "run_compile_worker()"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            env={**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"})
        with self._state_lock:
            self._proc = proc
            self.num_started += 1
            closed = self._closed  # close() may have run while it started
        try:
            if closed:
                raise OSError("closed")
            _write_frame(proc.stdin, self._info)
        except OSError:  # it died at once, or close() killed it
            self._kill()
            raise CompileCancelled() if self._closed else RuntimeError(
                "the grammar compile worker did not start") from None
        return proc

    def _kill(self) -> None:
        with self._state_lock:
            proc, self._proc = self._proc, None
        if proc is not None:
            proc.kill()
            proc.wait()
            for pipe in (proc.stdin, proc.stdout):
                try:
                    pipe.close()
                except OSError:
                    pass


def _write_frame(pipe, payload: bytes) -> None:
    pipe.write(struct.pack("<I", len(payload)) + payload)
    pipe.flush()


def _read_frame(fd: int, deadline: float | None) -> bytes:
    (size,) = struct.unpack("<I", _read_exact(fd, 4, deadline))
    return _read_exact(fd, size, deadline)


def _read_exact(fd: int, size: int, deadline: float | None) -> bytes:
    chunks = []
    while size:
        if deadline is not None:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
                raise TimeoutError
        chunk = os.read(fd, min(size, 1 << 20))
        if not chunk:
            raise EOFError
        chunks.append(chunk)
        size -= len(chunk)
    return b"".join(chunks)


def run_compile_worker() -> None:
    """The worker process: a tokenizer's info, then format after format until stdin closes.
    Its own alarm (the time limit plus a margin) ends a compile that outlives its parent."""
    import xgrammar as xgr

    reply_fd = os.dup(1)
    os.dup2(2, 1)  # anything a library prints goes to stderr, not into the replies
    info = xgr.TokenizerInfo.deserialize_json(_read_frame(0, None).decode())
    compiler = xgr.GrammarCompiler(info, max_threads=min(8, os.cpu_count() or 1))
    while True:
        try:
            request = _read_frame(0, None)
        except EOFError:
            return
        (timeout_s,) = struct.unpack("<d", request[:8])
        signal.setitimer(signal.ITIMER_REAL, timeout_s + 5)  # SIGALRM's default: exit
        try:
            grammar = compile_format(compiler, json.loads(request[8:]))
            reply = b"O" + grammar.serialize_json().encode()
        except ValueError as e:
            reply = b"E" + str(e).encode()
        signal.setitimer(signal.ITIMER_REAL, 0)
        os.write(reply_fd, struct.pack("<I", len(reply)) + reply)


def compile_format(compiler, fmt: dict):
    """A response_format -> xgrammar's CompiledGrammar; ValueError with the reason if invalid."""
    try:
        return _compile_with(compiler, fmt)
    except (RuntimeError, ValueError, TypeError) as e:  # xgrammar's errors for bad input
        # Its messages start "[12:00:00] /project/cpp/file.cc:94: ": keep what follows.
        reason = re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", str(e).strip())
        raise ValueError(f"invalid {fmt['type']} response_format: {reason}") from None


def _compile_with(compiler, fmt: dict):
    kind = fmt["type"]
    if kind == "json_object":
        return compiler.compile_builtin_json_grammar()
    if kind == "json_schema":
        # Compact JSON: small models otherwise tend to loop on whitespace (vLLM's
        # disable_any_whitespace for the same reason).
        return compiler.compile_json_schema(json.dumps(fmt["json_schema"]["schema"]),
                                            any_whitespace=False)
    if kind == "grammar":
        return compiler.compile_grammar(fmt["grammar"])
    if kind == "structural_tag":
        return compiler.compile_structural_tag({"type": "structural_tag",
                                                "format": fmt["format"]})
    raise ValueError(f"response_format {kind!r} needs no grammar")


# ---- StructuredOutputs -----------------------------------------------------------------------
@contextmanager
def _format_errors():
    """A ValueError raised about a format becomes the request's own RequestError, naming the
    field at fault (FORMAT_PARAM), so that every place it ends up answers it as a bad request."""
    try:
        yield
    except RequestError:
        raise
    except ValueError as e:
        raise RequestError(str(e), FORMAT_PARAM) from None


class StructuredOutputs:
    """Compiles response formats for one tokenizer (checked, bounded, cached by format) and
    makes a matcher per request."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: set[int],
                 cache_size: int = 256, limits: StructuredLimits | None = None):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self.cache_size = cache_size
        self.limits = limits or StructuredLimits()
        self._info = None  # built on first use: TokenizerInfo walks the whole vocabulary
        self._info_lock = threading.Lock()
        self._compiler = None  # in this process (limits.timeout_s == 0)
        self._worker: CompileWorker | None = None
        self._closed = False
        self._compiled: OrderedDict[str, object] = OrderedDict()  # canonical format -> grammar
        self._lock = threading.Lock()  # the cache: never held while compiling
        self.num_compiled = 0

    @staticmethod
    def key(fmt: dict) -> str:
        """The format as canonical JSON (the cache's key); ValueError if it nests too deep."""
        try:
            return json.dumps(fmt, sort_keys=True, separators=(",", ":"))
        except RecursionError:
            raise ValueError("response_format nests too deep to be read") from None

    def is_cached(self, fmt: dict) -> bool:
        key = self._key_if_readable(fmt)
        with self._lock:
            return key is not None and key in self._compiled

    def _key_if_readable(self, fmt: dict) -> str | None:
        try:
            return self.key(fmt)
        except ValueError:  # too deep for json.dumps: check() says which limit it passes
            return None

    def check(self, fmt: dict, key: str | None = None) -> None:
        """RequestError (param response_format) naming the reason if `fmt` may not compile: a
        schema's own rules (check_json_schema) and the static limits. Cheap: the core runs it
        on its loop."""
        with _format_errors():
            for schema in schemas_in(fmt):
                try:
                    check_json_schema(schema)
                except ValueError as e:
                    raise ValueError(f"invalid {fmt['type']} response_format: {e}") from None
            self.limits.check(fmt, key)

    def compile(self, fmt: dict):
        """A response_format -> xgrammar's CompiledGrammar (cached); RequestError (param
        response_format) if it is invalid, past a limit, too slow to compile or begins with
        what no token of the vocabulary spells (DEAD_END); CompileCancelled after cancel(fmt)."""
        key = self._key_if_readable(fmt)
        with self._lock:
            if key in self._compiled:
                self._compiled.move_to_end(key)
                return self._compiled[key]
        self.check(fmt, key)
        with _format_errors():
            key = key if key is not None else self.key(fmt)
            grammar = self._compile(key, fmt)
        import xgrammar as xgr

        if allows_no_token(xgr.GrammarMatcher(grammar), self.vocab_size):
            raise RequestError(DEAD_END.format("begin"), FORMAT_PARAM)
        with self._lock:
            self.num_compiled += 1
            self._compiled[key] = grammar
            if len(self._compiled) > self.cache_size:
                self._compiled.popitem(last=False)
        return grammar

    def start_worker(self) -> None:
        """Build the tokenizer's info and start the compile worker ahead of the first format
        (a server does at start-up, on its grammar thread), so that the first request with a
        response_format does not wait for them: seconds of imports on a busy machine."""
        if not self.limits.timeout_s or self._closed:
            return
        try:
            self._compile_worker(self._tokenizer_info()).start()
        except CompileCancelled:  # closed meanwhile (the server stops)
            pass

    def cancel(self, fmt: dict) -> bool:
        """Stop `fmt`'s compile if it is the one running (its request left); True if it was."""
        key = self._key_if_readable(fmt)
        return self._worker is not None and key is not None and self._worker.cancel(key)

    def close(self) -> None:
        """Stop the compile worker for good (a compile under way ends CompileCancelled)."""
        self._closed = True
        if self._worker is not None:
            self._worker.close()

    def matcher(self, fmt: dict):
        import xgrammar as xgr

        return xgr.GrammarMatcher(self.compile(fmt))

    def _compile(self, key: str, fmt: dict):
        import xgrammar as xgr

        info = self._tokenizer_info()
        if not self.limits.timeout_s:
            if self._compiler is None:
                self._compiler = xgr.GrammarCompiler(info)
            return compile_format(self._compiler, fmt)
        return xgr.CompiledGrammar.deserialize_json(
            self._compile_worker(info).compile(key, fmt, self.limits.timeout_s), info)

    def _compile_worker(self, info) -> CompileWorker:
        if self._worker is None:
            self._worker = CompileWorker(info.serialize_json())
            if self._closed:  # close() ran while the tokenizer info was built
                self._worker.close()
        return self._worker

    def _tokenizer_info(self):
        with self._info_lock:
            if self._info is None:
                import xgrammar as xgr

                self._info = xgr.TokenizerInfo.from_huggingface(
                    self.tokenizer, vocab_size=self.vocab_size,
                    stop_token_ids=self.stop_token_ids)
            return self._info


# One row's mask may take this much CPU time of the step: a grammar past it ends its request
# (an error) rather than stall every other row's tokens on each step it runs. CPU time, not
# wall time: a loaded machine does not make a normal mask look slow.
MASK_CPU_BUDGET_S = 0.5


def apply_grammar_masks(logits: torch.Tensor, reqs: list, errors: dict) -> None:
    """Mask, in place, the tokens each constrained row's grammar forbids (logits
    [len(reqs), vocab]); a matcher that fails, or takes more than MASK_CPU_BUDGET_S, puts its
    row in `errors`."""
    rows = [i for i, req in enumerate(reqs) if req.grammar is not None]
    if not rows:
        return
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(len(reqs), logits.shape[1])
    filled = []
    for i in rows:
        try:
            started = time.thread_time()
            reqs[i].grammar.fill_next_token_bitmask(bitmask, i)
            took = time.thread_time() - started
            if took > MASK_CPU_BUDGET_S:
                raise RequestError(f"response_format: its grammar took {took:.2f} s of CPU for "
                                   f"one token's mask, over the limit of {MASK_CPU_BUDGET_S} s",
                                   FORMAT_PARAM)
            filled.append(i)
        except Exception as e:  # one bad request must not fail the batch
            errors[i] = e
    if filled:
        if logits.is_cuda:
            bitmask = bitmask.pin_memory().to(logits.device, non_blocking=True)
        xgr.apply_token_bitmask_inplace(logits, bitmask,
                                        vocab_size=logits.shape[1], indices=filled)


# A grammar that allows no token next: the output it asks for needs a character that no token
# of the vocabulary spells (SmolLM2's has no token for the UTF-8 lead byte 0xF1, so nothing can
# write U+40000). The request's own doing: it ends with this error, a 400 through the server.
DEAD_END = ("response_format: no token of this model's vocabulary can {} the output it allows "
            "(it needs a character no token spells)")


def allows_no_token(grammar, vocab_size: int) -> bool:
    """Whether the grammar's next-token mask is empty: a dead end for this vocabulary."""
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(1, vocab_size)
    grammar.fill_next_token_bitmask(bitmask, 0)
    return not bool(bitmask.any())


def refused_token(grammar, token: int, vocab_size: int) -> Exception:
    """The error of a row whose sampled token its grammar refused: at a dead end (an empty
    mask: the row drew from no token at all) the request's own RequestError, else a ValueError
    (a token the mask should have kept out)."""
    if allows_no_token(grammar, vocab_size):
        return RequestError(DEAD_END.format("continue"), FORMAT_PARAM)
    return ValueError(f"token {token} does not fit the response format")


def advance_grammars(reqs: list, tokens: list, vocab_size: int) -> None:
    """Feed each constrained request its sampled token (tokens: one per row, an Exception where
    sampling failed); a token its grammar rejects becomes that row's error (`refused_token`).
    The grammar ends on an EOS token, which ends the request as any EOS does."""
    for row, req in enumerate(reqs):
        token = tokens[row]
        if req.grammar is None or req.is_finished or isinstance(token, Exception):
            continue  # unconstrained, a void row (stopped a step before), or failed already
        if not req.grammar.accept_token(token):
            tokens[row] = refused_token(req.grammar, token, vocab_size)


def tool_call_format(tools: list[dict], tool_choice="required",
                     model_format: str = TOOL_CALL_MODEL_FORMAT, parallel: bool = True) -> dict:
    """OpenAI `tools` and a `tool_choice` ("required" or {"type": "function", "function":
    {"name": ...}}) -> a structural_tag response_format that makes the model call them in
    `model_format`'s syntax (Qwen2.5's <tool_call> by default); ValueError if invalid.
    parallel=False (OpenAI's parallel_tool_calls: false): "required" ends after one call."""
    import xgrammar as xgr

    if tool_choice == "auto" or tool_choice == "none":
        raise ValueError(f"tool_choice {tool_choice!r} does not constrain the output")
    try:
        tag = xgr.get_builtin_structural_tag(model_format, tools=tools, tool_choice=tool_choice,
                                             reasoning=False, max_whitespace_cnt=1)
    except (ValueError, TypeError, KeyError) as e:
        raise ValueError(f"invalid tools or tool_choice: {e}") from None
    fmt = tag.model_dump(mode="json")["format"]
    if fmt["type"] == "triggered_tags":  # "required": calls only, then the end
        fmt = calls_only(fmt, one=not parallel)
    return {"type": "structural_tag", "format": fmt}


def calls_only(triggered: dict, one: bool = False) -> dict:
    """xgrammar's `required` format (triggered tags, at least one) allows free text around
    and after the calls, so a model may call and then talk to max_tokens. This one is one or
    more calls (one: exactly one), one a line, and nothing else: the grammar then ends, and
    with it (on EOS) the request, whose finish_reason becomes "tool_calls"."""
    return {"type": "tags_with_separator", "tags": triggered["tags"], "separator": "\n",
            "at_least_one": True, "stop_after_first": one}
