"""v01_0_ragged_batch: several requests in one forward pass.

v00 ran the requests one after the other. Here the unfinished requests of a step are concatenated
into one flat token list (no padding) and `req_indptr` records where each request starts, so the
projections and feed-forward run once over every token of every request: bigger matrix products,
fewer launches. Attention still keeps requests apart by looping over their `req_indptr` ranges.
Each step still recomputes every sequence in full.
"""

from __future__ import annotations

import torch

from .batch import RaggedBatch
from .config import load_config
from .device import pick_device, pick_dtype
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
        new_ids: list[list[int]] = [[] for _ in prompt_ids]
        finish_reasons: list[str | None] = [None for _ in prompt_ids]
        while unfinished := [i for i, reason in enumerate(finish_reasons) if reason is None]:
            next_ids = self.next_tokens([prompt_ids[i] + new_ids[i] for i in unfinished])
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

    def next_tokens(self, sequences: list[list[int]]) -> list[int]:
        """One forward pass over all sequences as one ragged batch: each one's next token."""
        input_ids = torch.tensor([t for seq in sequences for t in seq], device=self.device)
        batch = RaggedBatch.from_lengths([len(seq) for seq in sequences], self.device)
        hidden = self.model(input_ids, batch)  # [num_tokens, hidden_size]
        logits = self.model.logits(hidden[batch.last_token_indices()])  # [num_requests, vocab]
        return logits.argmax(dim=-1).tolist()


if __name__ == "__main__":
    from .demo import main

    main(LLM)
