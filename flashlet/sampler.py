"""The batched sampler: one step's logits [rows, vocab] -> one token per row, on the device.

The order is vLLM's: the model's logits -> their logprobs (kept for rows that ask) -> grammar
mask (structured output) -> min_tokens mask -> repetition, frequency and presence penalties ->
greedy rows take the argmax; sampled rows go through temperature -> min_p -> top-k -> top-p and
an exponential race: token = argmax(probs / E) with E ~ Exp(1) i.i.d., which picks token i with
probability probs[i] (the Gumbel-max trick in another form), so one batched draw of noise serves
every row. A request with a seed draws its row of noise from its own torch.Generator (the one
per-row step), so its tokens do not depend on what else is in the batch.

Logprobs follow vLLM's default (`logprobs_mode="raw_logprobs"`): the log-softmax of the model's
logits, before the grammar, penalties, temperature and top-k/top-p, so they say what the model
thinks, not what the sampler was allowed to pick. The chosen token's logprob is the model's
logprob of the token that was actually sampled.

Penalties (vLLM / OpenAI semantics): the repetition penalty applies to every token seen in the
prompt or the output (a positive logit is divided by it, a negative one multiplied), then
`frequency_penalty * count` and `presence_penalty * (count > 0)` are subtracted, counting output
tokens only. The counts live on the device, one row per penalised request, and are updated from
the sampled token tensor right after sampling: no host round trip, so an overlapped step (which
runs before the host has read the previous tokens) already sees them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flashlet.sampling import SamplingParams, TokenLogprob
from flashlet.structured import apply_grammar_masks


@dataclass
class SamplerOutput:
    tokens: torch.Tensor  # [rows] int64 on the device
    errors: dict[int, Exception]  # row -> why its request's sampling failed (the rest go on)
    logprobs: "StepLogprobs | None"  # for rows that asked; readable once the step's copy is done


class Sampler:
    def __init__(self, device: torch.device, eos_token_ids: set[int]):
        self.device = device
        self.eos_token_ids = sorted(eos_token_ids)
        # Penalty state, allocated when the first penalised request samples.
        self.counts: torch.Tensor | None = None  # [slots, vocab] int32: output tokens so far
        self.prompt_mask: torch.Tensor | None = None  # [slots, vocab] bool: tokens of the prompt
        self.slot_of: dict[int, int] = {}  # request id -> its row in counts / prompt_mask
        self.free_slots: list[int] = []

    # ---- one step ---------------------------------------------------------------------------
    def sample(self, logits: torch.Tensor, reqs: list) -> SamplerOutput:
        """logits [len(reqs), vocab] (fp32) -> a token per request (see the module docstring)."""
        params = [r.params for r in reqs]
        errors: dict[int, Exception] = {}
        if all(_plain_greedy(p) for p in params):  # the common greedy case: nothing to apply
            return SamplerOutput(logits.argmax(dim=-1), errors, None)
        logits = logits.to(torch.float32, copy=True)  # never write into the runner's buffer
        lp_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        raw_logprobs = (torch.log_softmax(logits[self._index(lp_rows)], dim=-1)
                        if lp_rows else None)
        apply_grammar_masks(logits, reqs, errors)
        self._mask_early_stops(logits, reqs)
        penalised = [i for i, p in enumerate(params) if p.has_penalties]
        if penalised:
            logits = self._apply_penalties(logits, reqs, penalised)
        random_rows = [i for i, p in enumerate(params) if not p.is_greedy]
        if len(random_rows) == len(reqs):
            tokens = self._draw(logits, reqs, random_rows, errors)
        else:
            tokens = logits.argmax(dim=-1)
            if random_rows:
                rows = self._index(random_rows)
                tokens.index_copy_(0, rows, self._draw(logits[rows], reqs, random_rows, errors))
        if penalised:
            self._count(reqs, penalised, tokens)
        logprobs = None
        if lp_rows:
            logprobs = StepLogprobs(lp_rows, [params[i].logprobs for i in lp_rows], raw_logprobs,
                                    tokens[self._index(lp_rows)])
        return SamplerOutput(tokens, errors, logprobs)

    def release(self, request_id: int) -> None:
        """A request left the engine: its penalty row is free for another."""
        slot = self.slot_of.pop(request_id, None)
        if slot is not None:
            self.free_slots.append(slot)

    # ---- the pieces -------------------------------------------------------------------------
    def _mask_early_stops(self, logits: torch.Tensor, reqs: list) -> None:
        """Rows short of min_tokens may not sample EOS or a stop token id."""
        rows, ids = [], []
        for i, req in enumerate(reqs):
            p = req.params
            if len(req.output_token_ids) < p.min_tokens:
                banned = p.stop_token_ids + ([] if p.ignore_eos else self.eos_token_ids)
                rows += [i] * len(banned)
                ids += banned
        if rows:
            logits[self._index(rows), self._index(ids)] = float("-inf")

    def _apply_penalties(self, logits: torch.Tensor, reqs: list, rows: list[int]) -> torch.Tensor:
        slots = self._index([self._slot(reqs[i], logits.shape[1]) for i in rows])
        row_index = self._index(rows)
        values = self._tensor([[reqs[i].params.presence_penalty, reqs[i].params.frequency_penalty,
                                reqs[i].params.repetition_penalty] for i in rows], torch.float32)
        penalised = apply_penalties(logits[row_index], self.counts[slots], self.prompt_mask[slots],
                                    values[:, 0], values[:, 1], values[:, 2])
        return logits.index_copy(0, row_index, penalised)

    def _count(self, reqs: list, rows: list[int], tokens: torch.Tensor) -> None:
        """Add each penalised row's sampled token to its counts, on the device."""
        slots = self._index([self.slot_of[reqs[i].request_id] for i in rows])
        chosen = tokens[self._index(rows)]
        ones = torch.ones(len(rows), dtype=self.counts.dtype, device=self.device)
        self.counts.index_put_((slots, chosen), ones, accumulate=True)

    def _draw(self, logits: torch.Tensor, reqs: list, rows: list[int], errors: dict) -> torch.Tensor:
        """Sample the given rows (logits [len(rows), vocab]) -> tokens [len(rows)]."""
        params = [reqs[i].params for i in rows]
        columns = self._tensor([(p.temperature, p.top_k, p.top_p, p.min_p) for p in params],
                               torch.float32)
        temperature, top_k, top_p, min_p = columns.unbind(1)
        probs = sampling_probs(logits, temperature, top_k, top_p, min_p,
                               use_min_p=any(p.min_p > 0 for p in params),
                               use_top=any(p.top_k > 0 or p.top_p < 1 for p in params))
        noise = torch.empty_like(probs).exponential_()
        for j, i in enumerate(rows):
            generator = reqs[i].generator
            if generator is not None:
                try:
                    seeded_noise(noise[j], generator)
                except Exception as e:  # one bad request must not fail the batch
                    errors[i] = e
        return exponential_race(probs, noise)

    def _slot(self, req, vocab: int) -> int:
        """The penalty row of `req`, set up from its prompt on first use."""
        slot = self.slot_of.get(req.request_id)
        if slot is not None:
            return slot
        if not self.free_slots:
            self._grow(vocab)
        slot = self.slot_of[req.request_id] = self.free_slots.pop()
        self.counts[slot] = 0
        self.prompt_mask[slot] = False
        self.prompt_mask[slot, self._index(req.prompt_token_ids)] = True
        return slot

    def _grow(self, vocab: int) -> None:
        old = 0 if self.counts is None else self.counts.shape[0]
        new = max(8, 2 * old)
        counts = torch.zeros(new, vocab, dtype=torch.int32, device=self.device)
        mask = torch.zeros(new, vocab, dtype=torch.bool, device=self.device)
        if old:
            counts[:old], mask[:old] = self.counts, self.prompt_mask
        self.counts, self.prompt_mask = counts, mask
        self.free_slots += range(new - 1, old - 1, -1)

    def _index(self, values: list[int]) -> torch.Tensor:
        return self._tensor(values, torch.int64)

    def _tensor(self, values: list, dtype: torch.dtype) -> torch.Tensor:
        """Host values -> a device tensor, without waiting for the device (a copy from pinned
        memory is queued; one from pageable memory would stall the overlap)."""
        host = torch.tensor(values, dtype=dtype)
        if self.device.type != "cuda":
            return host
        return host.pin_memory().to(self.device, non_blocking=True)


# ---- pure functions on tensors (tests check them against per-row references) -------------
def apply_penalties(logits: torch.Tensor, counts: torch.Tensor, prompt_mask: torch.Tensor,
                    presence: torch.Tensor, frequency: torch.Tensor,
                    repetition: torch.Tensor) -> torch.Tensor:
    """logits, counts (output tokens), prompt_mask: [rows, vocab]; penalties: [rows]."""
    seen = prompt_mask | (counts > 0)
    repetition = repetition.unsqueeze(1)
    repeated = torch.where(logits > 0, logits / repetition, logits * repetition)
    logits = torch.where(seen, repeated, logits)
    return (logits - frequency.unsqueeze(1) * counts
            - presence.unsqueeze(1) * (counts > 0).to(logits.dtype))


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


def exponential_race(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """argmax(probs / noise) per row, noise ~ Exp(1): token i wins with probability probs[i]."""
    tiny = torch.finfo(noise.dtype).tiny  # an Exp(1) draw of exactly 0 would divide by zero
    return (probs / noise.clamp(min=tiny)).argmax(dim=-1)


def seeded_noise(row: torch.Tensor, generator: torch.Generator) -> None:
    """Redraw one row of Exp(1) noise from a request's own generator."""
    row.exponential_(generator=generator)


def _plain_greedy(p: SamplingParams) -> bool:
    return (p.is_greedy and not p.has_penalties and p.logprobs is None and p.min_tokens == 0
            and not p.is_constrained)


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
