"""The engine: requests in, tokens out, one `step()` at a time.

A step is: schedule -> fill the batch buffers -> backend.plan() -> model forward (backend.run()
in every layer) -> sample -> update requests (stop checks, detokenize) -> outputs.
"""

from __future__ import annotations

import itertools
import json
import logging
import time
from pathlib import Path

import torch

from flashlet.batch import StepBuffers
from flashlet.config import EngineConfig
from flashlet.kv_pool import KVPool
from flashlet.model import ModelConfig
from flashlet.model_runner import ModelRunner
from flashlet.request import Request, RequestOutput, RequestStatus
from flashlet.sampling import SamplingParams, make_generator, sample_one
from flashlet.scheduler import Scheduler
from flashlet.weights import load_model, random_model

log = logging.getLogger("flashlet")

PRESETS_DIR = Path(__file__).parent / "presets"


def preset_config_path(name_or_path: str) -> Path:
    """A preset name (e.g. qwen2.5-0.5b) or a config.json path -> the config file."""
    path = Path(name_or_path)
    if path.is_file():
        return path
    preset = PRESETS_DIR / f"{name_or_path}.json"
    if preset.is_file():
        return preset
    names = ", ".join(sorted(p.stem for p in PRESETS_DIR.glob("*.json")))
    raise ValueError(f"unknown config {name_or_path!r}: not a file and not a preset ({names})")


class Engine:
    def __init__(self, config: EngineConfig = EngineConfig()):
        self.config = config
        self.device = config.resolved_device()
        self.dtype = config.resolved_dtype()
        if config.device and self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("device cuda was asked for but CUDA is not available")
        ops = _ops_for(config, self.device)
        if config.config is not None:
            cfg = ModelConfig.from_file(preset_config_path(config.config))
            self.model = random_model(cfg, self.device, self.dtype, config.seed, ops=ops)
            self.tokenizer, self.model_dir = None, None
        else:
            self.model, self.tokenizer, self.model_dir = load_model(
                config.model, self.device, self.dtype, ops=ops)
        self.model_config = cfg = self.model.config
        self.max_model_len = min(config.max_model_len or cfg.max_position_embeddings,
                                 cfg.max_position_embeddings)
        self.eos_token_ids = self._eos_ids()
        self.kv_pool = KVPool(cfg.num_layers, self._num_pages(), config.page_size,
                              cfg.num_kv_heads, cfg.head_dim, self.dtype, self.device)
        self.scheduler = Scheduler(self.kv_pool.allocator, config.page_size, config.max_num_seqs,
                                   config.max_num_batched_tokens, config.enable_prefix_cache)
        max_pages_per_seq = -(-self.max_model_len // config.page_size)
        self.buffers = StepBuffers(config.max_num_batched_tokens, config.max_num_seqs,
                                   config.max_num_seqs * max_pages_per_seq, config.page_size,
                                   self.device)
        self.runner = ModelRunner(self.model, self.kv_pool, config, self.device, max_pages_per_seq)
        self.requests: dict[int, Request] = {}
        self._ids = itertools.count()
        self._pending: list[RequestOutput] = []  # outputs of aborts, sent with the next step
        self.num_steps = 0

    # ---- requests in ----------------------------------------------------------------------
    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None) -> int:
        """Queue a request; raises ValueError (allocating nothing) if it can never run."""
        params = params or SamplingParams()
        token_ids = self.encode(prompt)
        self.check_request(len(token_ids), params)
        req = Request(next(self._ids), token_ids, params, make_generator(params, self.device))
        self.requests[req.request_id] = req
        self.scheduler.add(req)
        return req.request_id

    def check_request(self, num_prompt_tokens: int, params: SamplingParams) -> None:
        """Raise ValueError if a request of this size could never run."""
        params.validate()
        total = num_prompt_tokens + params.max_new_tokens
        if total > self.max_model_len:
            raise ValueError(
                f"prompt ({num_prompt_tokens} tokens) + max_new_tokens ({params.max_new_tokens}) = "
                f"{total} exceeds the model's context of {self.max_model_len} tokens")
        pages = -(-total // self.config.page_size)
        if pages > self.kv_pool.num_pages:
            raise ValueError(
                f"request needs {pages} KV pages but the pool has only {self.kv_pool.num_pages}: "
                f"it could never run (raise max_num_pages or shorten it)")

    def encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass token ids, not text")
            token_ids = list(self.tokenizer.encode(prompt))
            if not token_ids:
                raise ValueError("prompt encodes to no tokens")
            return token_ids
        token_ids = list(prompt)
        if not token_ids:
            raise ValueError("prompt is empty")
        vocab = self.model_config.vocab_size
        if any(not isinstance(t, int) or not 0 <= t < vocab for t in token_ids):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        return token_ids

    def abort(self, request_id: int) -> bool:
        """Stop a request and free its pages now; False (a no-op) if it is unknown or done."""
        req = self.requests.get(request_id)
        if req is None or req.is_finished:
            log.info("abort of request %s is a no-op: %s", request_id,
                     "unknown" if req is None else "already finished")
            return False
        req.finish_reason = "abort"
        self.scheduler.finish(req)
        self._pending.append(self._output(req, [], self._emit(req, holdback=False)))
        del self.requests[request_id]
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._pending)

    # ---- one step -------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        outputs, self._pending = self._pending, []
        sched = self.scheduler.schedule()
        if not sched.scheduled:
            return outputs
        input_ids, meta, sampling = self.buffers.fill(sched)
        logits = self.runner.forward(input_ids, meta)
        for req, n in sched.scheduled:
            req.num_computed_tokens += n
        tokens = self._sample(logits, sampling)
        for req in sampling:
            outputs.append(self._append_token(req, tokens.get(req.request_id)))
        for req, _ in sched.scheduled:
            if not req.is_finished:
                self.scheduler.cache_computed_pages(req)
        self.num_steps += 1
        return outputs

    def _sample(self, logits: torch.Tensor, reqs: list[Request]) -> dict[int, int | Exception]:
        """logits [len(reqs), vocab] -> token per request id (or the exception that one raised)."""
        if not reqs:
            return {}
        greedy = logits.argmax(dim=-1).tolist()
        result = {}
        for i, req in enumerate(reqs):
            if req.params.is_greedy:
                result[req.request_id] = greedy[i]
                continue
            try:
                result[req.request_id] = int(sample_one(logits[i], req.params, req.generator))
            except Exception as e:  # one bad request must not fail the batch
                result[req.request_id] = e
        return result

    def _append_token(self, req: Request, token) -> RequestOutput:
        if isinstance(token, Exception) or token is None:
            req.finish_reason, req.error = "error", f"sampling failed: {token!r}"
            self.scheduler.finish(req)
            self.requests.pop(req.request_id, None)
            return self._output(req, [], "")
        if req.first_token_time is None:
            req.first_token_time = time.monotonic()
        req.output_token_ids.append(token)
        self._detokenize(req)
        p = req.params
        if not p.ignore_eos and token in self.eos_token_ids:
            req.finish_reason = "stop"
        elif p.stop and self._hit_stop_string(req):
            req.finish_reason = "stop"
        elif len(req.output_token_ids) >= p.max_new_tokens:
            req.finish_reason = "length"
        if req.finish_reason is not None:
            self.scheduler.finish(req)
            self.requests.pop(req.request_id, None)
        # Stop strings are cut before anything is emitted, and a tail that could still grow
        # into one is held back until the request finishes.
        return self._output(req, [token], self._emit(req, holdback=not req.is_finished))

    # ---- text -----------------------------------------------------------------------------
    def _detokenize(self, req: Request) -> None:
        """Decode the newest token into req.output_text.

        Decodes a two-offset window (as Hugging Face's TGI does) so that tokenizers which
        merge spaces across tokens give the same text as decoding everything at once."""
        if self.tokenizer is None:
            return
        ids = req.output_token_ids
        prefix = self.tokenizer.decode(ids[req.prefix_offset : req.read_offset],
                                       skip_special_tokens=True)
        full = self.tokenizer.decode(ids[req.prefix_offset :], skip_special_tokens=True)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):  # not a partial UTF-8 char
            req.output_text += full[len(prefix) :]
            req.prefix_offset, req.read_offset = req.read_offset, len(ids)

    def _emit(self, req: Request, holdback: bool) -> str:
        """Text not yet sent, minus a tail that could still become a stop string."""
        keep = max((len(s) for s in req.params.stop), default=1) - 1 if holdback else 0
        end = max(len(req.output_text) - keep, 0)
        if end <= req.num_sent_chars:
            return ""
        text, req.num_sent_chars = req.output_text[req.num_sent_chars : end], end
        return text

    def _hit_stop_string(self, req: Request) -> bool:
        found = [i for i in (req.output_text.find(s) for s in req.params.stop) if i >= 0]
        if not found:
            return False
        req.output_text = req.output_text[: min(found)]
        return True

    # ---- outputs and bookkeeping ----------------------------------------------------------
    def _output(self, req: Request, new_ids: list[int], new_text: str) -> RequestOutput:
        return RequestOutput(
            request_id=req.request_id, new_token_ids=new_ids, new_text=new_text,
            finished=req.is_finished, finish_reason=req.finish_reason,
            prompt_token_ids=req.prompt_token_ids,
            token_ids=list(req.output_token_ids) if req.is_finished else None,
            text=req.output_text, num_cached_tokens=req.num_cached_tokens, error=req.error)

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()

    def stats(self) -> dict:
        cache = self.scheduler.cache
        return {
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            "kv_pages_total": self.kv_pool.num_pages,
            "kv_pages_used": self.kv_pool.allocator.num_used,
            "kv_pages_cached": cache.num_pages,
            "prefix_cache_hit_rate": cache.hit_tokens / max(cache.queried_tokens, 1),
            "num_preemptions": self.scheduler.num_preemptions,
            "num_steps": self.num_steps,
        }

    def _eos_ids(self) -> set[int]:
        ids = set(self.model_config.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        gen_cfg = self.model_dir and Path(self.model_dir) / "generation_config.json"
        if gen_cfg and gen_cfg.exists():
            eos = json.loads(gen_cfg.read_text()).get("eos_token_id")
            ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        return ids

    def _num_pages(self) -> int:
        cfg, c = self.model_config, self.config
        if c.max_num_pages is not None:
            return c.max_num_pages
        per_page = KVPool.bytes_per_page(cfg.num_layers, c.page_size, cfg.num_kv_heads,
                                         cfg.head_dim, self.dtype)
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = free * c.gpu_memory_utilization
        else:
            budget = c.kv_memory_gb * 2**30
        # Never more than every sequence at full length needs.
        cap = c.max_num_seqs * -(-self.max_model_len // c.page_size)
        return max(1, min(int(budget // per_page), cap))


def _ops_for(config: EngineConfig, device: torch.device):
    """Fused Triton elementwise kernels on CUDA (any attention backend); else plain PyTorch."""
    if config.fused_ops and device.type == "cuda":
        from flashlet.kernels.ops import TritonOps

        return TritonOps
    return None

