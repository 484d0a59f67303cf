"""The offline API: `LLM(model).generate(prompts, SamplingParams(...))`, a loop over Engine.step()
whose token outputs get their text (and stop strings) from detokenizer.TextOutputs."""

from __future__ import annotations

import torch

from flashlet.config import EngineConfig
from flashlet.detokenizer import TextOutputs
from flashlet.engine import Engine
from flashlet.request import RequestOutput
from flashlet.request_check import RequestLimits
from flashlet.sampling import SamplingParams


class LLM:
    def __init__(self, model: str | None = None, backend: str = "torch", device=None,
                 dtype=None, page_size: int = 16, max_num_pages: int | None = None, **kwargs):
        if isinstance(dtype, torch.dtype):
            dtype = str(dtype).removeprefix("torch.")
        if device is not None:
            device = str(device)
        self.config = EngineConfig(model=model, backend=backend, device=device, dtype=dtype,
                                   page_size=page_size, max_num_pages=max_num_pages, **kwargs)
        self.engine = Engine(self.config)
        self.tokenizer = self.engine.tokenizer
        self.text_outputs = TextOutputs(self.engine, self.tokenizer)

    def generate(self, prompts, params: SamplingParams | None = None) -> list[RequestOutput]:
        """Run prompts (a string, a list of strings, or token-id lists) as one ragged batch;
        returns one finished output per prompt, in order."""
        prompts = _as_prompt_list(prompts)
        params = params or SamplingParams()
        limits = RequestLimits.of_engine(self.engine)
        # Check every prompt before any is queued (the server checks with the same rules).
        prompt_ids = [self.engine.encode(p) for p in prompts]
        prompt_ids = [limits.check(p, params) for p in prompt_ids]
        ids = []
        try:
            for p in prompt_ids:
                ids.append(self.engine.add_request(p, params))
                self.text_outputs.add(ids[-1], params)
            finished = self._run_until_done(set(ids))
        except BaseException:
            for rid in ids:  # frees their pages at once; nothing of this call is left queued
                self.engine.abort(rid)
                self.text_outputs.forget(rid)
            raise
        return [finished[i] for i in ids]

    def chat(self, conversations, params: SamplingParams | None = None) -> list[RequestOutput]:
        """Generate replies to chat conversations (lists of {role, content}), chat template applied."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        return self.generate([self.apply_chat_template(c) for c in conversations], params)

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("this model has no chat template")
        if not messages:
            raise ValueError("the message list is empty")
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)

    def _run_until_done(self, ids: set[int]) -> dict[int, RequestOutput]:
        finished = {}
        while len(finished) < len(ids):
            if not self.engine.has_unfinished():
                raise RuntimeError("engine went idle with requests unfinished")
            for out in self.text_outputs.process(self.engine.step()):
                if out.finished and out.request_id in ids:
                    finished[out.request_id] = out
        return finished


def _as_prompt_list(prompts) -> list:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if not prompts:
        raise ValueError("no prompts given")
    if all(isinstance(t, int) for t in prompts):
        return [prompts]  # one prompt as token ids
    return prompts
