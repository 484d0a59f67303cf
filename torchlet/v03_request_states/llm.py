"""v03_request_states: every request has an explicit state.

v02 tracked progress in parallel lists indexed by prompt number. Here each prompt becomes a
`Request` that is WAITING (queued), RUNNING (prefilled, owns a cache row, decoding) or FINISHED
(EOS or max_new_tokens), and a `Scheduler` keeps one list per state. The engine loop only asks
the scheduler what to run: prefill what it admits, decode what is running, retire what finished.
Behaviour is unchanged (all prompts are admitted at once); the states are what v04 builds on to
admit and retire requests while decoding continues.
"""

from __future__ import annotations

import torch

from .batch import DecodeBatch, PrefillBatch
from .config import load_config
from .device import pick_device, pick_dtype
from .kv_cache import KVCache
from .prompts import (
    Completion,
    check_max_new_tokens,
    encode_prompts,
    load_tokenizer,
    make_completion,
)
from .request import Request
from .scheduler import Scheduler
from .weights import load_model, resolve_model_dir


class LLM:
    def __init__(self, model: str | None = None, device: str | None = None, dtype=None):
        self.device = pick_device(device)
        self.dtype = pick_dtype(dtype, self.device)
        model_dir = resolve_model_dir(model)
        self.config = load_config(model_dir)
        self.tokenizer = load_tokenizer(model_dir)
        self.model = load_model(model_dir, self.config, self.device, self.dtype)
        self.eos_token_ids = set(self.config.eos_token_ids)

    @torch.inference_mode()
    def generate(
        self,
        prompts: list[str] | list[list[int]],
        max_new_tokens: int = 32,
        ignore_eos: bool = False,
    ) -> list[Completion]:
        """Greedy completions, one per prompt (text, or a list of token ids)."""
        check_max_new_tokens(max_new_tokens)
        prompt_ids = encode_prompts(self.tokenizer, prompts, self.config.vocab_size)
        stop_ids = frozenset() if ignore_eos else frozenset(self.eos_token_ids)
        requests = [Request(i, ids, max_new_tokens, stop_ids) for i, ids in enumerate(prompt_ids)]
        max_seq_len = max(len(ids) for ids in prompt_ids) + max_new_tokens
        cache = KVCache(self.config, len(requests), max_seq_len, self.device, self.dtype)
        cache.attach(self.model)
        scheduler = Scheduler()
        for request in requests:
            request.cache_row = request.request_id
            scheduler.add(request)
        self.prefill(scheduler.admit_all())
        scheduler.retire_finished()
        while scheduler.has_unfinished():
            self.decode(scheduler.running)
            scheduler.retire_finished()
        return [make_completion(self.tokenizer, r.output_ids, r.finish_reason) for r in requests]

    def prefill(self, requests: list[Request]) -> None:
        """The requests' prompts in one ragged pass: fills their cache rows, appends 1st tokens."""
        input_ids = [t for r in requests for t in r.prompt_ids]
        lengths = [len(r.prompt_ids) for r in requests]
        batch = PrefillBatch.from_prompts(lengths, [r.cache_row for r in requests], self.device)
        hidden = self.model(torch.tensor(input_ids, device=self.device), batch)
        logits = self.model.logits(hidden[batch.last_token_indices()])  # [num_requests, vocab]
        for request, next_id in zip(requests, logits.argmax(dim=-1).tolist()):
            request.append_token(next_id)

    def decode(self, requests: list[Request]) -> None:
        """One new token per running request; attention reads the rest from the cache."""
        input_ids = torch.tensor([r.last_token_id for r in requests], device=self.device)
        batch = DecodeBatch(
            positions=torch.tensor([r.last_position for r in requests], device=self.device),
            cache_rows=torch.tensor([r.cache_row for r in requests], device=self.device),
        )
        hidden = self.model(input_ids, batch)  # [num_requests, hidden_size]
        for request, next_id in zip(requests, self.model.logits(hidden).argmax(dim=-1).tolist()):
            request.append_token(next_id)


if __name__ == "__main__":
    from .demo import main

    main(LLM)
