"""The `draft` proposer: a smaller model with the target's tokenizer guesses the next k tokens of
each speculating request, greedily, and the target checks them all in one verify step.

How the verify step uses it (speculative.py drives it through api.Proposer):
  1. Before a step, the engine calls `propose(requests, k)` for the requests that speculate in
     it (their newest token read: no placeholder of an overlapped step). Each gets up to k
     tokens d1..dk (fewer near the end of the context or of the draft's pool).
  2. In the step each such request has k + 1 query rows, its newest token and d1..dk, beside
     plain decodes and prefill chunks in the one ragged attention call; the target's logits
     at those rows say what it would emit at each position.
  3. Greedy: the longest prefix d1..da that agrees with the target's argmax is accepted, plus
     the target's own token after it. Sampled: rejection sampling with q one-hot at the draft's
     token (this proposer is greedy), so the output distribution stays the target's.
  4. `on_accepted(request, a)`: the draft keeps the K/V of the accepted prefix only (pages past
     it freed), so the next `propose` feeds just what the draft has not seen: the target's own
     token, and dk as well when all k were accepted (dk was proposed, never fed).
  5. `release(request)` once it finishes, is aborted or preempted.

One propose() is one catch-up forward (ragged: each request's tokens the draft has not seen,
a new request's whole prompt, chunked at the step budget; in the steady state one or two tokens
a request, each then sampled as a verify step's rows are, so the fused path runs it as decode
rows), whose last rows give d1, then k - 1
decode forwards of all requests together, each fed the previous step's tokens on the device: the
host reads the proposals once, at the end, and puts no host list on the device in between (that
copy would wait for the stream), so it queues each step while the device runs the one before.
On CUDA the decode steps replay the runner's graphs: the fused decode path's, taking the LM
head's argmax, where it applies to the draft (as auto decides for a target; off where the
target's is), else the per-op ones. The draft's K/V then cover the context and d1..d(k-1).

The draft's state corrects itself: `propose` compares the tokens whose K/V the draft holds with
the request's own and drops everything from the first difference on, so a request that
diverged (a missed on_accepted, a rewritten output) costs a recomputation, never a wrong
proposal. The K/V live in a pool of the draft's own shape (its layers and heads), in its own
page allocator; the runner is the engine's ModelRunner over the draft model.

Other proposers on the same interface:
- EAGLE-style heads (EAGLE-1/2/3): a one-layer decoder that predicts the target's next hidden
  state from a hidden state and the next token's embedding, with the target's embedding and LM
  head. It needs what this proposer does not: the target's hidden states at the verify step's
  accepted rows (EAGLE-3: several layers'), handed over by the engine in a hook beside
  on_accepted (e.g. `on_verified(request, num_accepted, hidden[rows])`). The head keeps its
  layer's K/V in a small pool as here; its catch-up feeds the accepted positions with the
  target's hidden states (not its own predictions there, which it drops as this proposer drops
  rejected K/V), then `propose` runs k steps of the head alone, each on the hidden state it
  predicted last; `on_accepted` truncates and `release` frees as here. Tree drafts (top-k
  branches a step) would also need a tree mask in the verify step: the interface returns one
  chain a request, so they are a later extension.
- MTP heads (DeepSeek-V3, Qwen3-Next, MiMo): layers shipped in the target's checkpoint that
  predict token t + 1 + d from the target's hidden state at t and the embedding of token t + d.
  They plug in as the EAGLE head does (the same hook, the same catch-up on the target's states,
  k steps reusing the one layer past its trained depth as vLLM does), with weights read from the
  target's checkpoint and its embedding and LM head shared. A head run inside the verify
  forward itself would spare propose's forwards: `propose` would return what the last verify
  step left for the request, `on_accepted` pick the accepted row's, `release` drop them.

At engine start, `warm_up()` compiles the draft's kernels and captures its graphs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple, Sequence

import numpy as np
import torch

from flashlet.config import EngineConfig
from flashlet.core.request import PLACEHOLDER, Request
from flashlet.kvcache.kv_pool import KVPool
from flashlet.models.model import ModelConfig
from flashlet.core import warmup
from flashlet.models.weights import PRESETS_DIR, model_config_path, model_from, ops_for
from flashlet.runner.model_runner import ModelRunner
from flashlet.spec.api import SpeculativeConfig

# The share of free GPU memory a draft's pool takes when the target's pool size is not given:
# a draft's K/V per token are a fraction of the target's, and the target's pool must keep its
# share whichever of the two is built first (the engine can pass num_pages instead).
DRAFT_GPU_MEMORY_FRACTION = 0.1

# The most tokens a request's steady catch-up feeds: the target's token, after dk when all k
# proposals were accepted (dk was proposed, never fed).
CATCH_UP_TOKENS = 2


def load_draft_model(source: str, target_config: EngineConfig, device: torch.device):
    """(the draft model, its tokenizer or None), by the engine's loaders: a folder, hub id or
    .gguf file (as --model), or a preset name or config.json path (random weights as --config,
    seeded with the target's weights_seed: the target's own preset is then the target itself)."""
    preset = source if (PRESETS_DIR / f"{source}.json").is_file() or source.endswith(".json") else None
    model, tokenizer, _folder = model_from(preset, source, device, target_config.resolved_dtype(),
                                           target_config.weights_seed,
                                           ops=ops_for(target_config, device))
    return model, tokenizer


def draft_runner_config(target_config: EngineConfig) -> EngineConfig:
    """The draft's runner: one device, and the fused decode path where auto finds it applies to
    the draft (off where the target's is). Its rows are sized as for a verify step of one
    proposal: a catch-up of two tokens a request (all k accepted: dk and the target's own)
    runs as two decode rows each where the fused path serves it (`_catch_up`)."""
    return target_config.replace(fused_decode=False if target_config.fused_decode is False else None,
                                 tensor_parallel_size=1,
                                 speculative_config=SpeculativeConfig("ngram", CATCH_UP_TOKENS - 1))


def target_vocab_size(target_config: EngineConfig) -> int:
    """The target's vocabulary size, from its config.json (no weights loaded)."""
    return ModelConfig.from_file(model_config_path(target_config)).vocab_size


def check_vocab(draft_vocab: int, target_vocab: int) -> None:
    """A draft may have fewer embedding rows than its target (Qwen2.5-0.5B pads its vocabulary
    to 151,936, Qwen2.5-7B to 152,064, with one tokenizer), never more: it could propose ids
    the target has no row for."""
    if draft_vocab > target_vocab:
        raise ValueError(f"speculative draft model: its vocabulary ({draft_vocab} tokens) is "
                         f"larger than the target's ({target_vocab} tokens); the draft must "
                         f"share the target's tokenizer")


def check_tokenizers(draft_tokenizer, target_tokenizer) -> None:
    """Refuse a draft whose tokenizer gives some token another id than the target's (its
    proposals would never be accepted); tokens only one of them has are fine."""
    if draft_tokenizer is None or target_tokenizer is None:
        return
    mine, theirs = draft_tokenizer.get_vocab(), target_tokenizer.get_vocab()
    differ = [t for t, i in mine.items() if theirs.get(t, i) != i]
    if differ:
        example = min(differ, key=mine.get)
        raise ValueError(f"speculative draft model: its tokenizer is not the target's: "
                         f"{len(differ)} tokens have other ids (e.g. {example!r}: "
                         f"{mine[example]} in the draft, {theirs[example]} in the target)")


@dataclass
class _DraftSequence:
    """What the draft holds for one request: its pages and the tokens whose K/V are in them."""

    row: int  # in the runner's batch
    request: Request | None = None  # the request whose tokens these are (ids are reused)
    page_ids: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    num_verified: int = 0  # leading token_ids known to be the request's own
    context_len: int = 0  # the request's tokens when it was last proposed for


@dataclass
class _Work:
    """One request's part of a propose() call."""

    seq: _DraftSequence
    feed: list[int]  # the request's tokens the draft has not computed (at least its newest)
    k: int  # proposals it gets


class _Chunk(NamedTuple):
    """Part of a request's catch-up feed in one step."""

    index: int  # the request's place in the propose() call
    token_ids: list[int]
    ends_feed: bool  # its last token is the request's newest: its logits give d1


class DraftProposer:
    """Proposes each request's next k tokens by greedy decoding on a draft model (module doc)."""

    def __init__(self, target_config: EngineConfig, spec: SpeculativeConfig,
                 device: torch.device | str | None = None, *, num_pages: int | None = None,
                 target_vocab: int | None = None, target_tokenizer=None):
        """device: the target's (default: target_config's). num_pages: the draft pool's size
        (default: `_default_num_pages`). target_vocab: the target's vocabulary size, if the
        caller has it (else read from the target's config.json). target_tokenizer: checked
        against the draft's, where both exist."""
        if spec.model is None:
            raise ValueError("speculative config: the draft method needs a `model` (a folder, "
                             "hub id, .gguf file or preset of the draft)")
        self.device = torch.device(device or target_config.resolved_device())
        self.model, tokenizer = load_draft_model(spec.model, target_config, self.device)
        cfg = self.model.config
        self.target_vocab = target_vocab or target_vocab_size(target_config)
        check_vocab(cfg.vocab_size, self.target_vocab)
        check_tokenizers(tokenizer, target_tokenizer)
        self.page_size = ps = target_config.page_size
        self.max_model_len = min(cfg.max_context_len,
                                 target_config.max_model_len or cfg.max_context_len)
        max_pages_per_seq = -(-self.max_model_len // ps)
        self.kv_pool = KVPool(cfg.num_layers,
                              num_pages or self._default_num_pages(target_config, spec),
                              ps, cfg.num_kv_heads, cfg.head_dim,
                              target_config.resolved_dtype(), self.device,
                              fused_rope=target_config.fused_ops and self.device.type == "cuda")
        self.runner_config = draft_runner_config(target_config)
        self.runner = ModelRunner(self.model, self.kv_pool, self.runner_config, self.device,
                                  max_pages_per_seq)
        self.batch = self.runner.batch
        self.max_step_tokens = target_config.max_num_batched_tokens
        self._sequences: dict[int, _DraftSequence] = {}  # request id -> its draft state

    def _default_num_pages(self, c: EngineConfig, spec: SpeculativeConfig) -> int:
        """Every sequence at full length at most; within that, the target's page count plus
        room for k proposals a sequence where the target's is given, else a memory budget."""
        cfg, ps = self.model.config, c.page_size
        cap = c.max_num_seqs * -(-self.max_model_len // ps)
        if c.max_num_pages is not None:
            proposals = c.max_num_seqs * -(-spec.num_speculative_tokens // ps)
            return min(cap, c.max_num_pages + proposals)
        per_page = KVPool.bytes_per_page(cfg.num_layers, ps, cfg.num_kv_heads, cfg.head_dim,
                                         c.resolved_dtype())
        if self.device.type == "cuda":
            budget = torch.cuda.mem_get_info(self.device)[0] * DRAFT_GPU_MEMORY_FRACTION
        else:
            budget = c.kv_memory_gb * 2**30
        return max(1, min(int(budget // per_page), cap))

    @torch.inference_mode()
    def warm_up(self) -> int:
        """Compile the draft's kernel variants and capture its CUDA graphs now rather than in
        the first requests: one synthetic step per variant on the pool's scratch page, as the
        engine's warm-up (flashlet/core/warmup.py) does for the target. Returns the graphs held."""
        runner, max_seqs = self.runner, self.runner_config.max_num_seqs
        max_chunk = min(self.max_step_tokens, self.max_model_len)
        mixed = warmup.mixed_graph_steps(runner, max_chunk, max_seqs, self.max_model_len)
        for q_len, context in [] if mixed else warmup.eager_chunk_steps(runner, max_chunk, self.max_model_len):
            runner.forward(*runner.load(self._synthetic(1, q_len, context)))
        for size in warmup.decode_sizes(runner, max_seqs):
            runner.forward(*runner.load(self._synthetic(size, 1)))
        # the greedy-token graphs: the fused path's (decodes, and catch-ups as decode rows),
        # then the per-op decode sizes'
        fused = list(runner.fused.row_counts) if runner.fused is not None else []
        for size in fused + [s for s in runner.greedy_token_sizes() if s not in fused]:
            runner.greedy_tokens(*runner.load(self._synthetic(size, 1)))
        for bucket, q_len, context in reversed(mixed):  # the largest first: the rest reuse its memory
            runner.forward(*runner.load(self._synthetic(1, q_len, context), token_bucket=bucket))
        return len(runner.graphs)

    def _synthetic(self, num_seqs: int, q_len: int, context: int = 0):
        return warmup.synthetic_layout(num_seqs, q_len, self.kv_pool, self.model.config.vocab_size, context)

    # ---- the Proposer interface -----------------------------------------------------------
    @torch.inference_mode()
    def propose(self, requests: Sequence[Request], k: int) -> list[list[int]]:
        """Up to k greedy draft tokens per request (none where the context or the pool is full)."""
        self._check(requests, k)
        work = [self._prepare(req, k) for req in requests]
        todo = [w for w in work if w is not None]
        proposed = iter(self._run(todo) if todo else [])
        return [next(proposed) if w is not None else [] for w in work]

    def on_accepted(self, request: Request, num_accepted: int) -> None:
        """Keep the draft's K/V of the context and the accepted proposals; free the rest."""
        if num_accepted < 0:
            raise ValueError(f"num_accepted must be >= 0, got {num_accepted}")
        seq = self._sequences.get(request.request_id)
        if seq is not None:
            self._truncate(seq, min(len(seq.token_ids), seq.context_len + num_accepted))

    def release(self, request: Request) -> None:
        """Free every draft page of the request (a no-op for one the draft never saw)."""
        seq = self._sequences.pop(request.request_id, None)
        if seq is not None:
            self.kv_pool.allocator.free(seq.page_ids)
            self.batch.remove(request.request_id)

    # ---- state -----------------------------------------------------------------------------
    @property
    def num_free_pages(self) -> int:
        return self.kv_pool.allocator.num_free

    def num_tokens_held(self, request: Request) -> int:
        """Tokens of the request whose K/V the draft holds (0 if none)."""
        seq = self._sequences.get(request.request_id)
        return len(seq.token_ids) if seq is not None else 0

    def check_integrity(self) -> None:
        """Every page is free or held by exactly one request, whose page table covers its tokens."""
        held = [p for seq in self._sequences.values() for p in seq.page_ids]
        assert len(held) == len(set(held)), "a draft page is held twice"
        free = self.kv_pool.allocator.free_pages()
        assert not free & set(held), "a free draft page is held by a request"
        assert len(free) + len(held) == self.kv_pool.num_pages, "a draft page leaked"
        for request_id, seq in self._sequences.items():
            assert len(seq.page_ids) >= self._pages_for(len(seq.token_ids)), request_id
            assert self.batch.pages_of(request_id) == seq.page_ids, request_id
            assert seq.num_verified <= len(seq.token_ids), request_id

    # ---- one propose() call ------------------------------------------------------------------
    def _check(self, requests: Sequence[Request], k: int) -> None:
        """Refuse a call that cannot be served, before any state changes."""
        if k < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {k}")
        if len({req.request_id for req in requests}) < len(requests):
            raise ValueError("propose: a request id appears twice in one call")
        for req in requests:
            if req.output_token_ids and req.output_token_ids[-1] == PLACEHOLDER:
                raise ValueError(f"request {req.request_id}: its newest token is still on the "
                                 f"device (an overlapped step): read it before proposing")

    def _prepare(self, req: Request, k: int) -> _Work | None:
        """Sync the draft's state with the request, reserve pages for its proposals -> its work,
        or None where it gets no proposal (context or pool full)."""
        n = req.num_tokens
        seq = self._sequences.get(req.request_id)
        if seq is None:
            seq = _DraftSequence(self.batch.add(req.request_id, []))
            self._sequences[req.request_id] = seq
        if seq.request is not req:  # a new request under a released (or never released) id
            seq.request, seq.num_verified = req, 0
        self._sync(seq, req)
        seq.context_len = n  # so an on_accepted after no proposal keeps all it holds
        # The draft's K/V reach position n + k - 2 (d(k-1)'s): in the context and the pool.
        k = min(k, self.max_model_len - n + 1, self._room(seq) - n + 1)
        if k < 1:
            return None
        self._grow(seq, n + k - 1)
        return _Work(seq, req.token_slice(len(seq.token_ids), n), k)

    def _sync(self, seq: _DraftSequence, req: Request) -> None:
        """Drop the draft's tokens from the first that differs from the request's on, and its
        newest token in any case: its logits give the first proposal."""
        same, end = seq.num_verified, min(len(seq.token_ids), req.num_tokens)
        if same < end:
            for mine, theirs in zip(seq.token_ids[same:end], req.token_slice(same, end)):
                if mine != theirs:
                    break
                same += 1
        self._truncate(seq, min(same, req.num_tokens - 1))

    def _room(self, seq: _DraftSequence) -> int:
        """Tokens the sequence could hold with every free page."""
        return (len(seq.page_ids) + self.kv_pool.allocator.num_free) * self.page_size

    def _pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def _grow(self, seq: _DraftSequence, num_tokens: int) -> None:
        """Pages for num_tokens tokens."""
        more = self._pages_for(num_tokens) - len(seq.page_ids)
        if more > 0:
            first = len(seq.page_ids)
            seq.page_ids += self.kv_pool.allocator.allocate(more)
            self.batch.set_pages(seq.row, first, seq.page_ids[first:])

    def _truncate(self, seq: _DraftSequence, num_tokens: int) -> None:
        """Keep the K/V of the first num_tokens tokens; free the pages past them."""
        del seq.token_ids[num_tokens:]
        seq.num_verified = min(seq.num_verified, num_tokens)
        keep = self._pages_for(num_tokens)
        if keep < len(seq.page_ids):
            self.kv_pool.allocator.free(seq.page_ids[keep:])
            del seq.page_ids[keep:]
            self.batch.set_pages(seq.row, 0, seq.page_ids)

    def _run(self, work: list[_Work]) -> list[list[int]]:
        """The catch-up forward(s), then k - 1 decode forwards -> each request's proposals."""
        # Each step's tokens copied out on the device as it goes: a fused step's greedy tokens
        # are its graph's output buffer, which the next step of that size writes again.
        tokens, at = self._catch_up(work)  # d1 of work[i] is tokens[at[i]]
        kept, whose = [tokens.clone()], []  # each step's tokens; each decode step's requests
        for j in range(1, max(w.k for w in work)):
            whose.append([w for w in work if w.k > j])
            tokens = self._decode_step(whose[-1], j, tokens)  # [len(whose[-1])] on the device
            kept.append(tokens.clone())
        values = torch.cat(kept).tolist()  # the one read
        proposals = {id(w): [values[i]] for w, i in zip(work, at)}
        later = iter(values[len(kept[0]):])
        for active in whose:
            for w in active:
                proposals[id(w)].append(next(later))
        for w in work:  # d1..d(k-1) were fed: their K/V are in the draft's pool
            w.seq.token_ids += proposals[id(w)][: w.k - 1]
        return [proposals[id(w)] for w in work]

    def _decode_step(self, active: list[_Work], j: int, previous: torch.Tensor) -> torch.Tensor:
        """One greedy decode forward of the active requests, each fed its d_j from `previous`
        (the last step's tokens, on the device) -> their d_(j+1) [len(active)]."""
        rows = self._rows_of(active)
        starts = [w.seq.context_len + j - 1 for w in active]  # d_j's position
        layout = self.batch.layout(rows, starts, [PLACEHOLDER] * len(active))
        self.batch.sample_index[rows] = np.arange(len(active))  # where the next step's feed is
        return self._greedy(*self.runner.load(layout, previous))

    def _greedy(self, input_ids: torch.Tensor, meta) -> torch.Tensor:
        """A loaded step's greedy tokens, left on the device: from the fused path's LM-head
        argmax where it serves the step (its greedy-token graph), else the logits' argmax."""
        tokens = self.runner.greedy_tokens(input_ids, meta)
        return tokens if tokens is not None else self.runner.forward(input_ids, meta).argmax(dim=-1)

    def _rows_of(self, work: list[_Work]) -> np.ndarray:
        return np.array([w.seq.row for w in work], np.int64)

    def _catch_up(self, work: list[_Work]) -> tuple[torch.Tensor, list[int]]:
        """Forward each request's unseen tokens, in chunks of the step budget -> (greedy tokens
        on the device, where each request's d1, the token after its newest, is in them)."""
        if self._short_feeds(work):  # the steady state: each token a decode row, all fused
            chunks = [_Chunk(i, w.feed, True) for i, w in enumerate(work)]
            tokens = self._forward_chunks(work, chunks, every_token=True)
            at = np.cumsum([len(w.feed) for w in work]) - 1  # each feed's last row
            self.batch.sample_index[self._rows_of(work)] = at
            return tokens, at.tolist()
        first, pending = None, list(range(len(work)))
        while pending:
            chunks = self._next_chunks(work, pending)
            sampled = self._forward_chunks(work, chunks)
            ends = [c.index for c in chunks if c.ends_feed]
            if len(ends) == len(work):  # every feed in one step: in order
                first = sampled
            elif ends:
                if first is None:
                    first = torch.empty(len(work), dtype=torch.int64, device=self.device)
                # A host list copied to the device waits for the stream (pageable memory):
                # only a catch-up of several steps (a long feed) pays it.
                first.index_copy_(0, torch.tensor(ends, device=self.device), sampled)
            ended = set(ends)
            pending = [i for i in pending if i not in ended]
        self.batch.sample_index[self._rows_of(work)] = np.arange(len(work))  # first's order
        return first, list(range(len(work)))

    def _short_feeds(self, work: list[_Work]) -> bool:
        """Do the feeds fit one fused step as decode rows (no feed of more than a steady
        catch-up's tokens, and at most the fused path's rows in all)?"""
        fused = self.runner.fused
        return (fused is not None and all(len(w.feed) <= CATCH_UP_TOKENS for w in work)
                and sum(len(w.feed) for w in work) <= fused.max_rows)

    def _next_chunks(self, work: list[_Work], pending: list[int]) -> list["_Chunk"]:
        """The pending feeds' next chunks, in order, within one step's token budget."""
        budget, chunks = self.max_step_tokens, []
        for i in pending:
            w = work[i]
            done = len(w.seq.token_ids) - (w.seq.context_len - len(w.feed))  # fed already
            size = min(len(w.feed) - done, budget)
            if size < 1:
                break
            chunks.append(_Chunk(i, w.feed[done : done + size], done + size == len(w.feed)))
            budget -= size
        return chunks

    def _forward_chunks(self, work: list[_Work], chunks: list["_Chunk"],
                        every_token: bool = False) -> torch.Tensor:
        """One ragged forward of these chunks -> the greedy tokens of those that end their
        request's feed, in order (every_token: of every token, as a verify step's rows are
        taken, so a step of a few tokens runs as decode rows on the fused path)."""
        seqs = [work[c.index].seq for c in chunks]
        token_ids = [t for c in chunks for t in c.token_ids]
        if self.model.config.vocab_size < self.target_vocab:
            token_ids = self._embeddable(token_ids)
        lens = [len(c.token_ids) for c in chunks]
        layout = self.batch.layout(
            np.array([s.row for s in seqs], np.int64), [len(s.token_ids) for s in seqs],
            token_ids, lens, [c.ends_feed for c in chunks],
            [n - 1 for n in lens] if every_token else None)
        for seq, chunk in zip(seqs, chunks):
            seq.token_ids += chunk.token_ids
            seq.num_verified = len(seq.token_ids)
        return self._greedy(*self.runner.load(layout))

    def _embeddable(self, token_ids: list[int]) -> list[int]:
        """A target token past a narrower draft's rows (a padding id, which trained targets
        all but never sample) goes in as id 0: the draft's guesses after it get worse, while
        verification keeps the output exact."""
        rows = self.model.config.vocab_size
        return [t if t < rows else 0 for t in token_ids]
