"""The cost of one stage boundary in the persistent form (flashlet/kernels/persistent_plan.py's
`Machine.counter_us + load_us`), measured: P programs, one an SM, pass R grid-wide counters in a
row. In each round every program writes its slice of a payload vector (a stage's output), adds one
to the round's counter with release semantics, spins on an acquire load until the counter reaches
P, then reads the whole vector (the next stage's input, from L2) and folds it into its own slice.
One launch of R rounds, timed with CUDA events, less a launch of one round, over R - 1: the time
from the last program's signal to every program holding the next stage's input, plus one round's
own work (a slice's store, a vector's load).

Beside it, today's boundary under the same conditions: --launches launches of a kernel of P
programs, each reading the whole vector the launch before it wrote (after `griddepcontrol.wait`,
launched with PDL, as the fused path's kernels are) and writing its own slice, captured in one
CUDA graph and replayed: us a launch. The persistent form pays where the first is well under the
second.

    PYTHONPATH=. python3 lab/counter_probe.py                       # P = the SM count, payloads 0 / 896 / 4864
    PYTHONPATH=. python3 lab/counter_probe.py --programs 2 --payload 896
    PYTHONPATH=. python3 lab/counter_probe.py --lower                # no GPU: the sm_90a PTX's counter ops
    PYTHONPATH=. python3 lab/counter_probe.py --model-only 1.5 2 3   # no GPU: the plan's step at these costs

Prints one JSON line a payload: us a round and us a PDL launch (best of --repeats); then, for
--presets, the timing model's step at 1,000 tokens (FUSED_NOTES.md, "Stage 3 before its kernel")
with the measured round at the first nonzero payload as each boundary's cost (counter_us, load_us
0) and this GPU's SM count, against the H200's bandwidth. On the CPU (TRITON_INTERPRET=1) the
rounds run with one program only, the interpreter running programs one after another (a spin on
a program not yet run never ends).
"""

import argparse
import dataclasses
import json
import os

import torch
import triton
import triton.language as tl

from flashlet.kernels import pdl


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


@triton.jit
def _stage(Src, Dst, PAYLOAD: tl.constexpr, SLICE: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    """One stage as a kernel of its own: the launch before it wrote Src (PDL's wait), this one
    reads all of it and writes its slice of Dst."""
    pid = tl.program_id(0)
    if USE_PDL:
        pdl.launch_dependents()
        pdl.wait()
    offs = tl.arange(0, BLOCK)
    x = tl.load(Src + offs, mask=offs < PAYLOAD, other=0.0, cache_modifier=".cg")
    own = pid * SLICE + tl.arange(0, SLICE)
    tl.store(Dst + own, tl.zeros([SLICE], tl.float32) + tl.sum(x) * 1e-6 + pid + 1, mask=own < PAYLOAD)


def _slice(payload: int, programs: int) -> int:
    """Each program's share of the vector, a power of two (its stores are masked past the end)."""
    return max(1, triton.next_power_of_2(-(-max(payload, 1) // programs)))


def launches(programs: int, count: int, payload: int, device: str, pdl_on: bool) -> torch.Tensor:
    """`count` launches of `_stage`, each reading what the one before it wrote; returns the last
    vector written."""
    slice_ = _slice(payload, programs)
    bufs = [torch.zeros(max(payload, 1), dtype=torch.float32, device=device) for _ in range(2)]
    for i in range(count):
        _stage[(programs,)](bufs[i % 2], bufs[(i + 1) % 2], PAYLOAD=payload, SLICE=slice_,
                            BLOCK=triton.next_power_of_2(max(payload, 1)), USE_PDL=pdl_on, num_warps=4,
                            **({"launch_pdl": True} if pdl_on else {}))
    return bufs[count % 2]


def launch_us(programs: int, count: int, payload: int, repeats: int) -> float:
    """us a launch of `count` PDL launches captured in one CUDA graph, best replay of `repeats`."""
    launches(programs, 2, payload, "cuda", True)  # compile
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launches(programs, count, payload, "cuda", True)
    best = float("inf")
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) * 1e3 / count)
    return best


def lowered_ptx(payload: int, programs: int = 132) -> str:
    """`_rounds` and `_stage` compiled for sm_90a with no GPU (TRITON_INTERPRET unset), as `run`
    and `launches` launch them: their PTX, one after the other."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    slice_ = _slice(payload, programs)
    sig = {"Counters": "*i32", "Payload": "*fp32", "Out": "*fp32", "rounds": "i32", "programs": "i32",
           "PAYLOAD": "constexpr", "SLICE": "constexpr", "BLOCK": "constexpr"}
    consts = dict(PAYLOAD=payload, SLICE=slice_, BLOCK=triton.next_power_of_2(max(payload, 1)))
    kernel = triton.compile(ASTSource(fn=_rounds, signature=sig, constexprs=consts),
                            target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))
    sig = {"Src": "*fp32", "Dst": "*fp32", "PAYLOAD": "constexpr", "SLICE": "constexpr", "BLOCK": "constexpr",
           "USE_PDL": "constexpr"}
    stage = triton.compile(ASTSource(fn=_stage, signature=sig, constexprs=dict(consts, USE_PDL=True)),
                           target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4, launch_pdl=True))
    return kernel.asm["ptx"] + stage.asm["ptx"]


def run(programs: int, rounds: int, payload: int, device: str) -> torch.Tensor:
    """One launch of `rounds` rounds; returns each program's folded slice [programs, SLICE]."""
    slice_ = _slice(payload, programs)
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
    p.add_argument("--launches", type=int, default=500, help="PDL launches in the graph (today's boundary)")
    p.add_argument("--presets", nargs="*", default=["qwen2.5-0.5b", "qwen3-0.6b", "qwen2.5-1.5b"])
    p.add_argument("--lower", action="store_true", help="no GPU: count the sm_90a PTX's counter ops a payload")
    p.add_argument("--model-only", type=float, nargs="+", metavar="B",
                   help="no GPU: the plan's step for --presets at these boundary costs (us), 132 SMs")
    p.add_argument("--kv-len", type=int, default=1000, help="the row's context for the predictions")
    args = p.parse_args()
    if args.model_only:
        for preset in args.presets:
            for b in args.model_only:
                print(json.dumps(predict(preset, b, 132, args.kv_len)), flush=True)
        return
    if args.lower:
        for payload in args.payload:
            ptx = lowered_ptx(payload)
            print(json.dumps({"payload": payload, **{op: ptx.count(op) for op in (
                "atom.global.gpu.release.add", "ld.global.gpu.acquire", "ld.global.cg", "bar.sync",
                "griddepcontrol.wait", "griddepcontrol.launch_dependents")}}))
        return
    if os.environ.get("TRITON_INTERPRET") == "1" or not torch.cuda.is_available():
        raise SystemExit("counter_probe times a GPU (its spins need every program resident at once)")
    programs = args.programs or torch.cuda.get_device_properties(0).multi_processor_count
    measured = {}
    for payload in args.payload:
        measured[payload] = round_us(programs, args.rounds, payload, args.repeats)
        pdl_us = launch_us(programs, args.launches, payload, args.repeats)
        print(json.dumps({"device": torch.cuda.get_device_name(0), "programs": programs, "payload": payload,
                          "rounds": args.rounds, "us_a_round": round(measured[payload], 3),
                          "launches": args.launches, "us_a_pdl_launch": round(pdl_us, 3)}), flush=True)
    boundary = next((us for payload, us in measured.items() if payload > 0), None)
    if boundary is not None:
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        for preset in args.presets:
            print(json.dumps(predict(preset, boundary, sms, args.kv_len)), flush=True)


def predict(preset: str, boundary_us: float, num_sms: int, kv_len: int = 1000) -> dict:
    """persistent_plan's step for `preset` at kv_len tokens with each boundary costing boundary_us."""
    from flashlet.kernels import persistent_plan as pp
    from flashlet.models.model import ModelConfig
    from flashlet.models.weights import preset_config_path

    cfg = ModelConfig.from_file(preset_config_path(preset))
    machine = dataclasses.replace(pp.H200, num_sms=num_sms, counter_us=boundary_us, load_us=0.0)
    queues = pp.plan_step(pp.default_shape(cfg, kv_len, num_sms), num_sms)
    got = pp.predict_step(queues, machine, kv_bytes_per_key=2 * cfg.head_dim * 2)
    return {"preset": preset, "kv_len": kv_len, "boundary_us": round(boundary_us, 3), "step_us": round(got["step_us"], 1),
            "tok_s": round(1e6 / got["step_us"]), "share_of_h200_limit": round(got["share"], 3)}


if __name__ == "__main__":
    main()
