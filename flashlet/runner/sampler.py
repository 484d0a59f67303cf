"""The batched sampler: one step's logits [rows, vocab] -> one token per row, on the device.

The order is vLLM's: the model's logits -> their logprobs (kept for rows that ask) -> grammar
mask (structured output) -> min_tokens mask (not where a grammar allows only the stop tokens:
its output is complete, and the format's end wins) -> repetition, frequency and presence penalties ->
greedy rows take the argmax; sampled rows go through temperature -> min_p -> top-k -> top-p and
an exponential race: token = argmax(probs / E) with E ~ Exp(1) i.i.d., which picks token i with
probability probs[i] (the Gumbel-max trick in another form), so one batched draw of noise serves
every row. On the torch path a request with a seed draws its row of noise from its own
torch.Generator (the one per-row step), so its tokens do not depend on what else is in the batch.

Logprobs follow vLLM's default (`logprobs_mode="raw_logprobs"`): the log-softmax of the model's
logits, before the grammar, penalties, temperature and top-k/top-p, so they say what the model
thinks, not what the sampler was allowed to pick. The chosen token's logprob is the model's
logprob of the token that was actually sampled.

Penalties (vLLM / OpenAI semantics): the repetition penalty applies to every token seen in the
prompt or the output (a positive logit is divided by it, a negative one multiplied), then
`frequency_penalty * count` and `presence_penalty * (count > 0)` are subtracted, counting output
tokens only. They change only the logits of tokens already seen, so they are applied sparsely:
each penalised request has a row of seen token ids (its prompt, then each sampled token) and a
row of output counts on the device, both updated from the sampled token tensor right after
sampling: no host round trip, so an overlapped step (which runs before the host has read the
previous tokens) already sees them.

On CUDA the sampled rows go through one Triton kernel (flashlet/kernels/sampling.py): sort-free
and exact for temperature, min_p, top_k and top_p, its noise from Philox keyed per row, so a
seeded request's noise depends only on its seed and output position; the penalties and the
count update are one small Triton kernel each. The torch code here is the CPU path and the
reference the tests hold the kernels to.

Per-batch state: what the rows need on the device (sampling parameters, penalty values and
rows, the row lists) is built when the step's sampling rows in the model runner's persistent
batch (batch.InputBatch) differ from the last step's (another row, another order, or a row
that changed hands: the batch's version) and reused otherwise, so a steady decode batch runs no
per-row Python: three launches a sampled step with penalties. It is built from the batch's
sampling columns (sampling.SamplingColumns: each row's parameters, written when a request takes
the row) sliced at the step's sampled rows, in numpy calls rather than a loop over requests;
a request is read only for what is not a parameter (a new penalty row's seen tokens, a grammar,
a torch generator). The penalty state has a row per batch row, set up afresh from a request's
prompt and known output when a new request holds the row (nothing to release when one leaves).
A seeded row's output position lives in the state on the device and the kernel advances it as
it samples (the batch's output index of each sampled position seeds it when the state is
rebuilt); unseeded rows mix a random seed drawn on the host each step with their row. Called
without a batch (tests, tools), the rows are the requests' places in the call and the state is
built every call, from the requests' parameters.

The sampler writes into the logits it is given (grammar and min_tokens masks, penalties) rather
than copying them: the engine reads the runner's logits buffer only before sampling (observers,
and the raw logprobs, computed here first).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from flashlet.core.sampling import SamplingColumns, TokenLogprob
from flashlet.text.structured import apply_grammar_masks


@dataclass
class SamplerOutput:
    tokens: torch.Tensor  # [rows] int64 on the device
    errors: dict[int, Exception]  # row -> why its request's sampling failed (the rest go on)
    logprobs: "StepLogprobs | None"  # for rows that asked; readable once the step's copy is done
    constrained: bool = False  # a row's grammar masked its logits (the engine reads its tokens
    # before it schedules the next step; see structured.py)


@dataclass
class BatchState:
    """What one batch of requests (these, in this order) needs each step: the host's row
    lists and the device's parameter tensors. Built when the batch changes, then reused step
    after step (a steady decode batch runs no per-row Python); what changes every step (a
    seeded row's output position) is kept and advanced on the device. A plain greedy batch
    needs nothing but the flag."""
    key: tuple | None  # (the batch's version, its sampling rows); None: not to be reused
    plain_greedy: bool  # nothing to apply: the argmax is the token
    lp_rows: list[int] = field(default_factory=list)  # rows that asked for logprobs,
    lp_ks: list[int] = field(default_factory=list)  # how many top ones each,
    lp_index: torch.Tensor | None = None  # and lp_rows on the device
    constrained: bool = False  # a row has a grammar
    early_stop_rows: list[int] = field(default_factory=list)  # rows with a min_tokens
    bias_index: torch.Tensor | None = None  # [E] int64: row * vocab + token of each logit_bias entry
    bias_values: torch.Tensor | None = None  # [E] fp32: its bias
    penalised: list[int] = field(default_factory=list)
    pen_rows: torch.Tensor | None = None  # [P] int64, and their penalty slots [P]
    pen_slots: torch.Tensor | None = None
    pen_values: torch.Tensor | None = None  # [P, 3] fp32: presence, frequency, repetition
    random_rows: list[int] = field(default_factory=list)
    random_index: torch.Tensor | None = None  # [R] int64
    columns: torch.Tensor | None = None  # [R, 4] fp32: temperature, top_k, top_p, min_p
    noise_ids: torch.Tensor | None = None  # [R, 3] int64 (kernel path): row, seed, position
    use_min_p: bool = False
    use_top: bool = False
    generator_rows: list[int] = field(default_factory=list)  # own torch.Generator (torch path)


class Sampler:
    def __init__(self, device: torch.device, eos_token_ids: set[int],
                 use_kernel: bool | None = None):
        self.device = device
        self.eos_token_ids = sorted(eos_token_ids)
        # The Triton kernel samples on CUDA (tests run it on the CPU through the interpreter).
        self.use_kernel = device.type == "cuda" if use_kernel is None else use_kernel
        # Penalty state, allocated when the first penalised request samples; one row a batch row.
        self.counts: torch.Tensor | None = None  # [rows, vocab] int32: output tokens so far
        self.seen_ids: torch.Tensor | None = None  # [rows, capacity] int64: prompt, then output
        self.seen_lens: torch.Tensor | None = None  # [rows] int64: filled entries of seen_ids
        self.row_owner: dict[int, object] = {}  # penalty row -> whose state it holds
        self.state: BatchState | None = None  # the last step's batch

    def forget(self) -> None:
        """Drop the batch state and the penalty rows' owners, so the next step rebuilds them
        from the requests' tokens: after a step whose tokens were chosen elsewhere (a
        speculative verify step), which the device state did not see."""
        self.state = None
        self.row_owner.clear()

    # ---- one step ---------------------------------------------------------------------------
    def sample(self, logits: torch.Tensor, reqs: list, batch=None) -> SamplerOutput:
        """logits [len(reqs), vocab] (fp32, written into) -> a token per request (see the
        module docstring). batch: the runner's InputBatch, whose sampling_rows hold reqs."""
        state = self.batch_state(reqs, logits.shape[1], batch)
        if state.plain_greedy:  # the common greedy case: nothing to apply
            # (reading the logits needs no inference mode, whose entry costs ~4 us a step)
            return SamplerOutput(argmax_rows(logits), {}, None)
        return self._sample(logits, reqs, state)

    @torch.inference_mode()  # the runner's logits are inference tensors, written into here
    def _sample(self, logits: torch.Tensor, reqs: list, state: BatchState) -> SamplerOutput:
        errors: dict[int, Exception] = {}
        raw_logprobs = (torch.log_softmax(logits[state.lp_index], dim=-1)
                        if state.lp_rows else None)
        if state.constrained:
            apply_grammar_masks(logits, reqs, errors)
        if state.early_stop_rows:
            self._mask_early_stops(logits, reqs, state.early_stop_rows)
        if state.bias_index is not None:  # logit_bias: one flat add (atomics, no sort)
            logits.view(-1).index_add_(0, state.bias_index, state.bias_values)
        if state.penalised:
            self._apply_penalties(logits, state)
        tokens = self._draw_all(logits, reqs, state, errors)
        if state.penalised:
            self._count(state, tokens)
        logprobs = None
        if state.lp_rows:
            logprobs = StepLogprobs(state.lp_rows, state.lp_ks, raw_logprobs,
                                    tokens[state.lp_index])
        return SamplerOutput(tokens, errors, logprobs, state.constrained)

    def warm_up(self, vocab: int, max_seen: int = 0) -> None:
        """Compile the sampling kernels (where they are used) before the first request needs
        them; max_seen: the most seen ids (prompt + output) a penalised request can have, which
        bounds the penalty kernel's variants (one per power-of-2 block)."""
        if self.use_kernel:
            from flashlet.kernels.sampling import (MAX_SEEN_BLOCK, MIN_SEEN_BLOCK, STEP_SEEDS,
                                                   penalise_block, penalise_rows, record_rows,
                                                   sample_rows)

            logits = torch.randn(2, vocab, device=self.device)
            params = torch.tensor([[0.8, 20, 0.9, 0.05]] * 2, device=self.device)
            ids = torch.tensor([[0, 1, 0], [1, 0, -1]], dtype=torch.int64, device=self.device)
            tokens = torch.empty(2, dtype=torch.int64, device=self.device)
            sample_rows(logits, params, ids, tokens, step_seed=STEP_SEEDS[0])
            # The count update too, and the penalty kernel at every block a request can need.
            rows = torch.arange(2, device=self.device)
            counts = torch.zeros(2, vocab, dtype=torch.int32, device=self.device)
            lens = torch.zeros(2, dtype=torch.int64, device=self.device)
            record_rows(tokens, rows, rows, counts,
                        torch.zeros(2, 4, dtype=torch.int64, device=self.device), lens)
            values = torch.tensor([[0.5, 0.5, 1.1]] * 2, device=self.device)
            block = MIN_SEEN_BLOCK
            while block <= penalise_block(min(max(max_seen, 1), MAX_SEEN_BLOCK)):
                seen = torch.zeros(2, block, dtype=torch.int64, device=self.device)
                penalise_rows(logits, rows, rows, values, seen, lens, counts)
                block *= 2

    # ---- the batch's state ------------------------------------------------------------------
    def batch_state(self, reqs: list, vocab: int, batch=None) -> BatchState:
        """The state of this batch: the last step's when its sampling rows are the same rows of
        the same batch version (the same requests, in the same order); else a new one, built
        from the batch's sampling columns (one pinned copy to the device). Without a batch, a
        new one every call, from the requests' parameters."""
        if batch is None:
            columns = SamplingColumns.of([req.params for req in reqs])
            output_index = np.array([len(req.output_token_ids) for req in reqs], np.int64)
            owners = [("request", req.request_id) for req in reqs]
            self.state = self._build_state(reqs, vocab, None, columns, output_index,
                                           list(range(len(reqs))), owners)
            return self.state
        key = (batch.version, batch.sampling_rows)
        last = self.state
        if last is None or last.key != key:
            rows = batch.sampled_rows
            self.state = self._build_state(reqs, vocab, key, batch.sampling.take(rows),
                                           batch.sampled_output_index, batch.sampling_rows,
                                           batch.added_at[rows].tolist())
        return self.state

    def _build_state(self, reqs: list, vocab: int, key: tuple | None, columns: SamplingColumns,
                     output_index: np.ndarray, rows: list[int], owners: list) -> BatchState:
        """columns: the parameters at each sampled position; output_index: the output token
        each samples; rows: each one's penalty row; owners: who holds each row (a row whose
        owner changed starts its penalty state afresh). Requests are read only for what is
        not a parameter: a new penalty row's seen tokens, a seeded row's torch generator."""
        if columns.plain_greedy().all():
            return BatchState(key, plain_greedy=True)
        lp_rows = np.flatnonzero(columns.logprobs >= 0)
        penalised = np.flatnonzero(columns.penalised).tolist()
        random_rows = np.flatnonzero(~columns.greedy)
        sample = columns.sample[random_rows]  # [R, 4]: temperature, top_k, top_p, min_p
        seeded = columns.seeded[random_rows]
        uploads = Uploads()
        lp_index = uploads.ints(lp_rows)
        pen_rows = uploads.ints(penalised)
        pen_slots = uploads.ints([self._penalty_row(rows[i], owners[i], reqs[i], vocab)
                                  for i in penalised])
        pen_values = uploads.floats(columns.penalties[penalised])
        random_index = uploads.ints(random_rows)
        uploaded_sample = uploads.floats(sample)
        # logit_bias: each entry's flat position in the logits, and its bias
        bias = [(i * vocab + t, b) for i in np.flatnonzero(columns.biased).tolist()
                for t, b in reqs[i].params.logit_bias.items()]
        bias_index = uploads.ints([e for e, _ in bias]) if bias else None
        bias_values = uploads.floats([b for _, b in bias]) if bias else None
        # A seeded row's noise: (its seed, its output position); position -1: unseeded. (The
        # seed as the int64 of its low 64 bits: the kernel mixes the bits as uint64, as the
        # host reference masks them.)
        noise_ids = uploads.ints(np.stack([
            random_rows, np.where(seeded, columns.seed[random_rows], 0),
            np.where(seeded, output_index[random_rows], -1)], axis=1))
        uploads.send(self.device)
        random_rows = random_rows.tolist()
        return BatchState(
            key, plain_greedy=False, lp_rows=lp_rows.tolist(),
            lp_ks=columns.logprobs[lp_rows].tolist(), lp_index=lp_index.get(),
            constrained=bool(columns.constrained.any()),
            early_stop_rows=np.flatnonzero(columns.min_tokens > 0).tolist(),
            bias_index=bias_index.get() if bias else None, bias_values=bias_values.get() if bias else None,
            penalised=penalised, pen_rows=pen_rows.get(), pen_slots=pen_slots.get(),
            pen_values=pen_values.get().view(-1, 3),
            random_rows=random_rows, random_index=random_index.get(),
            columns=uploaded_sample.get().view(-1, 4), noise_ids=noise_ids.get().view(-1, 3),
            use_min_p=bool((sample[:, 3] > 0).any()),
            use_top=bool(((sample[:, 1] > 0) | (sample[:, 2] < 1)).any()),
            generator_rows=[i for i, s in zip(random_rows, seeded.tolist())
                            if s and reqs[i].generator is not None])

    # ---- the pieces -------------------------------------------------------------------------
    def _mask_early_stops(self, logits: torch.Tensor, reqs: list, candidates: list[int]) -> None:
        """Rows short of min_tokens may not sample EOS or a stop token id, unless a grammar
        allows nothing else there (`ban_early_stops`)."""
        plain, constrained = ([], []), ([], [])
        for i in candidates:
            req = reqs[i]
            p = req.params
            if len(req.output_token_ids) < p.min_tokens:
                banned = p.early_stop_ids(self.eos_token_ids)
                rows, ids = constrained if req.grammar is not None else plain
                rows += [i] * len(banned)
                ids += banned
        if plain[0]:
            logits[self._index(plain[0]), self._index(plain[1])] = float("-inf")
        if constrained[0]:
            ban_early_stops(logits, self._index(constrained[0]), self._index(constrained[1]))

    def _apply_penalties(self, logits: torch.Tensor, state: BatchState) -> None:
        """In place, on the seen tokens of each penalised row only."""
        if self.use_kernel and self.seen_ids.shape[1] <= _max_seen_block():
            from flashlet.kernels.sampling import penalise_rows

            penalise_rows(logits, state.pen_rows, state.pen_slots, state.pen_values,
                          self.seen_ids, self.seen_lens, self.counts)
            return
        slots, values = state.pen_slots, state.pen_values
        seen = self.seen_ids[slots]  # [P, capacity]
        filled = torch.arange(seen.shape[1], device=self.device) < self.seen_lens[slots, None]
        seen = torch.where(filled, seen, seen[:, :1])  # unfilled entries repeat the first id
        seen_counts = self.counts[slots.unsqueeze(1), seen]
        penalise_seen(logits, state.pen_rows, seen, seen_counts, self.seen_lens[slots] > 0,
                      values[:, 0], values[:, 1], values[:, 2])

    def _count(self, state: BatchState, tokens: torch.Tensor) -> None:
        """Add each penalised row's sampled token to its counts and seen ids, on the device."""
        if self.use_kernel:
            from flashlet.kernels.sampling import record_rows

            record_rows(tokens, state.pen_rows, state.pen_slots, self.counts, self.seen_ids,
                        self.seen_lens)
            return
        self._record(state.pen_slots, tokens[state.pen_rows])

    def _record(self, slots: torch.Tensor, chosen: torch.Tensor) -> None:
        """Penalty rows `slots` [P] output one more token each, chosen [P] (device tensors)."""
        # Flat index_add_ / index_copy_ (atomics, one launch each), not index_put_ (which sorts).
        ones = torch.ones(slots.shape[0], dtype=self.counts.dtype, device=self.device)
        self.counts.view(-1).index_add_(0, slots * self.counts.shape[1] + chosen, ones)
        end = self.seen_lens[slots].clamp(max=self.seen_ids.shape[1] - 1)  # full: never, see _penalty_row
        self.seen_ids.view(-1).index_copy_(0, slots * self.seen_ids.shape[1] + end, chosen)
        self.seen_lens.index_add_(0, slots, torch.ones_like(end))

    def _draw_all(self, logits: torch.Tensor, reqs: list, state: BatchState,
                  errors: dict) -> torch.Tensor:
        """Tokens [rows]: greedy rows take the argmax, random rows are sampled."""
        every_row = len(state.random_rows) == len(reqs)
        if self.use_kernel:
            if every_row:
                tokens = torch.empty(len(reqs), dtype=torch.int64, device=logits.device)
            else:
                tokens = argmax_rows(logits)
            self._draw_kernel(logits, state, tokens)
            return tokens
        if every_row:
            return self._draw(logits, reqs, state, errors)
        tokens = argmax_rows(logits)
        if state.random_rows:
            rows = state.random_index
            tokens.index_copy_(0, rows, self._draw(logits[rows], reqs, state, errors))
        return tokens

    def _draw_kernel(self, logits: torch.Tensor, state: BatchState, tokens: torch.Tensor) -> None:
        """Sample the batch's random rows of logits into tokens with the Triton kernel; it
        advances the seeded rows' positions."""
        if not state.random_rows:
            return
        # Imported here: whether Triton interprets is fixed at import (tests/kernels/conftest.py).
        from flashlet.kernels.sampling import STEP_SEEDS, sample_rows

        step_seed = int(torch.randint(*STEP_SEEDS, (1,)))  # the unseeded rows' noise, this step
        sample_rows(logits, state.columns, state.noise_ids, tokens, step_seed=step_seed)

    def _draw(self, logits: torch.Tensor, reqs: list, state: BatchState,
              errors: dict) -> torch.Tensor:
        """Sample the batch's random rows (logits [len(random_rows), vocab]) -> their tokens,
        in torch."""
        temperature, top_k, top_p, min_p = state.columns.unbind(1)
        probs = sampling_probs(logits, temperature, top_k, top_p, min_p,
                               use_min_p=state.use_min_p, use_top=state.use_top)
        noise = torch.empty_like(probs).exponential_()
        position = {i: j for j, i in enumerate(state.random_rows)}
        for i in state.generator_rows:
            try:
                seeded_noise(noise[position[i]], reqs[i].generator)
            except Exception as e:  # one bad request must not fail the batch
                errors[i] = e
        return exponential_race(probs, noise)

    def _penalty_row(self, row: int, owner, req, vocab: int) -> int:
        """Penalty row `row`, set up from `req`'s prompt and known output unless it holds
        `owner`'s state already."""
        if self.row_owner.get(row) == owner:
            return row
        prompt = req.prompt_token_ids
        # Room for every token it can output (+1: an overlapped step may sample one past a stop).
        need = len(prompt) + len(req.output_token_ids) + req.params.max_new_tokens + 1
        if (self.seen_ids is None or row >= self.seen_ids.shape[0]
                or need > self.seen_ids.shape[1]):
            self._grow(vocab, row + 1, need)
        self.row_owner[row] = owner
        self.counts[row] = 0
        known = [t for t in req.output_token_ids if t >= 0]  # sampled before it was penalised
        self.seen_ids[row, : len(prompt) + len(known)] = self._index(prompt + known)
        self.seen_lens[row] = len(prompt) + len(known)
        if known:
            self.counts[row].index_put_((self._index(known),),
                                        torch.ones(len(known), dtype=torch.int32,
                                                   device=self.device), accumulate=True)
        return row

    def _grow(self, vocab: int, rows: int, capacity: int) -> None:
        """At least `rows` rows and `capacity` seen ids a row (doubling the rows)."""
        old = 0 if self.counts is None else self.counts.shape[0]
        new = max(8, 2 * old, rows) if rows > old else old
        capacity = max(capacity, 0 if self.seen_ids is None else self.seen_ids.shape[1])
        counts = torch.zeros(new, vocab, dtype=torch.int32, device=self.device)
        seen = torch.zeros(new, capacity, dtype=torch.int64, device=self.device)
        lens = torch.zeros(new, dtype=torch.int64, device=self.device)
        if old:
            counts[:old], lens[:old] = self.counts, self.seen_lens
            seen[:old, : self.seen_ids.shape[1]] = self.seen_ids
        self.counts, self.seen_ids, self.seen_lens = counts, seen, lens

    def _index(self, values: list) -> torch.Tensor:
        return self._tensor(values, torch.int64)

    def _tensor(self, values: list, dtype: torch.dtype) -> torch.Tensor:
        """Host values -> a device tensor, without waiting for the device (a copy from pinned
        memory is queued; one from pageable memory would stall the overlap)."""
        host = torch.tensor(values, dtype=dtype)
        if self.device.type != "cuda":
            return host
        return host.pin_memory().to(self.device, non_blocking=True)


class Uploads:
    """Host lists packed into one int64 tensor and sent to the device in one pinned copy; each
    `ints`/`floats` call gives a handle whose `get()` is its part (flat) once `send` ran."""

    def __init__(self):
        self.parts: list[torch.Tensor] = []
        self.device_buffer: torch.Tensor | None = None

    def ints(self, values) -> "_Part":
        """values: a list or a numpy array, of any shape (flattened)."""
        return self._add(torch.as_tensor(np.asarray(values, np.int64)).view(-1), torch.int64)

    def floats(self, values) -> "_Part":
        flat = torch.as_tensor(np.asarray(values, np.float32)).view(-1)
        padded = torch.zeros(flat.numel() + flat.numel() % 2, dtype=torch.float32)
        padded[: flat.numel()] = flat
        return self._add(padded.view(torch.int64), torch.float32, flat.numel())

    def _add(self, part: torch.Tensor, dtype: torch.dtype, numel: int | None = None) -> "_Part":
        # Every part starts 16-byte aligned: Triton compiles one variant of a kernel per pointer
        # alignment it sees, and a view at an 8-byte offset would compile a new one mid-work.
        numel = part.numel() if numel is None else numel
        if part.numel() % 2:
            part = torch.cat([part, part.new_zeros(1)])
        start = sum(p.numel() for p in self.parts)
        self.parts.append(part)
        return _Part(self, start, part.numel(), dtype, numel)

    def send(self, device: torch.device) -> None:
        host = torch.cat(self.parts) if self.parts else torch.empty(0, dtype=torch.int64)
        if device.type == "cuda":
            host = host.pin_memory().to(device, non_blocking=True)
        self.device_buffer = host


@dataclass
class _Part:
    uploads: Uploads
    start: int
    length: int  # in int64 words
    dtype: torch.dtype
    numel: int

    def get(self) -> torch.Tensor:
        words = self.uploads.device_buffer.narrow(0, self.start, self.length)
        return words.view(self.dtype)[: self.numel]


def _max_seen_block() -> int:
    from flashlet.kernels.sampling import MAX_SEEN_BLOCK

    return MAX_SEEN_BLOCK


# ---- pure functions on tensors (tests check them against per-row references) -------------
def apply_penalties(logits: torch.Tensor, counts: torch.Tensor, prompt_mask: torch.Tensor,
                    presence: torch.Tensor, frequency: torch.Tensor,
                    repetition: torch.Tensor) -> torch.Tensor:
    """The dense reference: logits, counts (output tokens), prompt_mask: [rows, vocab];
    penalties: [rows]."""
    seen = prompt_mask | (counts > 0)
    repetition = repetition.unsqueeze(1)
    repeated = torch.where(logits > 0, logits / repetition, logits * repetition)
    logits = torch.where(seen, repeated, logits)
    return (logits - frequency.unsqueeze(1) * counts
            - presence.unsqueeze(1) * (counts > 0).to(logits.dtype))


def penalise_seen(logits: torch.Tensor, rows: torch.Tensor, seen: torch.Tensor,
                  seen_counts: torch.Tensor, any_seen: torch.Tensor, presence: torch.Tensor,
                  frequency: torch.Tensor, repetition: torch.Tensor) -> None:
    """`apply_penalties` in place on the seen tokens only: logits [n, vocab]; rows [P], the
    penalised rows; seen [P, L], the ids of each row's prompt and output tokens (repeats are
    fine: a token's entries all compute the same value); seen_counts [P, L], the output count of
    each; any_seen [P], False for a row with no seen token (its ids are then left alone)."""
    # Flat offsets, one gather and one scatter: advanced indexing would add index checks and,
    # for the write, a sort of the indices (a dozen launches more on every sampled step).
    flat = logits.view(-1)
    at = (rows.unsqueeze(1) * logits.shape[1] + seen).view(-1)
    x = flat.gather(0, at).view(seen.shape)
    repetition = repetition.unsqueeze(1)
    penalised = torch.where(x > 0, x / repetition, x * repetition)
    counts = seen_counts.to(x.dtype)
    penalised = (penalised - frequency.unsqueeze(1) * counts
                 - presence.unsqueeze(1) * (counts > 0).to(x.dtype))
    flat.scatter_(0, at, torch.where(any_seen.unsqueeze(1), penalised, x).view(-1))


def sampling_probs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                   top_p: torch.Tensor, min_p: torch.Tensor, use_min_p: bool = True,
                   use_top: bool = True) -> torch.Tensor:
    """logits [rows, vocab] and per-row parameters [rows] -> the distribution each row samples
    from [rows, vocab]. top_k 0 keeps every token; the use_* flags skip work no row needs."""
    logits = logits / temperature.unsqueeze(1)
    if use_min_p:
        probs = torch.softmax(logits, dim=-1)
        floor = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
        logits = logits.masked_fill(probs < floor, float("-inf"))
    if use_top:
        logits = _top_k_top_p(logits, top_k, top_p)
    return torch.softmax(logits, dim=-1)


def _top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep each row's top_k logits (ties with the k-th kept), then the smallest prefix of the
    rest whose probability reaches top_p (the most likely token always stays)."""
    vocab = logits.shape[1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab).long()
    kth = sorted_logits.gather(1, (k - 1).unsqueeze(1))
    sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    probs = torch.softmax(sorted_logits, dim=-1)
    # top_p 1 keeps everything, even where rounding makes the running sum reach 1 early.
    p = torch.where(top_p < 1, top_p, float("inf")).unsqueeze(1)
    drop = probs.cumsum(dim=-1) - probs >= p
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits)


def ban_early_stops(logits: torch.Tensor, rows: torch.Tensor, ids: torch.Tensor) -> None:
    """min_tokens' ban on a constrained request's rows: logits[rows, ids] = -inf (one ban an
    entry), except in a row that the ban would leave with no token at all. There the grammar
    allows only the stop tokens (its output is complete, as a regex of one digit is after that
    digit), and the response format's end wins over min_tokens: the request stops short of it.
    Without this the row samples a token its grammar refuses, and the request fails. On the
    device, with no sync; the rows (gathered whole) are the few constrained ones."""
    kept = logits[rows, ids]  # (advanced indexing: a copy)
    logits[rows, ids] = float("-inf")
    emptied = torch.isneginf(logits[rows].amax(dim=1))
    logits[rows, ids] = torch.where(emptied, kept, torch.full_like(kept, float("-inf")))


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax (the first on ties, a NaN's if any, as torch's). On the CPU through
    numpy, whose reduction is SIMD: torch's CPU argmax takes over ten times as long at a decode
    step's [rows, vocab], and on the CPU that is the step's own host time."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2:
        return torch.from_numpy(logits.numpy().argmax(axis=1))
    return logits.argmax(dim=-1)


def exponential_race(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """argmax(probs / noise) per row, noise ~ Exp(1): token i wins with probability probs[i]."""
    tiny = torch.finfo(noise.dtype).tiny  # an Exp(1) draw of exactly 0 would divide by zero
    return (probs / noise.clamp(min=tiny)).argmax(dim=-1)


def seeded_noise(row: torch.Tensor, generator: torch.Generator) -> None:
    """Redraw one row of Exp(1) noise from a request's own generator."""
    row.exponential_(generator=generator)


class StepLogprobs:
    """The logprobs one step computed, copied to the host with its tokens; `get(row)` after
    the step's tokens have been read (which waits for the copies)."""

    def __init__(self, rows: list[int], ks: list[int], logprobs: torch.Tensor,
                 chosen_tokens: torch.Tensor):
        # logprobs [len(rows), vocab]: the model's, for the rows that asked.
        chosen = logprobs.gather(1, chosen_tokens.unsqueeze(1)).squeeze(1)
        top_values, top_ids = logprobs.topk(max(max(ks), 1), dim=-1)
        self.rows = {row: j for j, row in enumerate(rows)}
        self.ks = ks
        self._device = [chosen_tokens, chosen, top_ids, top_values]
        self._host = [_to_host(t) for t in self._device]
        self._lists = None

    def get(self, row: int) -> TokenLogprob | None:
        j = self.rows.get(row)
        if j is None:
            return None
        if self._lists is None:
            self._lists = [t.tolist() for t in self._host]
        tokens, chosen, top_ids, top_values = self._lists
        k = self.ks[j]
        return TokenLogprob(tokens[j], chosen[j], list(zip(top_ids[j][:k], top_values[j][:k])))


def _to_host(t: torch.Tensor) -> torch.Tensor:
    if t.device.type != "cuda":
        return t
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    return host.copy_(t, non_blocking=True)
