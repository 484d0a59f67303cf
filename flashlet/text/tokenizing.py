"""Text -> token ids for text a caller does not control.

Three guarantees:
- user text never becomes control tokens: a prompt, a chat message, a tool definition or a
  tool call in the history that *contains* the text `<|im_end|>` is encoded as those
  characters, not as the control token (the chat template's own markers still are control
  tokens); `allow_special=True` is for trusted callers;
- an over-long prompt is refused before it is tokenized: no token is longer than the
  vocabulary's longest entry, so a text of more than `limit * max_token_chars` characters
  cannot fit in `limit` tokens, whatever it holds; a shorter but long text is tokenized
  first only as far as a prefix that normally holds more than `limit` tokens;
- `TextEncoder` tokenizes long texts on worker threads that each own a copy of the tokenizer (a
  Hugging Face fast tokenizer must not be used by two threads at once, and
  `split_special_tokens` flips a flag on it), so unrelated requests never wait on one lock;
  texts up to INLINE_MAX_CHARS are encoded on the event loop, with a copy of its own, as
  pieces side by side where the tokenizer allows (pieces.py); a plain ASCII text anywhere is
  encoded from cached pre-token ids where the tokenizer allows (pretoken_cache.py).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import secrets
import threading
from typing import Any

from flashlet.text.pieces import MIN_PIECES_CHARS, PieceEncoder
from flashlet.text.pretoken_cache import PreTokenCache

# Texts longer than limit x PROBE_CHARS_PER_TOKEN characters are first tokenized only that
# far (English averages ~4 characters a token); PROBE_SLACK absorbs a token cut in two.
PROBE_CHARS_PER_TOKEN = 8
PROBE_SLACK = 8
# Texts up to this many characters (about 2,000 tokens) are encoded on the caller's event loop,
# in pieces side by side where the tokenizer allows (pieces.py): a fraction of a millisecond,
# less than the hop to a pool thread and back, which waits for the event loop's thread to let
# go of the GIL: several ms at p50 while the loop streams to 64 clients (api_overhead.py).
# Longer ones go to the pool: they would stall every stream.
INLINE_MAX_CHARS = 8192
# ... and up to this many when the caller has nothing else to serve (no stream to stall).
IDLE_INLINE_MAX_CHARS = 1 << 15


class PromptTooLong(ValueError):
    """The prompt cannot fit in the context (found before or after tokenizing)."""


def special_token_texts(tokenizer) -> list[str]:
    """The strings the tokenizer would turn into special (control) tokens."""
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    texts = [t.content for t in decoder.values() if getattr(t, "special", False)]
    return texts or list(getattr(tokenizer, "all_special_tokens", []) or [])


def max_token_chars(tokenizer) -> int:
    """An upper bound on the characters one token stands for: the longest vocabulary entry.

    Byte-level BPE spells each byte as one character, and a character is at least one byte;
    SentencePiece entries are the characters themselves."""
    return max((len(t) for t in tokenizer.get_vocab()), default=1) or 1


def encode_text(tokenizer, text: str, *, allow_special: bool = False,
                add_special_tokens: bool = True, pieces: PieceEncoder | None = None,
                pretokens: PreTokenCache | None = None) -> list[int]:
    """Encode text; special-token strings in it stay text unless `allow_special`. `pieces`
    (over this tokenizer): a long text is encoded as pieces side by side (pieces.py);
    `pretokens` (over this tokenizer): a text it can tell is encoded from cached pre-token ids
    (pretoken_cache.py)."""
    if pretokens is not None:
        ids = pretokens.encode(text, add_special_tokens, allow_special)
        if ids is not None:
            return ids
    if pieces is not None and len(text) >= MIN_PIECES_CHARS:
        pieces.rust.encode_special_tokens = not allow_special
        return pieces.encode(text, add_special_tokens)
    rust = rust_tokenizer(tokenizer)
    if rust is None:
        out = tokenizer(text, add_special_tokens=add_special_tokens,
                        split_special_tokens=not allow_special)
        return list(out["input_ids"])
    # What the Hugging Face call does (it sets the same flag on the same object), without the
    # character offsets it computes and drops: ~25% of a prompt's tokenizing, and the wrapper's
    # Python (held under the GIL; encode_batch* release it, encode does not).
    rust.encode_special_tokens = not allow_special
    return rust.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0].ids


def rust_tokenizer(tokenizer):
    """The `tokenizers.Tokenizer` under a Hugging Face fast tokenizer whose own call adds
    nothing to it (its class encodes as PreTrainedTokenizerFast does, and no truncation or
    padding is set, which that call would switch off), else None."""
    from transformers import PreTrainedTokenizerFast

    cls = type(tokenizer)
    if (not isinstance(tokenizer, PreTrainedTokenizerFast)
            or cls.__call__ is not PreTrainedTokenizerFast.__call__
            or cls._encode_plus is not PreTrainedTokenizerFast._encode_plus
            or hasattr(tokenizer, "_switch_to_input_mode")):
        return None
    rust = tokenizer.backend_tokenizer
    if rust.truncation is not None or rust.padding is not None:
        return None
    return rust


def render_chat(tokenizer, messages: list[dict], tools: list[dict] | None = None,
                template_kwargs: dict | None = None) -> str:
    """The chat template's text; `template_kwargs` are more variables for the template (e.g.
    Qwen3's enable_thinking)."""
    kwargs = {"add_generation_prompt": True, **(template_kwargs or {})}
    return tokenizer.apply_chat_template(messages, tokenize=False, tools=tools, **kwargs)


def chat_template_ending(add_generation_prompt: bool = True, continue_final_message: bool = False) -> dict:
    """apply_chat_template's two arguments for how the prompt ends: the assistant's turn opened,
    or the last message left open for the model to continue (a prefilled reply). vLLM's rule:
    the second takes no generation prompt after it (ValueError)."""
    if continue_final_message and add_generation_prompt:
        raise ValueError("continue_final_message: needs add_generation_prompt=False (the model "
                         "continues the last message instead of opening a reply)")
    return {"add_generation_prompt": add_generation_prompt, "continue_final_message": continue_final_message}


def template_shows_tools(tokenizer) -> bool:
    """Whether the chat template shows the model its tools: it renders a conversation
    differently with a tool than without."""
    probe = [{"role": "user", "content": "hi"}]
    tool = {"type": "function", "function": {"name": "probe", "description": "a probe",
                                             "parameters": {"type": "object", "properties": {}}}}
    try:
        return render_chat(tokenizer, probe) != render_chat(tokenizer, probe, [tool])
    except Exception:  # noqa: BLE001 - a template that cannot render tools has no tool support
        return False


def chat_ids(tokenizer, messages: list[dict], *, allow_special: bool = False,
             tools: list[dict] | None = None, template_kwargs: dict | None = None,
             pieces: PieceEncoder | None = None,
             pretokens: PreTokenCache | None = None) -> list[int]:
    """Apply the chat template and encode it; every text the caller supplied stays text.

    That is message content, and also tool definitions (names, descriptions, parameter
    schemas) and the tool calls in the history (names, arguments), which templates render
    too. When none of them holds a special-token string the result is exactly what
    `apply_chat_template(..., tokenize=True)` gives. Otherwise each string (or mapping key)
    that holds one is fenced with a random marker, the template is rendered, and the fenced
    spans are encoded with special tokens split (the template's own text with them parsed)."""
    check_messages(messages)
    specials = special_token_texts(tokenizer)

    def holds_special(text: str) -> bool:
        return any(s in text for s in specials)

    if allow_special or not _any_string(holds_special, (messages, tools)):
        return encode_text(tokenizer, render_chat(tokenizer, messages, tools, template_kwargs),
                           allow_special=True, add_special_tokens=False, pieces=pieces,
                           pretokens=pretokens)
    # Random decimal digits: unknown to the caller, and unchanged by what templates do to a
    # string (JSON escaping with or without ensure_ascii, upper/lower case, trim, HTML escapes).
    marker = f"{secrets.randbits(128):039d}"
    fenced_messages, fenced_tools = _fence(holds_special, marker, (messages, tools))
    parts = render_chat(tokenizer, fenced_messages, fenced_tools, template_kwargs).split(marker)
    if len(parts) % 2 == 0:
        raise ValueError("the chat template altered the text of a message or tool")
    ids: list[int] = []
    for i, part in enumerate(parts):
        if part:  # even parts: the template's text; odd parts: the caller's
            ids += encode_text(tokenizer, part, allow_special=i % 2 == 0,
                               add_special_tokens=False, pieces=pieces, pretokens=pretokens)
    return ids


def check_messages(messages) -> None:
    """A ValueError naming what is off in a chat conversation, before a template sees it:
    a non-empty list of messages, each a dict with a string `role` and a `content` that is a
    string, a list of content parts (dicts) or None (an assistant's tool calls)."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError("messages must be a non-empty list of {role, content} dicts")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ValueError(f"messages[{i}] must be a dict with a role and content, got {type(m).__name__}")
        if not isinstance(m.get("role"), str) or not m["role"]:
            raise ValueError(f"messages[{i}] needs a role (a non-empty string), got {m.get('role')!r}")
        content = m.get("content")
        if not (content is None or isinstance(content, str)
                or (isinstance(content, list) and all(isinstance(part, dict) for part in content))):
            raise ValueError(f"messages[{i}].content must be a string, a list of content parts or None, "
                             f"got {type(content).__name__}")


def _any_string(predicate, value) -> bool:
    """Whether any string in a JSON-like value (keys included) satisfies predicate."""
    if isinstance(value, str):
        return predicate(value)
    if isinstance(value, dict):
        return any(_any_string(predicate, k) or _any_string(predicate, v)
                   for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return any(_any_string(predicate, v) for v in value)
    return False


def _fence(predicate, marker: str, value):
    """A copy of a JSON-like value with every string (keys included) that satisfies predicate
    wrapped in marker on both sides; the rest is unchanged, so templates that compare a field
    with a fixed value (a parameter's "type") still do."""
    if isinstance(value, str):
        return f"{marker}{value}{marker}" if predicate(value) else value
    if isinstance(value, dict):
        return {_fence(predicate, marker, k): _fence(predicate, marker, v)
                for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_fence(predicate, marker, v) for v in value)
    return value


def check_chars(num_chars: int, limit_tokens: int, chars_per_token: int, what: str) -> None:
    """Refuse, without tokenizing, a text that cannot fit in `limit_tokens` tokens."""
    if num_chars > limit_tokens * chars_per_token:
        raise PromptTooLong(
            f"{what} is {num_chars} characters: more than the context of {limit_tokens} tokens "
            f"can hold (no token spans more than {chars_per_token} characters)")


class TextEncoder:
    """Thread-safe, bounded text encoding for the server.

    `limit_tokens` is the most prompt tokens any request may have; a text longer than
    `limit_tokens * max_token_chars` characters is refused at once. `encode_async` and
    `chat_async` encode a text of up to INLINE_MAX_CHARS characters on the calling thread (the
    event loop), or up to IDLE_INLINE_MAX_CHARS when the caller says it serves nothing else
    (`alone`), as pieces side by side where the tokenizer allows (pieces.py: the tokenizers
    library's threads shorten the loop's wait), and a longer one whole on a small thread pool;
    each thread has its own tokenizer copy."""

    def __init__(self, tokenizer, limit_tokens: int, *, allow_special: bool = False,
                 num_threads: int = 2):
        self.tokenizer = tokenizer
        self.limit_tokens = limit_tokens
        self.allow_special = allow_special
        self.chars_per_token = max_token_chars(tokenizer)
        self.has_chat_template = bool(getattr(tokenizer, "chat_template", None))
        self._supports_tools: bool | None = None
        self.num_threads = num_threads
        self.num_copies = 0  # tokenizer copies made so far (one per thread that encoded)
        self._local = threading.local()
        self._copy_lock = threading.Lock()
        # checked once on the original; each thread's copy gets one like it (_tokenizer)
        self._piece_template = PieceEncoder.of(rust_tokenizer(tokenizer))
        self._pretoken_template = PreTokenCache.of(rust_tokenizer(tokenizer))
        self._pool = concurrent.futures.ThreadPoolExecutor(num_threads,
                                                           thread_name_prefix="flashlet-tokenize")

    def _tokenizer(self):
        tok = getattr(self._local, "tokenizer", None)
        if tok is None:
            with self._copy_lock:  # deepcopy reads the shared original
                tok = copy.deepcopy(self.tokenizer)
                self.num_copies += 1
            template = self._piece_template  # this thread's piece encoder, over its copy
            self._local.pieces = (None if template is None else
                                  PieceEncoder(rust_tokenizer(tok), template.post_processes))
            template = self._pretoken_template  # and its pre-token cache
            self._local.pretokens = None if template is None else template.like(rust_tokenizer(tok))
            self._local.tokenizer = tok
        return tok

    @property
    def encodes_pieces(self) -> bool:
        """Whether long texts are encoded as pieces side by side (the tokenizer allows it)."""
        return self._piece_template is not None

    def warm_up(self, barrier: threading.Barrier) -> None:
        """On one pool thread: make its tokenizer copy, encode, render the chat template."""
        barrier.wait()  # every thread takes one call: none does two while another idles
        self.encode("Hello, world!", "warm-up")
        if self.has_chat_template:
            self.chat([{"role": "user", "content": "Hello!"}])
            self.supports_tools()

    def encode(self, text: str, what: str = "prompt", add_special_tokens: bool = True,
               in_pieces: bool = False) -> list[int]:
        check_chars(len(text), self.limit_tokens, self.chars_per_token, what)
        tokenizer = self._tokenizer()
        probe = self.limit_tokens * PROBE_CHARS_PER_TOKEN
        if len(text) > probe:  # most over-long texts show it in their first few characters
            head = encode_text(tokenizer, text[:probe], allow_special=self.allow_special)
            if len(head) > self.limit_tokens + PROBE_SLACK:
                raise PromptTooLong(
                    f"{what} is longer than the context of {self.limit_tokens} tokens (its "
                    f"first {probe} characters alone are {len(head)} tokens)")
        return encode_text(tokenizer, text, allow_special=self.allow_special,
                           add_special_tokens=add_special_tokens,
                           pieces=self._local.pieces if in_pieces else None,
                           pretokens=self._local.pretokens)

    def chat(self, messages: list[dict[str, Any]], tools: list[dict] | None = None,
             template_kwargs: dict | None = None, in_pieces: bool = False) -> list[int]:
        num_chars = sum(len(m["content"]) for m in messages if isinstance(m.get("content"), str))
        check_chars(num_chars, self.limit_tokens, self.chars_per_token, "the messages' content")
        tokenizer = self._tokenizer()  # (and this thread's piece encoder)
        return chat_ids(tokenizer, messages, allow_special=self.allow_special,
                        tools=tools, template_kwargs=template_kwargs,
                        pieces=self._local.pieces if in_pieces else None,
                        pretokens=self._local.pretokens)

    def supports_tools(self) -> bool:
        """Whether the chat template shows the model its tools (computed once)."""
        if self._supports_tools is None:
            self._supports_tools = template_shows_tools(self._tokenizer())
        return self._supports_tools

    async def encode_async(self, text: str, what: str = "prompt",
                           add_special_tokens: bool = True, alone: bool = False) -> list[int]:
        check_chars(len(text), self.limit_tokens, self.chars_per_token, what)  # no thread hop
        if len(text) <= (IDLE_INLINE_MAX_CHARS if alone else INLINE_MAX_CHARS):
            return self.encode(text, what, add_special_tokens, in_pieces=True)
        return await asyncio.get_running_loop().run_in_executor(self._pool, self.encode, text,
                                                                what, add_special_tokens)

    async def chat_async(self, messages: list[dict[str, Any]], tools: list[dict] | None = None,
                         template_kwargs: dict | None = None, alone: bool = False) -> list[int]:
        num_chars = sum(len(m["content"]) for m in messages if isinstance(m.get("content"), str))
        inline_max = IDLE_INLINE_MAX_CHARS if alone else INLINE_MAX_CHARS
        if not tools and num_chars <= inline_max:  # (a tool's schema can be long)
            return self.chat(messages, tools, template_kwargs, in_pieces=True)
        return await asyncio.get_running_loop().run_in_executor(self._pool, self.chat, messages,
                                                                tools, template_kwargs)

    async def supports_tools_async(self) -> bool:
        if self._supports_tools is not None:
            return self._supports_tools
        return await asyncio.get_running_loop().run_in_executor(self._pool, self.supports_tools)

    async def warm_up_async(self) -> None:
        """Warm every pool thread and the calling event loop's own inline path (a copy of the
        tokenizer each costs ~0.1-0.5 s): the first requests then pay none of it."""
        barrier = threading.Barrier(self.num_threads, timeout=60)
        loop = asyncio.get_running_loop()
        await asyncio.gather(*(loop.run_in_executor(self._pool, self.warm_up, barrier)
                               for _ in range(self.num_threads)))
        self.warm_up(threading.Barrier(1))  # this thread's copy, made here, not by a request

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
