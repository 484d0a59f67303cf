"""The offline API: `LLM(model).generate(prompts, SamplingParams(...))`, a loop over Engine.step()
whose token outputs get their text (and stop strings) from detokenizer.TextOutputs.

`with LLM(...) as llm:` (or `llm.close()`) stops tensor-parallel workers and leaves the process
group at once; an LLM that is dropped does the same when it is collected."""

from __future__ import annotations

import torch

from flashlet.config import EngineConfig
from flashlet.core.engine import Engine
from flashlet.core.request import RequestOutput
from flashlet.core.request_check import RequestLimits
from flashlet.core.sampling import SamplingParams, sample_params
from flashlet.distributed import tp_worker
from flashlet.text.detokenizer import TextOutputs
from flashlet.text.tokenizing import chat_ids, chat_template_ending


# vLLM's LLM(...) keywords for what flashlet calls otherwise: name -> (EngineConfig field, value).
VLLM_KEYWORDS = {
    "enforce_eager": ("cuda_graph", lambda eager: not eager),
    "enable_prefix_caching": ("enable_prefix_cache", bool),
    "block_size": ("page_size", int),
}


class LLM:
    def __init__(self, model: str | None = None, backend: str = "auto", device=None,
                 dtype=None, page_size: int = 16, max_num_pages: int | None = None, *,
                 seed: int | None = None, trust_remote_code: bool = False, **kwargs):
        """EngineConfig's fields as keywords, and vLLM's names for some (VLLM_KEYWORDS:
        enforce_eager, enable_prefix_caching, block_size). seed seeds the random draws of
        requests without a seed of their own (torch's generators: vLLM's LLM(seed=));
        trust_remote_code is accepted and changes nothing (flashlet runs its own forward pass,
        never a model's code)."""
        if isinstance(dtype, torch.dtype):
            dtype = str(dtype).removeprefix("torch.")
        if device is not None:
            device = str(device)
        fields = dict(page_size=page_size, **kwargs)
        for name, (field, convert) in VLLM_KEYWORDS.items():
            if name in fields:
                fields[field] = convert(fields.pop(name))
        if seed is not None:
            torch.manual_seed(seed)  # every device's generator
        self.config = EngineConfig(model=model, backend=backend, device=device, dtype=dtype,
                                   max_num_pages=max_num_pages, **fields)
        self.engine = Engine(self.config)
        tp_worker.serve_if_worker(self.engine)  # under torchrun, ranks 1.. serve and exit here
        self.tokenizer = self.engine.tokenizer
        self.text_outputs = TextOutputs(self.engine, self.tokenizer)

    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None, *,
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Run prompts (a string, a list of strings, or token-id lists) as one ragged batch;
        returns the finished outputs in prompt order: one per prompt, or with `n` > 1 n per
        prompt, grouped (prompt i's samples one after another). `params`: one SamplingParams
        for every prompt, or a list of one a prompt (vLLM's form).

        The samples of one prompt share its KV pages: the first is admitted alone and the
        others once its prompt is computed, so they find the prompt in the prefix cache. With
        best_of > n, best_of are sampled and the n of highest cumulative logprob kept.
        `sampling_params` is vLLM's name for `params`; `use_tqdm` is accepted (no progress bar
        is drawn). A text prompt's outputs carry it as `prompt`."""
        if sampling_params is not None:
            if params is not None:
                raise ValueError("give params or sampling_params (vLLM's name for it), not both")
            params = sampling_params
        prompts = _as_prompt_list(prompts)
        per_prompt = _per_prompt(params, len(prompts))
        limits = RequestLimits.of_engine(self.engine)
        # Check every prompt before any is queued (the server checks with the same rules).
        # Every prompt's ids first (`encode` checks them), then each request's params and budget;
        # add_request is told the ids are checked (checked=True), so they are not read again.
        prompt_ids = [self.engine.encode(p) for p in prompts]
        for ids, p in zip(prompt_ids, per_prompt):
            limits.check_params(p)
            limits.check_fits(len(ids), p.max_new_tokens)
        groups: list[list[int]] = []
        mine: set[int] = set()
        siblings_due: dict[int, tuple[list[int], list[int], SamplingParams]] = {}  # first id -> (prompt, group, params)

        def add(token_ids: list[int], p: SamplingParams, index: int) -> int:
            sample = sample_params(p, index, p.best_of or p.n)
            rid = self.engine.add_request(token_ids, sample, checked=True)
            self.text_outputs.add(rid, sample)
            mine.add(rid)
            return rid

        def on_output(out: RequestOutput) -> None:
            due = siblings_due.pop(out.request_id, None)
            if due is not None:  # the first sample's prompt is computed and cached: fork
                token_ids, group, p = due
                group += [add(token_ids, p, k) for k in range(1, p.best_of or p.n)]

        try:
            for token_ids, p in zip(prompt_ids, per_prompt):
                groups.append([add(token_ids, p, 0)])
                if (p.best_of or p.n) > 1:
                    siblings_due[groups[-1][0]] = (token_ids, groups[-1], p)
            finished = self._run_until_done(mine, sum(p.best_of or p.n for p in per_prompt), on_output)
        except BaseException:
            for rid in (r for group in groups for r in group):  # frees their pages at once
                self.engine.abort(rid)
                self.text_outputs.forget(rid)
            raise
        for prompt, group in zip(prompts, groups):
            if isinstance(prompt, str):
                for rid in group:
                    finished[rid].prompt = prompt
        return [out for group, p in zip(groups, per_prompt) for out in _best(p, [finished[i] for i in group])]

    def get_tokenizer(self):
        """The model's tokenizer (vLLM's accessor; also `llm.tokenizer`), None without one."""
        return self.tokenizer

    def embed(self, prompts, pooling: str = "last") -> list[list[float]]:
        """One embedding per prompt: its final hidden states pooled ("last" token or "mean")
        and normalised (flashlet/runner/pooling.py), in prompt order."""
        params = SamplingParams(max_new_tokens=1, ignore_eos=True, pooling=pooling)
        return [out.embedding for out in self.generate(prompts, params)]

    def close(self) -> None:
        """Stop the tensor-parallel workers, if any, and leave their process group (idempotent;
        also done when the LLM is collected or the program exits)."""
        self.engine.shutdown()

    shutdown = close  # vLLM's name

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def chat(self, conversations, params: SamplingParams | list[SamplingParams] | None = None, *,
             allow_special_tokens: bool = False, tools: list[dict] | None = None,
             chat_template_kwargs: dict | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False,
             sampling_params: SamplingParams | list[SamplingParams] | None = None,
             use_tqdm: bool = False) -> list[RequestOutput]:
        """Generate replies to chat conversations (lists of {role, content}), chat template
        applied (the keywords as `apply_chat_template` takes them, vLLM's names; sampling_params
        and use_tqdm as `generate` takes them); control-token text in message content stays
        text unless allowed."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        return self.generate([self.apply_chat_template(
            c, allow_special_tokens=allow_special_tokens, tools=tools, chat_template_kwargs=chat_template_kwargs,
            add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message)
            for c in conversations], params, sampling_params=sampling_params)

    def apply_chat_template(self, messages: list[dict], *, allow_special_tokens: bool = False,
                            tools: list[dict] | None = None, chat_template_kwargs: dict | None = None,
                            add_generation_prompt: bool = True,
                            continue_final_message: bool = False) -> list[int]:
        """Token ids of the rendered conversation, ending with the assistant's turn opening
        (add_generation_prompt), or with the last message left open for the model to continue
        (continue_final_message, which takes add_generation_prompt=False: vLLM's rule).
        `tools` are shown to the model as the template shows them; `chat_template_kwargs` are
        more template variables (e.g. Qwen3's enable_thinking). Message content is encoded as
        text: `<|im_end|>` written in a message is not the control token
        (flashlet/text/tokenizing.py), unless `allow_special_tokens`."""
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("this model has no chat template")
        kwargs = {**(chat_template_kwargs or {}),
                  **chat_template_ending(add_generation_prompt, continue_final_message)}
        try:  # chat_ids checks the messages' shape (tokenizing.check_messages) before the template
            return chat_ids(self.tokenizer, messages, allow_special=allow_special_tokens, tools=tools,
                            template_kwargs=kwargs)
        except ValueError:
            raise
        except Exception as e:  # noqa: BLE001 - a template that rejects these messages (as the server says)
            raise ValueError(f"the chat template rejected these messages: {e}") from e

    def _run_until_done(self, ids: set[int], count: int,
                        on_output=None) -> dict[int, RequestOutput]:
        """Step until `count` of the requests in `ids` (a set that may grow meanwhile) have
        finished, then take what the engine still holds for them (`Engine.take_pending`: a
        stop string's abort echo); on_output sees each of their outputs first."""
        finished = {}
        while len(finished) < count:
            if not self.engine.has_unfinished():
                raise RuntimeError("engine went idle with requests unfinished")
            for out in self.text_outputs.process(self.engine.step()):
                if out.request_id not in ids:
                    continue
                if on_output is not None:
                    on_output(out)
                if out.finished:
                    finished[out.request_id] = out
        self.text_outputs.process(self.engine.take_pending())  # nothing of ours left for the next step
        return finished


def _best(params: SamplingParams, outputs: list[RequestOutput]) -> list[RequestOutput]:
    """The n outputs to return of a prompt's samples (all of them unless best_of > n), each
    with the prompt logprobs that the first sample computed (if asked for)."""
    for out in outputs[1:]:
        out.prompt_logprobs = outputs[0].prompt_logprobs
    if len(outputs) == params.n:
        return outputs
    best = sorted(outputs, key=lambda o: o.cumulative_logprob or 0.0, reverse=True)[: params.n]
    if params.logprobs is None:  # asked for the ranking only
        for out in best:
            out.logprobs = None
    return best


def _per_prompt(params, num_prompts: int) -> list[SamplingParams]:
    """One SamplingParams a prompt: the one given for all, or a list of one a prompt."""
    if params is None or isinstance(params, SamplingParams):
        return [params or SamplingParams()] * num_prompts
    params = list(params)
    if len(params) != num_prompts or not all(isinstance(p, SamplingParams) for p in params):
        raise ValueError(f"params: one SamplingParams for all prompts, or a list of {num_prompts} "
                         f"(one a prompt), got {len(params)} items")
    return params


PROMPT_FORMS = 'a prompt is a string, a list of token ids, or {"prompt": text} / {"prompt_token_ids": ids}'


def _as_prompt_list(prompts) -> list:
    """Prompts as a list of texts and token-id lists: one text, one id list, a list of them, or
    vLLM's prompt dicts ({"prompt": text} or {"prompt_token_ids": ids}); a TypeError naming
    any other form."""
    if isinstance(prompts, (str, dict)):
        prompts = [prompts]
    if isinstance(prompts, bytes) or not hasattr(prompts, "__iter__"):
        raise TypeError(f"prompts: {PROMPT_FORMS}, or a list of them; got {type(prompts).__name__}")
    prompts = list(prompts)
    if not prompts:
        raise ValueError("no prompts given")
    if all(isinstance(t, int) for t in prompts):
        return [prompts]  # one prompt as token ids
    return [_one_prompt(p, i) for i, p in enumerate(prompts)]


def _one_prompt(prompt, index: int):
    """One prompt of a list as a text or an id list (vLLM's TextPrompt / TokensPrompt dicts
    unwrapped: nothing else in them is taken)."""
    if isinstance(prompt, dict):
        if set(prompt) == {"prompt"}:
            prompt = prompt["prompt"]
        elif set(prompt) == {"prompt_token_ids"}:
            prompt = prompt["prompt_token_ids"]
        else:
            raise ValueError(f'prompts[{index}]: a prompt dict holds "prompt" (text) or "prompt_token_ids" '
                             f"(ids) alone, got keys {sorted(prompt)}")
    if isinstance(prompt, str):
        return prompt
    if hasattr(prompt, "__iter__") and not isinstance(prompt, (bytes, dict)):
        return list(prompt)  # its ids are checked with the request's limits
    raise TypeError(f"prompts[{index}]: {PROMPT_FORMS}; got {type(prompt).__name__}")
