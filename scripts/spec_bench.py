"""One stream with speculative decoding against the same engine without it, at set acceptance rates.

    python scripts/spec_bench.py [--config qwen2.5-0.5b ...] [--k 2 4 8] [--match 0.6 0.8 0.9 1.0]
                                 [--acceptance 0.7: the match that accepts 0.7 at each k]
                                 [--draft qwen2.5-0.5b] [--json OUT] [--served-rows 8] [--max-rounds 12]
                                 [--phases] [--repeats 5]
    python scripts/spec_bench.py --grid [--budget-s 240] [--phases]   # the issue's grid (GRID)

Random weights cannot agree with a proposer by chance, so the proposals here come from a known
continuation, as the issue's corrupted copy in the prompt would give them: an engine with
`speculative_config={"method": "ngram", ...}` runs the prompt with its proposer replaced by a
bench-only one (`CorruptedCopyProposer`) that proposes the next k tokens of the continuation
with a share 1 - `match` of them corrupted (each step's first corrupted proposal placed where
independent corruption of each token would place it, from evenly spread quantiles rather than
random draws, so one run's acceptance is the expected one: `expected_acceptance`). The
continuation is the speculating engine's own, for each k and match:
verify steps round differently from the fused one-row path, and a verify step's rows round
differently as the accepted lengths move the step boundaries, so at a near tie the output parts
from a continuation found another way, and after the parting nothing is proposed. So
`own_continuation` runs the engine on the copy of its last output until the output reproduces
itself (each round's first difference is later than the one before: the rows before it ran with
the same inputs), and the timed run then proposes along its whole length. The verify steps,
the acceptance and everything after them are the engine's own; only where the guesses come
from differs from a user's run. The acceptance rate printed is the engine's measured one
(`engine.stats()`), not `match`.

Each figure is 256 / seconds of one `LLM.generate` call of one 32-token prompt, 256 new tokens,
greedy, the median of --repeats (5) timed calls after a first untimed one (both engines have
compiled and captured by then). A row
also says the rounds its own continuation took to hold, and whether the timed run's output
equals it ("same"); the JSON says too whether it equals the plain engine's (greedy speculation
is lossless up to the verify step's rounding, which differs from the fused one-row path's: a
near tie may part them).

With --draft, a draft-model engine (`{"model": DRAFT, "num_speculative_tokens": k}`) runs too:
random draft weights are almost never accepted, so its row measures what a verify step with a
draft costs (ms per step), not its speed-up.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's flashlet

PROMPT_LEN, NEW_TOKENS = 32, 256


# Runs of the engine on its own output before a row gives up on a fixed point: each round moves
# the first parting later (a near tie each). The 0.5B shape's rows held within 6-12 rounds on the
# H200; the 7B's per-op verify steps (mixed steps, cuBLAS at 1 + k rows) parted more often: after
# 12 rounds every row still parted at token 102-185 (2026-12-02), so half of each run proposed
# nothing. A 7B round is ~1 s; 40 rounds bound a row at ~40 s.
MAX_ROUNDS = 40

# Timed calls a figure's median is taken over (--repeats).
REPEATS = 5


# Each step's share of intact proposals comes from an evenly spread sequence of quantiles (the
# golden ratio's multiples, mod 1) rather than from random draws: see CorruptedCopyProposer.
GOLDEN = (5**0.5 - 1) / 2


class CorruptedCopyProposer:
    """Bench only: proposes the next k tokens of a known continuation with one of them
    corrupted (as prompt lookup would find a copy of the text in the prompt with a share
    1 - match of its tokens changed), while the request's output agrees with the
    continuation; nothing once it parts.

    A step's proposals are accepted up to the first corrupted one, so only that position of a
    step matters: each step decides it (`intact_run`) as independent corruption at each position
    would, P(at least j intact) = match^j, but from an evenly spread quantile instead of a random
    draw. With random draws one 256-token run (50-130 steps) measured an acceptance up to 0.12
    from its expected value (k = 4 at match 0.86: 0.58, asked 0.70); with spread quantiles the
    run's mix of accepted lengths is the expected one, within 0.03 (tests/test_spec_bench.py's
    walks at k = 2/4/8 x 0.5/0.7/0.9, and the tiny CPU model's engine counts). The i-th step of
    a request always decides the same way, so a run that repeats the last one proposes the same
    tokens."""

    def __init__(self, continuation: list[int], match: float, vocab: int, seed: int = 0):
        self.continuation, self.match, self.vocab = list(continuation), match, vocab
        self.offset = (0.5 + seed * GOLDEN) % 1.0  # where a request's sequence of quantiles starts
        self._agreed: dict[int, int] = {}  # request id -> output tokens checked against it
        self._steps: dict[int, int] = {}  # request id -> steps it was proposed for

    def intact_run(self, step: int, k: int) -> int:
        """How many of the `step`-th step's k proposals come before its first corrupted one
        (k: none corrupted)."""
        quantile = (self.offset + step * GOLDEN) % 1.0
        return sum(quantile < self.match**j for j in range(1, k + 1))

    def propose(self, requests, k: int) -> list[list[int]]:
        return [self._proposal(req, k) if self._agrees(req) else [] for req in requests]

    def _proposal(self, req, k: int) -> list[int]:
        at, step = len(req.output_token_ids), self._steps.get(req.request_id, 0)
        self._steps[req.request_id] = step + 1
        tokens = self.continuation[at: at + k]
        wrong = self.intact_run(step, k)
        if wrong < len(tokens):
            tokens[wrong] = (tokens[wrong] + 1) % self.vocab
        return tokens

    def _agrees(self, req) -> bool:
        """Does the request's output so far agree with the continuation (checked incrementally)."""
        done, checked = req.output_token_ids, self._agreed.get(req.request_id, 0)
        if checked < 0:
            return False
        ok = list(done[checked:]) == self.continuation[checked: len(done)]
        self._agreed[req.request_id] = len(done) if ok else -1
        return ok

    def on_accepted(self, request, num_accepted: int) -> None:
        pass

    def release(self, request) -> None:
        self._agreed.pop(request.request_id, None)
        self._steps.pop(request.request_id, None)


def expected_acceptance(match: float, k: int) -> float:
    """The share of k proposals a step accepts on average when each position of the copy is
    intact with probability `match`: a step accepts up to its first corrupted position, so
    proposal j is accepted with probability match^j."""
    return sum(match**j for j in range(1, k + 1)) / k


def match_for_acceptance(acceptance: float, k: int) -> float:
    """The match rate whose corrupted copy is accepted at `acceptance` with k proposals a step
    (expected_acceptance solved by bisection: it rises with the match)."""
    if not 0 < acceptance <= 1:
        raise ValueError(f"--acceptance must be in (0, 1], got {acceptance}")
    lo, hi = 0.0, 1.0
    for _ in range(50):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if expected_acceptance(mid, k) < acceptance else (lo, mid)
    return hi


def own_continuation(llm, prompt: list[int], start: list[int], k: int, match: float,
                     max_rounds: int = MAX_ROUNDS) -> tuple[list[int], int, bool]:
    """The continuation that the speculating engine reproduces when proposed its corrupted
    copy (seed k) -> (it, rounds run, whether it held), from `start` (a first guess)."""
    vocab = llm.engine.model_config.vocab_size
    known = start
    for rounds in range(1, max_rounds + 1):
        llm.engine.spec.proposer = CorruptedCopyProposer(known, match, vocab, seed=k)
        tokens = generate(llm, prompt)
        if tokens == known:
            return known, rounds, True
        known = tokens
    return known, max_rounds, False


def generate(llm, prompt: list[int]) -> list[int]:
    from flashlet import SamplingParams

    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    return list(llm.generate([prompt], params)[0].token_ids)


def timed_generate(llm, prompt: list[int], phases: "StepPhases | None" = None,
                   repeats: int = 1) -> tuple[float, list[int], int]:
    """(tok/s, tokens, steps) after an untimed first call: the median tok/s of `repeats` timed
    calls (one 256-token call of the 0.5B shape is ~0.1 s, so one call alone moves with a host
    hiccup), the tokens and steps of that median call (phases: reset before the timed calls, so
    they time those calls' steps)."""
    import torch

    generate(llm, prompt)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    if phases is not None:
        phases.reset()
    runs = []
    for _ in range(repeats):
        steps = llm.engine.num_steps
        t0 = time.perf_counter()
        tokens = generate(llm, prompt)
        seconds = time.perf_counter() - t0
        runs.append((NEW_TOKENS / seconds, tokens, llm.engine.num_steps - steps))
    runs.sort(key=lambda run: run[0])
    return runs[len(runs) // 2]


class StepPhases:
    """Host time of each part of the engine's step, summed over the steps run while attached
    (perf_counter: on a GPU `read` includes the wait for the device). Between `read` and the
    next step's `launch`, a speculating step's host work is not overlapped with the device."""

    PARTS = (("read", "engine._token_buffers", "read"),  # wait + copy of a step's tokens
             ("finish", "engine", "_finish"),  # read, verify, scheduler.update (outputs)
             ("update", "engine.scheduler", "update"),
             ("propose", "engine.spec", "propose"),
             ("schedule", "engine.scheduler", "schedule"),
             ("prepare", "engine.runner", "prepare"),  # the batch update -> the step's layout
             ("load", "engine.runner", "load"),  # into the step buffers (to the device)
             ("greedy_tokens", "engine.runner", "greedy_tokens"),  # plan + fused graph replay
             ("forward", "engine.runner", "forward"),  # plan + replay / eager forward
             ("launched", "engine", "_launched_verify"))  # stage the tokens to the host

    def __init__(self, engine, clock=time.perf_counter):
        """clock: perf_counter (wall: with the device's waits), or process_time (this
        process's CPU: host work alone, steadier on a shared machine)."""
        self.engine, self.seconds, self.steps, self.clock = engine, {}, 0, clock
        for name, owner, attr in self.PARTS:
            for target in self._owners(owner):
                if getattr(target, attr, None) is not None:
                    setattr(target, attr, self._timed(name, getattr(target, attr)))
        engine.step = self._timed("step", engine.step, count=True)

    def _owners(self, path: str) -> list:
        owner = self.engine
        for attr in path.split(".")[1:]:
            owner = getattr(owner, attr)
        return owner if isinstance(owner, list) else [owner]

    def _timed(self, name: str, fn, count: bool = False):
        clock = self.clock

        def timed(*args, **kwargs):
            started = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[name] = self.seconds.get(name, 0.0) + clock() - started
                self.steps += count
        return timed

    def reset(self) -> None:
        self.seconds, self.steps = {}, 0

    def per_step_us(self) -> dict[str, float]:
        """Each part's microseconds a step; "step - read" is the step's host work besides the
        wait for the device (with speculation, the host's gap between two verify steps)."""
        us = {name: s / max(self.steps, 1) * 1e6 for name, s in self.seconds.items()}
        if "step" in us and "read" in us:
            us["step - read"] = us["step"] - us["read"]
        return us

    def line(self) -> str:
        return phases_text(self.per_step_us())


def phases_text(host_us: dict[str, float]) -> str:
    """'name us, ...': each part's host microseconds a step."""
    return ", ".join(f"{name} {us:.1f}" for name, us in host_us.items())


def count_fused_verify_steps(engine) -> list[int]:
    """Counts the verify steps the runner loads as fused decode rows (after this call)."""
    count, runner = [0], engine.runner
    real_load = runner.load

    def load(layout, *args, **kwargs):
        loaded = real_load(layout, *args, **kwargs)
        count[0] += loaded[1].host.verify_as_decode_rows
        return loaded

    runner.load = load
    return count


def spec_counters(llm) -> tuple[int, int, int]:
    s = llm.engine.spec.stats
    return s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens


def run_config(config: str, ks: list[int], matches: list[float], draft: str | None,
               max_rounds: int = MAX_ROUNDS, phases: bool = False,
               acceptance: list[float] | None = None, repeats: int = REPEATS,
               engine_args: dict | None = None) -> dict:
    """acceptance: instead of `matches`, for each k the matches expected to give these
    acceptance rates (match_for_acceptance). Each row is printed as it is measured (a run cut
    short still shows its rows)."""
    from flashlet import LLM

    common = dict(config=config, dtype="bfloat16", max_num_pages=4096, **(engine_args or {}))
    with LLM(**common) as llm:
        vocab = llm.engine.model_config.vocab_size
        prompt = [(i * 7919 + 11) % vocab for i in range(PROMPT_LEN)]
        plain_phases = StepPhases(llm.engine) if phases else None
        base_tok_s, base_tokens, base_steps = timed_generate(llm, prompt, plain_phases, repeats)
        fused = llm.engine.runner.fused is not None
    result = {"config": config, "plain": {"tok_s": base_tok_s, "steps": base_steps, "fused_decode": fused},
              "ngram": []}
    if plain_phases is not None:
        result["plain"]["host_us"] = plain_phases.per_step_us()
    print(plain_line(config, result["plain"]), flush=True)
    spec = {"method": "ngram", "num_speculative_tokens": max(ks)}
    with LLM(**common, speculative_config=spec) as llm:
        known = base_tokens
        fused_verify = count_fused_verify_steps(llm.engine)
        spec_phases = StepPhases(llm.engine) if phases else None
        for k in ks:
            llm.engine.spec.config = llm.engine.spec.config.replace(num_speculative_tokens=k)
            asked = [None] * len(matches) if acceptance is None else acceptance
            row_matches = matches if acceptance is None else [match_for_acceptance(a, k) for a in acceptance]
            for rate, match in zip(asked, row_matches):
                row, known = ngram_row(llm, prompt, known, k, match, fused_verify, max_rounds,
                                       spec_phases, repeats)
                row.update(asked=rate, speedup=row["tok_s"] / base_tok_s,
                           same_as_plain=row.pop("tokens") == base_tokens)
                print(row_line(config, row), flush=True)
                result["ngram"].append(row)
    if draft:
        try:
            result["draft"] = draft_cost(common, prompt, draft, base_tok_s, base_steps,
                                         repeats=repeats)
        except Exception as e:  # the n-gram rows above still print
            result["draft"] = {"draft": draft, "error": f"{type(e).__name__}: {e}"}
    return result


def ngram_row(llm, prompt: list[int], known: list[int], k: int, match: float,
              fused_verify: list[int], max_rounds: int = MAX_ROUNDS,
              phases: "StepPhases | None" = None, repeats: int = REPEATS) -> tuple[dict, list[int]]:
    """One row: the engine's own continuation at (k, match) found, then one timed call proposing
    its corrupted copy -> (the row, that continuation)."""
    vocab = llm.engine.model_config.vocab_size
    known, rounds, held = own_continuation(llm, prompt, known, k, match, max_rounds)
    llm.engine.spec.proposer = CorruptedCopyProposer(known, match, vocab, seed=k)
    before, fused_before = spec_counters(llm), fused_verify[0]
    tok_s, tokens, steps = timed_generate(llm, prompt, phases, repeats)
    # the counters span every call (the untimed one runs the same proposals)
    drafts, proposed, accepted = (b - a for a, b in zip(before, spec_counters(llm)))
    parted = next((i for i, (a, b) in enumerate(zip(tokens, known)) if a != b), None)
    return {"k": k, "match": match, "tok_s": tok_s, "acceptance_rate": accepted / proposed if proposed else 0.0,
            "mean_accepted_length": 1 + accepted / drafts if drafts else 1.0,
            "steps": steps, "rounds": rounds, "held": held,
            "fused_verify_share": (fused_verify[0] - fused_before) / drafts if drafts else 0.0,
            "same_tokens": tokens == known, "parted_at": parted, "tokens": tokens,
            **({"host_us": phases.per_step_us()} if phases is not None else {})}, known


def draft_cost(common: dict, prompt: list[int], draft: str, base_tok_s: float, base_steps: int,
               k: int = 4, repeats: int = REPEATS) -> dict:
    from flashlet import LLM

    with LLM(**common, speculative_config={"model": draft, "num_speculative_tokens": k}) as llm:
        tok_s, tokens, steps = timed_generate(llm, prompt, repeats=repeats)
        return {"draft": draft, "k": k, "tok_s": tok_s, "steps": steps,
                "ms_per_step": 1000 * NEW_TOKENS / tok_s / steps,
                "plain_ms_per_step": 1000 * NEW_TOKENS / base_tok_s / base_steps,
                "acceptance_rate": llm.engine.stats().get("spec_acceptance_rate")}


def print_table(results: list[dict]) -> None:
    print(f"one stream, {PROMPT_LEN}-token prompt, {NEW_TOKENS} new tokens, greedy, bf16, default settings; "
          "fused: the share of verify steps run as fused decode rows; "
          "rounds: runs until the engine's own continuation held (held: no)")
    print(f"{'config':14} {'k':>2} {'asked':>5} {'match':>6} {'accept':>7} {'len':>5} {'tok/s':>8} "
          f"{'x plain':>8} {'ms/step':>8} {'fused':>6} {'rounds':>6} {'same':>6}")
    for res in results:
        if "skipped" in res:
            print(f"{res['config']:14} not run: {res['skipped']}")
            continue
        print(plain_line(res["config"], res["plain"]))
        print_phases(res["plain"])
        for row in res["ngram"]:
            print(row_line(res["config"], row))
            print_phases(row)
        if "draft" in res and "error" in res["draft"]:
            print(f"{res['config']:14} draft {res['draft']['draft']}: {res['draft']['error']}")
        elif "draft" in res:
            d = res["draft"]
            print(f"{res['config']:14} draft {d['draft']} k={d['k']}: {d['ms_per_step']:.3f} ms a step "
                  f"(plain {d['plain_ms_per_step']:.3f}), {d['tok_s']:.0f} tok/s")


def plain_line(config: str, plain: dict) -> str:
    return (f"{config:14} {'-':>2} {'-':>5} {'-':>6} {'-':>7} {'1.00':>5} {plain['tok_s']:8.0f} "
            f"{1.0:8.2f} {ms_per_step(plain):8.3f} {'':>6} {'':>6} {'':>6}  "
            f"(fused decode: {plain['fused_decode']})")


def row_line(config: str, row: dict) -> str:
    rounds = f"{row['rounds']}" + ("" if row["held"] else " (held: no)")
    asked = "-" if row.get("asked") is None else f"{row['asked']:.2f}"
    return (f"{config:14} {row['k']:2d} {asked:>5} {row['match']:6.2f} {row['acceptance_rate']:7.2f} "
            f"{row['mean_accepted_length']:5.2f} {row['tok_s']:8.0f} {row['speedup']:8.2f} "
            f"{ms_per_step(row):8.3f} {row['fused_verify_share']:6.2f} {rounds:>6} "
            f"{'yes' if row['same_tokens'] else 'at ' + str(row['parted_at']):>6}")


def print_phases(row: dict) -> None:
    if "host_us" in row:
        print("    host us/step (finish holds read, update; read waits for the device): "
              + phases_text(row["host_us"]))


def ms_per_step(row: dict) -> float:
    return 1000 * NEW_TOKENS / row["tok_s"] / row["steps"]


# The grid (`--grid`): each config with its k values and acceptance rates, in order;
# a config after the first starts only within --budget-s (the 7B rows if time allows).
GRID = (("qwen2.5-0.5b", (2, 4, 8), (0.5, 0.7, 0.9)),
        ("qwen2.5-7b", (2, 4, 8), (0.5, 0.7, 0.9)))
GRID_BUDGET_S = 240  # seconds; the 0.5B grid took 75-80 s on the H200 (2026-12-02), the 7B's
# k = 4 rows did not finish in the 255 s left of a 330 s call: run the 7B as its own call
# (--config qwen2.5-7b --k 4 2 8 --acceptance 0.7 0.5 0.9 --repeats 3), ~5-8 min


def planned_runs(args) -> list[tuple[str, list[int], list[float] | None]]:
    """(config, ks, acceptance rates or None for --match) for each config to run, in order."""
    if args.grid:
        return [(config, list(ks), list(rates)) for config, ks, rates in GRID]
    return [(config, args.k, args.acceptance) for config in args.config]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", nargs="+", default=["qwen2.5-0.5b"])
    ap.add_argument("--k", nargs="+", type=int, default=[2, 4, 8])
    ap.add_argument("--match", nargs="+", type=float, default=[0.6, 0.8, 0.9, 1.0])
    ap.add_argument("--acceptance", nargs="+", type=float, default=None, metavar="A",
                    help="instead of --match: for each k, the match expected to accept A of the "
                         "proposals (k = 4 at 0.7: match 0.86); the accept column is measured")
    ap.add_argument("--grid", action="store_true",
                    help="the issue's grid instead of --config/--k/--acceptance: " + "; ".join(
                        f"{c} k {' '.join(map(str, ks))} at {' '.join(map(str, a))}"
                        for c, ks, a in GRID) + " (a later config only within --budget-s)")
    ap.add_argument("--budget-s", type=float, default=None, metavar="S",
                    help="start no config after the first once S seconds have passed "
                         f"(default with --grid: {GRID_BUDGET_S})")
    ap.add_argument("--draft", default=None, help="a draft model (preset or path) for the last config")
    ap.add_argument("--json", type=Path, default=None, help="the results, written after each config")
    ap.add_argument("--max-rounds", type=int, default=MAX_ROUNDS,
                    help="runs a row may take to find the continuation its engine reproduces")
    ap.add_argument("--no-fused-decode", action="store_true",
                    help="both engines per-op (fused_decode=False), as a model the fused path declines runs")
    ap.add_argument("--repeats", type=int, default=REPEATS,
                    help="timed calls a figure is the median of")
    ap.add_argument("--phases", action="store_true",
                    help="time each part of the engine's step on the host (StepPhases) in the timed runs")
    ap.add_argument("--served-rows", type=int, default=None, metavar="N",
                    help="a measurement: the fused path serves steps of up to N rows (SERVED_ROWS, "
                         "as tests/gpu force it), so one stream's verify steps of up to N tokens run fused")
    args = ap.parse_args()
    if args.served_rows is not None:
        from flashlet.runner import fused_decode

        fused_decode.SERVED_ROWS = args.served_rows
        print(f"fused_decode.SERVED_ROWS set to {args.served_rows} (a measurement, not the default)")
    budget = args.budget_s if args.budget_s is not None else GRID_BUDGET_S if args.grid else None
    runs, results, started = planned_runs(args), [], time.perf_counter()
    for i, (config, ks, rates) in enumerate(runs):
        elapsed = time.perf_counter() - started
        if i and budget is not None and elapsed > budget:
            print(f"{config}: not run ({elapsed:.0f} s > --budget-s {budget:.0f})", flush=True)
            results.append({"config": config, "skipped": f"{elapsed:.0f} s > budget {budget:.0f} s"})
        else:
            draft = args.draft if i == len(runs) - 1 else None
            results.append(run_config(config, ks, args.match, draft, args.max_rounds, args.phases,
                                      rates, args.repeats,
                                      {"fused_decode": False} if args.no_fused_decode else None))
            print(f"{config}: {len(results[-1]['ngram'])} rows in "
                  f"{time.perf_counter() - started - elapsed:.0f} s", flush=True)
        if args.json:  # what ran so far (and what the budget skipped) survives a run cut short
            args.json.write_text(json.dumps(results, indent=1))
    print_table(results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
