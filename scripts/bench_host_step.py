"""Host time of one `engine.step()` where the model's forward costs next to nothing: a 1-layer,
hidden-32 Qwen2 on the CPU (torch backend, one thread), N requests of 100-token prompts
decoding (up to 400 tokens each, 400 x (1 + K) with --spec K; the tiny model's context is
sized to hold them). What is left is the engine's own Python a step (schedule, layout, load,
sampler, update, outputs), the part that bounds a fast GPU's step (issues 13 and 16), and,
while speculating, the part a GPU does not overlap (issue 30).

    python scripts/bench_host_step.py                     # 1, 64 and 256 requests
    python scripts/bench_host_step.py --seqs 256 --profile 20   # and a cProfile of 20 steps
    python scripts/bench_host_step.py --stub-forward      # the host work alone (see below)
    python scripts/bench_host_step.py --seqs 1 --stub-forward --spec 4 --accept 0.7 --phases
                                                          # a speculating step, by part
    python scripts/bench_host_step.py --seqs 1 --stub-forward --spec 3 --fused --phases
                                                          # ... on the fused path (as on a GPU)
    python scripts/bench_host_step.py --seqs 1 4 --stub-forward --fused --graphs [--steady off] --phases
                                                          # decode steps replayed from stand-in
                                                          # graphs, steady replay on (default) or off

Prints the median CPU ms per step, and the part outside the model's forward, over --rounds
rounds of --steps steps each (after a warm-up, and with start-up's heap settled as an engine on
a GPU settles it: engine.settle_heap). The CPU forward evicts the host's caches between
steps (the host work after it runs ~2x slower than warm here), which a GPU step's graph replay
does not: --stub-forward replaces the forward with a fixed table of logits, so a step is the
engine's host work alone, in caches as warm as it leaves them. --graphs runs the decode steps
through the runner's CUDA-graph path (padding, planning, the address check, replay) with each
graph a stand-in that replays the stubbed step (tests/test_step_layout.py's); --steady on / off
sets model_runner.STEADY_REPLAY (the graphs move their inputs on, a steady step loads nothing;
on by default).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
# this checkout's flashlet, its test helpers (tests.*: a bare `conftest` may be another
# folder's, in a pytest session) and scripts
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]
from tests.conftest import save_tiny_model  # noqa: E402
from spec_bench import StepPhases  # noqa: E402

from flashlet import Engine, EngineConfig, SamplingParams  # noqa: E402
from flashlet.core.engine import settle_heap  # noqa: E402
from flashlet.runner.fused_decode import FusedParts  # noqa: E402


def new_tokens(spec_k: int) -> int:
    return 400 * (1 + spec_k)


def decoding_engine(folder: str, num_seqs: int, spec_k: int = 0, fused: bool = False,
                    gpu_attention_plan: bool = False) -> Engine:
    """An engine with `num_seqs` requests past their prompts, decoding (with spec_k: n-gram
    speculation of that many tokens; fused: on the fused decode path, `reference_fused_path`;
    gpu_attention_plan: its steps planned by the triton one-launch attention a GPU's fused
    path runs, not the CPU's torch batched decode, whose kernels a stubbed step never runs)."""
    spec = {"method": "ngram", "num_speculative_tokens": spec_k} if spec_k else None
    parts = FusedParts(attn=True) if gpu_attention_plan else None
    engine = Engine(EngineConfig(model=folder, backend="torch", max_num_pages=9000,
                                 max_num_seqs=512, speculative_config=spec, fused_decode=fused or None),
                    fused_parts=parts)
    # A verify step takes up to 1 + k tokens: a longer output keeps it decoding as long.
    params = SamplingParams(max_new_tokens=new_tokens(spec_k), ignore_eos=True)
    for b in range(num_seqs):
        engine.add_request([(b * 7 + i) % 200 + 2 for i in range(100)], params)
    for _ in range(30):
        engine.step()
    # As an engine on a GPU does at start: the collector no longer walks start-up's objects
    # (torch's, the model's), which the CPU engine leaves in its reach.
    settle_heap()
    return engine


def reference_fused_path() -> None:
    """The fused decode path on the CPU, each GEMV its fp32 reference (as tests/test_fused_decode
    runs it): the host work of its steps (verify steps as decode rows, its attention's plan) runs
    as on a GPU; --stub-forward then stubs its tokens."""
    from tests.test_fused_decode import ReferenceGemv

    from flashlet.runner import fused_decode

    fused_decode.CuteGemv = ReferenceGemv
    fused_decode.cute_available = lambda: (True, "")
    fused_decode.check_fused_decode = lambda *args, **kwargs: None


def periodic_tokens(positions: torch.Tensor, accept: float, vocab: int) -> torch.Tensor:
    """The stub's token after each position: a periodic text, departed from at a fixed share
    1 - accept of positions (so prompt lookup, proposing the last period, is accepted at about
    that rate)."""
    after = positions + 1
    departs = (after * 2654435761) % 1000 >= int(accept * 1000)
    return torch.where(departs, after % 5 + 3, after % 50 + 10) % vocab


def stub_forward(engine: Engine, accept: float | None = None) -> None:
    """The runner's forward -> a fixed table's first rows: no model, no attention (the tokens
    still differ from row to row, so requests do not all share their pages). With `accept`
    (speculation), each row's argmax follows a periodic text by position instead, departing
    from it at a fixed share 1 - accept of positions, so prompt lookup's proposals (the text's
    last period) are accepted at about that rate."""
    vocab = engine.model_config.vocab_size
    if accept is None:
        table = torch.randn(engine.config.max_num_seqs, vocab,
                            generator=torch.Generator().manual_seed(0))
        engine.runner.forward = lambda input_ids, meta: table[: meta.logits_indices.shape[0]]
        return
    # (a table by position: a torch op on the CPU costs microseconds, the stub must not)
    tokens = periodic_tokens(torch.arange(engine.max_model_len + 1), accept, vocab)
    logits = torch.eye(vocab)[tokens]
    engine.runner.forward = lambda input_ids, meta: logits[meta.positions[meta.logits_indices]]
    if engine.runner.fused is not None:  # its greedy tokens (the LM head's argmax), every row
        engine.runner.fused.token = lambda input_ids, positions, attn: tokens[positions]


def advance_as_device_work(engine: Engine, timer: "ForwardTimer") -> None:
    """A stand-in graph's input advance (steady replay) runs here in torch operations; on a GPU
    it is a kernel inside the graph, no host time: its time counts with the forward's."""
    make = engine.runner._input_advance

    def timed(input_ids, meta):
        advance = make(input_ids, meta)

        def run(tokens):
            started = time.process_time()
            try:
                advance(tokens)
            finally:
                timer.seconds += time.process_time() - started
        return run

    engine.runner._input_advance = timed


def output_tokens(engine: Engine) -> int:
    """The running requests' output tokens so far."""
    return sum(len(r.output_token_ids) for r in engine.scheduler.running)


class ForwardTimer:
    """Wraps the runner's forward to add up its time: a step's time less its forward's is the
    host work around the model (the CPU torch attention of 256 rows is not the host cost a GPU
    step pays)."""

    def __init__(self, engine: Engine):
        self.seconds = 0.0
        self.forward = engine.runner.forward
        engine.runner.forward = self

    def __call__(self, *args, **kwargs):
        started = time.process_time()
        try:
            return self.forward(*args, **kwargs)
        finally:
            self.seconds += time.process_time() - started


def ms_per_step(engine: Engine, timer: ForwardTimer, steps: int) -> tuple[float, float]:
    """(ms per step, ms per step outside the forward), in this process's CPU time: on a shared
    machine the wall clock also counts the time other processes hold the core."""
    timer.seconds = 0.0
    started = time.process_time()
    for _ in range(steps):
        engine.step()
    elapsed = time.process_time() - started
    return elapsed / steps * 1e3, (elapsed - timer.seconds) / steps * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seqs", type=int, nargs="+", default=[1, 64, 256])
    ap.add_argument("--steps", type=int, default=50, help="steps a round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--profile", type=int, default=0, help="then profile this many steps")
    ap.add_argument("--spec", type=int, default=0, metavar="K",
                    help="speculate K tokens by n-gram lookup (with --stub-forward: of the stub's text)")
    ap.add_argument("--stub-forward", action="store_true",
                    help="a fixed table of logits instead of the model (host work alone)")
    ap.add_argument("--accept", type=float, default=1.0,
                    help="with --spec and --stub-forward: the share of proposals the stub accepts")
    ap.add_argument("--fused", action="store_true",
                    help="on the fused decode path (its GEMVs the fp32 references; with --stub-forward, stubbed)")
    ap.add_argument("--graphs", action="store_true",
                    help="decode steps through the runner's graph path, each graph a stand-in replaying the step")
    ap.add_argument("--steady", choices=("on", "off"),
                    help="with --graphs: steady replay on or off (model_runner.STEADY_REPLAY; "
                         "default: the runner's, on)")
    ap.add_argument("--phases", action="store_true",
                    help="also print each part's host us a step (StepPhases, in process time; nested parts overlap)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.fused:
        reference_fused_path()
    if args.steady is not None:
        from flashlet.runner import model_runner

        model_runner.STEADY_REPLAY = args.steady == "on"
    folder = save_tiny_model("qwen2", tempfile.mkdtemp(prefix="tiny-host-"), num_hidden_layers=1,
                             hidden_size=32, intermediate_size=32, num_attention_heads=2,
                             num_key_value_heads=1,
                             max_position_embeddings=100 + new_tokens(args.spec))
    for num_seqs in args.seqs:
        # A stubbed fused step plans the GPU's attention (triton's, host arithmetic only) and
        # never runs its kernels.
        engine = decoding_engine(str(folder), num_seqs, args.spec, args.fused,
                                 gpu_attention_plan=args.fused and args.stub_forward)
        if args.stub_forward:
            stub_forward(engine, args.accept if args.spec or args.fused else None)
        timer = ForwardTimer(engine)
        if args.graphs:
            from tests.test_step_layout import graphs_on_the_cpu

            graphs_on_the_cpu(engine)
            advance_as_device_work(engine, timer)
        phases = StepPhases(engine, time.process_time) if args.phases else None
        before = output_tokens(engine)
        times = [ms_per_step(engine, timer, args.steps) for _ in range(args.rounds)]
        host = [h for _, h in times]
        made = output_tokens(engine) - before
        print(f"seqs={num_seqs}: {statistics.median(t for t, _ in times):.3f} ms/step, "
              f"{statistics.median(host):.3f} ms outside the forward "
              f"(rounds: {' '.join(f'{h:.3f}' for h in host)}), "
              f"{made / (args.steps * args.rounds) / num_seqs:.2f} tokens a request a step", flush=True)
        if phases is not None:
            print(f"  host us a step: {phases.line()}", flush=True)
        if args.profile:
            profile = cProfile.Profile()
            profile.enable()
            for _ in range(args.profile):
                engine.step()
            profile.disable()
            pstats.Stats(profile).sort_stats("tottime").print_stats(30)


if __name__ == "__main__":
    main()
