"""v04_continuous_batching: admit and retire requests while decoding goes on.

Up to v03 a call prefilled all its prompts together and decoded until the last one finished: a
request that stopped early left its place empty, and a long prompt list needed a cache for all
of it at once. Here the KV cache is allocated once for `max_batch_size` requests. Each engine step
first admits waiting requests into free cache rows and prefills them; when nobody can be admitted
it decodes one token for every running request. A request that finishes gives its row back right
away, so the next waiting one joins the running batch while the others keep decoding.
`step_log` records what each step ran.
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
    def __init__(
        self,
        model: str | None = None,
        device: str | None = None,
        dtype=None,
        max_batch_size: int = 8,
        max_seq_len: int = 512,
    ):
        self.device = pick_device(device)
        self.dtype = pick_dtype(dtype, self.device)
        model_dir = resolve_model_dir(model)
        self.config = load_config(model_dir)
        self.tokenizer = load_tokenizer(model_dir)
        self.model = load_model(model_dir, self.config, self.device, self.dtype)
        self.eos_token_ids = set(self.config.eos_token_ids)
        self.max_batch_size = max_batch_size
        self.max_seq_len = min(max_seq_len, self.config.max_position_embeddings)
        self.kv_cache = KVCache(
            self.config, max_batch_size, self.max_seq_len, self.device, self.dtype
        )
        self.kv_cache.attach(self.model)
        self.step_log: list[tuple[str, list[int]]] = []  # (prefill or decode, request ids)

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
        self.check_fits(prompt_ids, max_new_tokens)
        stop_ids = frozenset() if ignore_eos else frozenset(self.eos_token_ids)
        requests = [Request(i, ids, max_new_tokens, stop_ids) for i, ids in enumerate(prompt_ids)]
        scheduler = Scheduler(self.max_batch_size)
        for request in requests:
            scheduler.add(request)
        self.step_log = []
        while scheduler.has_unfinished():
            self.step(scheduler)
        return [make_completion(self.tokenizer, r.output_ids, r.finish_reason) for r in requests]

    def check_fits(self, prompt_ids: list[list[int]], max_new_tokens: int) -> None:
        longest = max(len(ids) for ids in prompt_ids) + max_new_tokens
        if longest > self.max_seq_len:
            limit = self.max_seq_len
            raise ValueError(f"prompt + max_new_tokens ({longest}) > max_seq_len ({limit})")

    def step(self, scheduler: Scheduler) -> None:
        """Prefill the newly admitted requests if there are any, else decode the running ones."""
        admitted = scheduler.admit()
        if admitted:
            self.prefill(admitted)
        else:
            self.decode(scheduler.running)
        ran = admitted or scheduler.running
        self.step_log.append(("prefill" if admitted else "decode", [r.request_id for r in ran]))
        scheduler.retire_finished()

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
