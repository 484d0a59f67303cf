"""The cost of one stage boundary in the persistent form (flashlet/kernels/persistent_plan.py's
`Machine.counter_us + load_us`), measured: P programs, one an SM, pass R grid-wide counters in a
row. In each round every program writes its slice of a payload vector (a stage's output), adds one
to the round's counter with release semantics, spins on an acquire load until the counter reaches
P, then reads the whole vector (the next stage's input, from L2) and folds it into its own slice.
One launch of R rounds, timed with CUDA events, less a launch of one round, over R - 1: the time
from the last program's signal to every program holding the next stage's input, plus one round's
own work (a slice's store, a vector's load).

    PYTHONPATH=. python3 lab/counter_probe.py                       # P = the SM count, payloads 0 / 896 / 4864
    PYTHONPATH=. python3 lab/counter_probe.py --programs 2 --payload 896
    PYTHONPATH=. python3 lab/counter_probe.py --lower                # no GPU: the sm_90a PTX's counter ops

Prints one JSON line a payload: us a round (best of --repeats launches); then, for --presets, the
timing model's step at 1,000 tokens (FUSED_NOTES.md, "Stage 3 before its kernel") with the
measured round at the first nonzero payload as each boundary's cost (counter_us, load_us 0) and
this GPU's SM count, against the H200's bandwidth. On the CPU (TRITON_INTERPRET=1) it runs with one program only, the
interpreter running programs one after another (a spin on a program not yet run never ends).
"""

import argparse
import json
import os

import dataclasses

import torch
import triton
import triton.language as tl


@triton.jit
def _rounds(Counters, Payload, Out, rounds, programs, PAYLOAD: tl.constexpr, SLICE: tl.constexpr,
            BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    own = pid * SLICE + tl.arange(0, SLICE)
    acc = tl.zeros([SLICE], tl.float32) + pid + 1
    offs = tl.arange(0, BLOCK)
    for r in range(rounds):
        buf = Payload + (r % 2) * PAYLOAD  # two buffers: a round's stores never meet the last one's loads
        if PAYLOAD > 0:
            tl.store(buf + own, acc, mask=own < PAYLOAD)
        tl.debug_barrier()  # every thread's stores before the release
        tl.atomic_add(Counters + r, 1, sem="release", scope="gpu")
        seen = tl.atomic_add(Counters + r, 0, sem="acquire", scope="gpu")
        while seen < programs:
            seen = tl.atomic_add(Counters + r, 0, sem="acquire", scope="gpu")
        if PAYLOAD > 0:
            x = tl.load(buf + offs, mask=offs < PAYLOAD, other=0.0, cache_modifier=".cg")
            acc = acc + tl.sum(x) * 1e-6
    tl.store(Out + pid * SLICE + tl.arange(0, SLICE), acc)


def lowered_ptx(payload: int, programs: int = 132) -> str:
    """`_rounds` compiled for sm_90a with no GPU (TRITON_INTERPRET unset), as `run` launches it."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    slice_ = max(1, triton.next_power_of_2(-(-max(payload, 1) // programs)))
    sig = {"Counters": "*i32", "Payload": "*fp32", "Out": "*fp32", "rounds": "i32", "programs": "i32",
           "PAYLOAD": "constexpr", "SLICE": "constexpr", "BLOCK": "constexpr"}
    consts = dict(PAYLOAD=payload, SLICE=slice_, BLOCK=triton.next_power_of_2(max(payload, 1)))
    kernel = triton.compile(ASTSource(fn=_rounds, signature=sig, constexprs=consts),
                            target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))
    return kernel.asm["ptx"]


def run(programs: int, rounds: int, payload: int, device: str) -> torch.Tensor:
    """One launch of `rounds` rounds; returns each program's folded slice [programs, SLICE]."""
    slice_ = max(1, triton.next_power_of_2(-(-max(payload, 1) // programs)))
    counters = torch.zeros(rounds, dtype=torch.int32, device=device)
    buf = torch.zeros(2 * max(payload, 1), dtype=torch.float32, device=device)
    out = torch.empty(programs, slice_, dtype=torch.float32, device=device)
    block = triton.next_power_of_2(max(payload, 1))
    _rounds[(programs,)](counters, buf, out, rounds, programs, PAYLOAD=payload, SLICE=slice_, BLOCK=block,
                         num_warps=4)
    return out


def round_us(programs: int, rounds: int, payload: int, repeats: int) -> float:
    """us a round: (one launch of `rounds` less one of a single round) / (rounds - 1), best of
    `repeats`."""
    def timed(n: int) -> float:
        best = float("inf")
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run(programs, n, payload, "cuda")
            end.record()
            torch.cuda.synchronize()
            best = min(best, start.elapsed_time(end) * 1e3)
        return best
    run(programs, 2, payload, "cuda")  # compile
    torch.cuda.synchronize()
    return (timed(rounds) - timed(1)) / (rounds - 1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--programs", type=int, default=0, help="programs (0: the SM count)")
    p.add_argument("--rounds", type=int, default=2000)
    p.add_argument("--payload", type=int, nargs="+", default=[0, 896, 4864], help="fp32 elements a stage's vector")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--presets", nargs="*", default=["qwen2.5-0.5b", "qwen3-0.6b", "qwen2.5-1.5b"])
    p.add_argument("--lower", action="store_true", help="no GPU: count the sm_90a PTX's counter ops a payload")
    args = p.parse_args()
    if args.lower:
        for payload in args.payload:
            ptx = lowered_ptx(payload)
            print(json.dumps({"payload": payload, **{op: ptx.count(op) for op in (
                "atom.global.gpu.release.add", "ld.global.gpu.acquire", "ld.global.cg", "bar.sync")}}))
        return
    if os.environ.get("TRITON_INTERPRET") == "1" or not torch.cuda.is_available():
        raise SystemExit("counter_probe times a GPU (its spins need every program resident at once)")
    programs = args.programs or torch.cuda.get_device_properties(0).multi_processor_count
    measured = {}
    for payload in args.payload:
        measured[payload] = round_us(programs, args.rounds, payload, args.repeats)
        print(json.dumps({"device": torch.cuda.get_device_name(0), "programs": programs, "payload": payload,
                          "rounds": args.rounds, "us_a_round": round(measured[payload], 3)}), flush=True)
    boundary = next((us for payload, us in measured.items() if payload > 0), None)
    if boundary is not None:
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        for preset in args.presets:
            print(json.dumps(predict(preset, boundary, sms)), flush=True)


def predict(preset: str, boundary_us: float, num_sms: int, kv_len: int = 1000) -> dict:
    """persistent_plan's step for `preset` at kv_len tokens with each boundary costing boundary_us."""
    from flashlet.kernels import persistent_plan as pp
    from flashlet.models.model import ModelConfig
    from flashlet.models.weights import preset_config_path

    cfg = ModelConfig.from_file(preset_config_path(preset))
    machine = dataclasses.replace(pp.H200, num_sms=num_sms, counter_us=boundary_us, load_us=0.0)
    queues = pp.plan_step(pp.default_shape(cfg, kv_len, num_sms), num_sms)
    got = pp.predict_step(queues, machine, kv_bytes_per_key=2 * cfg.head_dim * 2)
    return {"preset": preset, "boundary_us": round(boundary_us, 3), "step_us": round(got["step_us"], 1),
            "tok_s": round(1e6 / got["step_us"]), "share_of_h200_limit": round(got["share"], 3)}


if __name__ == "__main__":
    main()
