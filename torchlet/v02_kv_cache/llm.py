"""v02_kv_cache: remember keys and values instead of recomputing them.

Up to v01 every step ran every token of every sequence through the model again. Here a KV cache
keeps each layer's keys and values, and generation has two explicit phases: a prefill pass runs
the whole prompts once (ragged batch, as in v01) and fills the cache; then each decode pass feeds
only the newest token of every unfinished request, which attends to its cached keys and values.
Per step the work drops from O(sequence length) tokens to one token per request. The cache holds
only the key/value heads (GQA), one row per request, sized for this call's longest sequence.
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
        max_seq_len = max(len(ids) for ids in prompt_ids) + max_new_tokens
        cache = KVCache(self.config, len(prompt_ids), max_seq_len, self.device, self.dtype)
        cache.attach(self.model)
        new_ids = [[first_id] for first_id in self.prefill(prompt_ids)]
        finish_reasons = [
            self.finish_reason(ids[0], 1, max_new_tokens, ignore_eos) for ids in new_ids
        ]
        while unfinished := [i for i, reason in enumerate(finish_reasons) if reason is None]:
            last_ids = [new_ids[i][-1] for i in unfinished]
            positions = [len(prompt_ids[i]) + len(new_ids[i]) - 1 for i in unfinished]
            next_ids = self.decode(last_ids, positions, cache_rows=unfinished)
            for i, next_id in zip(unfinished, next_ids):
                new_ids[i].append(next_id)
                reason = self.finish_reason(next_id, len(new_ids[i]), max_new_tokens, ignore_eos)
                finish_reasons[i] = reason
        return [
            make_completion(self.tokenizer, ids, reason)
            for ids, reason in zip(new_ids, finish_reasons)
        ]

    def finish_reason(self, next_id: int, num_new: int, max_new_tokens: int, ignore_eos: bool):
        if next_id in self.eos_token_ids and not ignore_eos:
            return "eos"
        return "length" if num_new >= max_new_tokens else None

    def prefill(self, prompt_ids: list[list[int]]) -> list[int]:
        """All prompts in one ragged pass: fills request i's cache row i, returns first tokens."""
        input_ids = torch.tensor([t for ids in prompt_ids for t in ids], device=self.device)
        lengths = [len(ids) for ids in prompt_ids]
        batch = PrefillBatch.from_prompts(lengths, list(range(len(lengths))), self.device)
        hidden = self.model(input_ids, batch)  # [num_tokens, hidden_size]
        logits = self.model.logits(hidden[batch.last_token_indices()])  # [num_requests, vocab]
        return logits.argmax(dim=-1).tolist()

    def decode(self, last_ids: list[int], positions: list[int], cache_rows: list[int]) -> list[int]:
        """One new token per unfinished request; attention reads the rest from the cache."""
        input_ids = torch.tensor(last_ids, device=self.device)  # [num_requests]
        batch = DecodeBatch(
            positions=torch.tensor(positions, device=self.device),
            cache_rows=torch.tensor(cache_rows, device=self.device),
        )
        hidden = self.model(input_ids, batch)  # [num_requests, hidden_size]
        return self.model.logits(hidden).argmax(dim=-1).tolist()


if __name__ == "__main__":
    from .demo import main

    main(LLM)
