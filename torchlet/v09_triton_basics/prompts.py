"""Prompts in, completions out: token ids or text (with the model folder's tokenizer, if any)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


@dataclass
class Completion:
    token_ids: list[int]  # the generated tokens (an EOS that stopped generation is included)
    text: str | None  # token_ids decoded without special tokens; None when there is no tokenizer
    finish_reason: str  # "eos" (an end-of-sequence token) or "length" (max_new_tokens reached)


def load_tokenizer(model_dir: Path):
    """The folder's Hugging Face tokenizer, or None (random-weight models have none)."""
    if not any((Path(model_dir) / name).exists() for name in TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


def encode_prompts(tokenizer, prompts: list[str] | list[list[int]], vocab_size: int):
    """Each prompt as a list of token ids (text prompts go through the tokenizer)."""
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, (list, tuple)):
        raise TypeError("prompts must be a list of strings or a list of token-id lists")
    if not prompts:
        raise ValueError("no prompts given")
    return [encode_prompt(tokenizer, prompt, vocab_size) for prompt in prompts]


def encode_prompt(tokenizer, prompt: str | list[int], vocab_size: int) -> list[int]:
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("this model folder has no tokenizer: pass prompts as token-id lists")
        token_ids = tokenizer(prompt)["input_ids"]
    else:
        token_ids = [int(t) for t in prompt]
    if not token_ids:
        raise ValueError("empty prompt: every prompt needs at least one token")
    if min(token_ids) < 0 or max(token_ids) >= vocab_size:
        raise ValueError(f"prompt token ids must lie in [0, {vocab_size})")
    return token_ids


def check_max_new_tokens(max_new_tokens: int) -> None:
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be at least 1, got {max_new_tokens}")


def make_completion(tokenizer, token_ids: list[int], finish_reason: str) -> Completion:
    text = None if tokenizer is None else tokenizer.decode(token_ids, skip_special_tokens=True)
    return Completion(token_ids=list(token_ids), text=text, finish_reason=finish_reason)


def chat_prompt(tokenizer, question: str) -> str:
    """A user question in the model's chat format (plain text when there is no chat template)."""
    if getattr(tokenizer, "chat_template", None):
        messages = [{"role": "user", "content": question}]
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return question
