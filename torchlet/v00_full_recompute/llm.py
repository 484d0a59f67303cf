"""v00_full_recompute: the simplest engine that generates text.

One request at a time; for every new token the whole sequence (prompt + tokens generated so far)
goes through the model again, and the argmax of the last position's logits is the next token.
Nothing is remembered between steps, so step n costs O(n) tokens of work (O(n^2) attention):
slow, but obviously correct. Every later rung must produce exactly these tokens.
"""

from __future__ import annotations

import torch

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
        return [self.generate_one(ids, max_new_tokens, ignore_eos) for ids in prompt_ids]

    def generate_one(self, prompt_ids: list[int], max_new_tokens: int, ignore_eos: bool):
        new_ids: list[int] = []
        while len(new_ids) < max_new_tokens:
            next_id = self.next_token(prompt_ids + new_ids)
            new_ids.append(next_id)
            if next_id in self.eos_token_ids and not ignore_eos:
                return make_completion(self.tokenizer, new_ids, "eos")
        return make_completion(self.tokenizer, new_ids, "length")

    def next_token(self, token_ids: list[int]) -> int:
        """Run the whole sequence through the model; the argmax of the last position wins."""
        input_ids = torch.tensor(token_ids, device=self.device)  # [num_tokens]
        positions = torch.arange(len(token_ids), device=self.device)  # [num_tokens]
        hidden = self.model(input_ids, positions)  # [num_tokens, hidden_size]
        logits = self.model.logits(hidden[-1:])  # [1, vocab_size]
        return int(logits.argmax(dim=-1))


if __name__ == "__main__":
    from .demo import main

    main(LLM)
