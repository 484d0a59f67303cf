"""Hugging Face transformers `generate` on the engine's own weights and prompts, as a peer.

- `hf`: dynamic cache, eager forward; batches left-padded to their longest prompt.
- `hf-static`: `cache_implementation="static"`, which makes transformers torch.compile the
  decode forward on CUDA (its auto-compile); every batch is padded to one shape (prompt length
  and rows) so one compilation serves the level. CPU: skipped.

Greedy, `min_new_tokens = max_new_tokens` so lengths are exact. Token arrival times come from a
StoppingCriteria called after every generated token (with a CUDA synchronize). A static batch
generates the longest output of its rows; shorter rows count only the tokens they asked for.
"""

from __future__ import annotations

import torch

from flashlet.bench.common import NO_PROGRESS, Progress, Spec, make_specs, now, ratio, summarize, synchronizer
from flashlet.bench.trace import Trace
from flashlet.bench.workloads import level_specs, offline_specs, single_figures

PEERS = ("hf", "hf-static")


def unavailable(kind: str, device: torch.device) -> str | None:
    """Why `kind` cannot run on `device` (None: it can)."""
    if kind == "hf-static" and torch.device(device).type != "cuda":
        return "skipped: hf-static (static cache + torch.compile) runs on CUDA only"
    return None


def _clock_class():
    from transformers import StoppingCriteria

    class Clock(StoppingCriteria):
        """Records when each generated token exists; never stops generation."""

        def __init__(self, device):
            self.sync = synchronizer(device)
            self.times: list[float] = []

        def __call__(self, input_ids, scores, **kwargs):
            self.sync()
            self.times.append(now())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    return Clock


class HFRunner:
    def __init__(self, model, device, static: bool):
        from transformers import GenerationConfig, StoppingCriteriaList

        self.model, self.device, self.static = model, torch.device(device), static
        self.sync = synchronizer(self.device)
        self._Clock, self._List, self._GenConfig = _clock_class(), StoppingCriteriaList, GenerationConfig
        gen = getattr(model, "generation_config", None)
        eos = getattr(gen, "eos_token_id", None) or getattr(model.config, "eos_token_id", None)
        pad = getattr(gen, "pad_token_id", None)
        if pad is None:
            pad = eos[0] if isinstance(eos, list) else eos if eos is not None else 0
        self.eos, self.pad = eos, pad

    def generate(self, prompts: list[list[int]], new_tokens: int, pad_to: int | None = None,
                 rows: int | None = None, max_cache_len: int | None = None):
        """One left-padded batch -> (start, end, token times, new token ids per row).
        `rows` pads the batch with copies of the first prompt (static shapes); `max_cache_len`
        sizes the static cache for the worst case, so that calls of any length up to it reuse
        one compiled decode graph."""
        L = max(pad_to or 0, max(len(p) for p in prompts))
        padded = list(prompts) + [prompts[0]] * ((rows or len(prompts)) - len(prompts))
        ids = torch.full((len(padded), L), self.pad, dtype=torch.long)
        mask = torch.zeros((len(padded), L), dtype=torch.long)
        for i, p in enumerate(padded):
            ids[i, L - len(p):] = torch.tensor(p)
            mask[i, L - len(p):] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        extra = {"cache_implementation": "static", "max_cache_len": max_cache_len} if self.static else {}
        cfg = self._GenConfig(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                              num_beams=1, pad_token_id=self.pad, eos_token_id=self.eos,
                              use_cache=True, **extra)
        clock = self._Clock(self.device)
        self.sync()
        t0 = now()
        with torch.inference_mode():
            out = self.model.generate(input_ids=ids, attention_mask=mask, generation_config=cfg,
                                      stopping_criteria=self._List([clock]))
        self.sync()
        t1 = now()
        new = out[: len(prompts), L:].tolist()
        if any(len(r) != new_tokens for r in new) or len(clock.times) != new_tokens:
            raise RuntimeError(f"HF generated {len(clock.times)} steps, asked for {new_tokens}")
        return t0, t1, clock.times, new

    def warmup(self, prompts, new_tokens: int, pad_to=None, rows=None, max_cache_len=None):
        """Untimed first calls: lazy initialisation; with a static cache, torch.compile and the
        CUDA-graph recording of the decode step at the timed shapes (same rows, same cache
        length), with a few tokens only."""
        if self.static:
            for _ in range(2):
                self.generate(prompts, min(new_tokens, 4), pad_to, rows, max_cache_len)
        else:
            self.generate(prompts[:2], min(new_tokens, 2))

    def trace(self, specs: list[Spec], batch_size: int, task=None) -> Trace:
        """Static batches of `batch_size` over `specs`, back to back. TTFT of a row is from its
        batch's start (a closed-loop client resubmits when its batch ends: no queue)."""
        batches = [specs[i : i + batch_size] for i in range(0, len(specs), batch_size)]
        pad_to = max(s.prompt_len for s in specs) if self.static else None
        rows = min(batch_size, len(specs)) if self.static else None
        gen_all = max(s.max_new_tokens for s in specs) if self.static else None
        cache_len = pad_to + gen_all if self.static else None
        self.warmup([s.prompt for s in batches[0]], gen_all or 2, pad_to, rows, cache_len)
        trace = Trace(requested=[s.max_new_tokens for s in specs],
                      prompt_lens=[s.prompt_len for s in specs])
        generated, i = 0, 0
        for batch in batches:
            gen = gen_all or max(s.max_new_tokens for s in batch)
            t0, t1, times, new = self.generate([s.prompt for s in batch], gen, pad_to, rows,
                                               cache_len)
            if i == 0:
                trace.start = t0
            trace.end = t1
            trace.step_s += [times[0] - t0] + [b - a for a, b in zip(times, times[1:])]
            generated += gen * (rows or len(batch))
            for j, s in enumerate(batch):
                trace.submit[i] = t0
                trace.token_times[i] = times[: s.max_new_tokens]
                trace.outputs[i] = new[j][: s.max_new_tokens]
                i += 1
                if task is not None:
                    task.advance()
        trace.extra = {"generated_tokens": generated, "batch_size": batch_size,
                       "padded_prompt_len": pad_to}
        return trace


def match(ours: list | None, theirs: list) -> dict | None:
    """How many requests produced the same greedy tokens on both sides."""
    if not ours:
        return None
    pairs = [(a, b) for a, b in zip(ours, theirs) if a is not None and b is not None]
    if not pairs:
        return None
    return {"compared": len(pairs), "identical": sum(a == b for a, b in pairs),
            "first_token_identical": sum(a[:1] == b[:1] for a, b in pairs)}


def _describe(kind: str) -> dict:
    return {"peer": kind, "cache": "static" if kind == "hf-static" else "dynamic",
            "compiled": kind == "hf-static",
            "note": "transformers generate, greedy, min_new_tokens = max_new_tokens, left padding; "
                    "static batches back to back (TTFT from the batch start)"}


def run(kind: str, model, workload: str, args, ours: dict, vocab: int, device,
        progress: Progress = NO_PROGRESS) -> dict:
    """Run peer `kind` on the workload's own prompts; returns its figures and ratios to ours."""
    reason = unavailable(kind, device)
    if reason:
        return {**_describe(kind), "skipped": reason}
    runner = HFRunner(model, device, static=(kind == "hf-static"))
    try:
        fn = {"closed-loop": _closed_loop, "decode-sat": _decode_sat, "single": _single,
              "offline": _offline}[workload]
        return {**_describe(kind), **fn(runner, args, ours, vocab, progress, kind)}
    except torch.OutOfMemoryError as e:
        return {**_describe(kind), "error": f"out of memory: {str(e).splitlines()[0][:200]}"}
    except Exception as e:  # noqa: BLE001 - a failing peer must not lose our own figures
        import sys
        import traceback

        traceback.print_exc(file=sys.stderr)
        return {**_describe(kind), "error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}


def _closed_loop(runner, args, ours, vocab, progress, kind) -> dict:
    levels = []
    ours_by_c = {lv["concurrency"]: lv for lv in ours["levels"]}
    for li, c in enumerate(args.concurrency):
        specs = level_specs(args, vocab, li)[: args.peer_max_requests]
        task = progress.task(f"{kind} c={c}", len(specs))
        trace = runner.trace(specs, c, task)
        m = trace.metrics()
        mine = ours_by_c[c]
        m.update(concurrency=c, token_match=match(ours.get("_outputs", {}).get(c), trace.outputs),
                 ratio_output_tok_s=ratio(mine["output_tok_s"], m["output_tok_s"]),
                 ratio_requests_per_s=ratio(mine["requests_per_s"], m["requests_per_s"]))
        levels.append(m)
    return {"levels": levels}


def _decode_sat(runner, args, ours, vocab, progress, kind) -> dict:
    B, P, D = args.decode_batch, args.decode_prompt_len, args.decode_tokens
    specs = make_specs(B, (P, P), (D + 1, D + 1), vocab, args.seed, stream=1)
    prompts = [s.prompt for s in specs]
    runner.warmup(prompts, D + 1, max_cache_len=P + D + 1)
    task = progress.task(f"{kind} decode B={B}", 1)
    t0, t1, times, new = runner.generate(prompts, D + 1, max_cache_len=P + D + 1)
    task.advance()
    decode_s = times[-1] - times[0]
    steps = [b - a for a, b in zip(times, times[1:])]
    tokens = B * D
    return {"batch": B, "prompt_len": P, "decode_steps": D, "decode_tokens": tokens,
            "decode_time_s": decode_s, "decode_tok_s": tokens / decode_s,
            "ms_per_step": decode_s / D * 1e3, "step_ms": summarize(steps, 1e3),
            "prefill_s": times[0] - t0,
            "ratio_decode_tok_s": ratio(ours["decode_tok_s"], tokens / decode_s)}


def _single(runner, args, ours, vocab, progress, kind) -> dict:
    P, T = args.single_prompt_len, args.single_tokens
    specs = make_specs(1, (P, P), (T, T), vocab, args.seed, stream=1)
    runner.warmup([specs[0].prompt], T, max_cache_len=P + T)
    task = progress.task(f"{kind} single", 1)
    t0, _, times, new = runner.generate([specs[0].prompt], T, max_cache_len=P + T)
    task.advance()
    fig = single_figures(times, t0, T, ours["bytes_per_token"], ours["copy_bandwidth"])
    fig.update(output_tokens=len(new[0]), token_match=match(ours.get("_outputs", {}).get(1), new),
               ratio_decode_tok_s=ratio(ours["decode_tok_s"], fig["decode_tok_s"]))
    return fig


def _offline(runner, args, ours, vocab, progress, kind) -> dict:
    specs = offline_specs(args, vocab)[: args.peer_max_requests]
    batch = args.peer_batch_size or len(specs)
    task = progress.task(f"{kind} offline", len(specs))
    trace = runner.trace(specs, batch, task)
    m = trace.metrics()
    key = next(iter(ours.get("_outputs", {})), None)
    m.update(total_time_s=m["duration_s"],
             token_match=match(ours["_outputs"][key][: len(specs)] if key else None, trace.outputs),
             ratio_output_tok_s=ratio(ours["output_tok_s"], m["output_tok_s"]),
             note_tokens="output tok/s counts the tokens each request asked for; a static batch "
                         "generates its longest output for every row (generated_tokens)")
    return m
