"""Stage 3's plan, before its kernel (FUSED_NOTES.md, "The plan", stage 3): one decode step of
one row as per-SM queues of tile instructions that meet at counters in global memory, a CPU
executor that runs those queues in any interleaving the counters allow, and a timing model that
predicts the step.

The persistent form runs one CTA per SM for the whole step. Each CTA walks its own queue of
instructions (a tile of one stage of one layer: rows [lo, hi) of a GEMV, or one KV head's split of
the attention); an instruction may stream its weights into shared memory before it waits, then
spins until a counter reaches a count (every tile of the stage it reads has finished), does its
dependent loads and work, stores, and adds one to its own stage's counter. Kernel boundaries
become those waits. Three things must hold before a kernel is worth writing, and this module
checks each on the CPU:

- No deadlock. `plan_step` lays every queue out as a subsequence of one global order in which
  every wait names only earlier instructions, so the earliest unfinished instruction is always at
  the head of its queue with its counter complete (`run_queues` finds a stuck state otherwise:
  `test_persistent_plan.py` builds one).
- The right numbers. `execute` runs the queues on real tensors, each instruction in two events
  (its loads after its wait, its stores and signal later), in an interleaving a seed picks, so
  a wait that is too weak reads a stale or later buffer in some interleaving; its token and
  hidden state are compared with `CausalLM`'s forward.
- A step worth having. `predict_step` replays the queues in time: each SM's loader streams its
  instructions' weights in queue order at its share of the bandwidth, at most `smem_bytes` ahead
  of its compute, and each instruction's compute starts after its weights, its counter (plus the
  counter's latency) and the SM's previous instruction. What comes out is the step against the
  bytes' floor, and how much of it is waits.

Every stage waits for the whole stage before it (the counts below), which is what makes the
buffers safe to reuse across layers: the stages of a step form one chain, so no tile writes a
buffer that a tile of an earlier stage may still read.
"""

from __future__ import annotations

import dataclasses
import math
import random

import torch

from flashlet.models.model import CausalLM, ModelConfig
from flashlet.models.ops import TorchOps

STAGES = ("qkv", "attn", "o", "gate_up", "down")  # one layer's, in order; then "lm_head", "argmax"
TILE_BYTES = 96 * 1024  # a GEMV tile's weights at most: two in a CTA's buffer (Machine.smem_bytes)


@dataclasses.dataclass(frozen=True)
class Instr:
    """One tile of one stage: rows [lo, hi) of the stage's output (attn: KV head `head`, keys
    [lo, hi) of the context). It spins until counter `wait` reaches `count` (None: nothing to
    wait for), then adds one to counter `signal` when its stores are done. `weight_bytes` may
    stream before the wait (no instruction of the step writes weights)."""

    stage: str
    layer: int
    lo: int
    hi: int
    wait: str | None
    count: int
    signal: str
    weight_bytes: int
    head: int = -1
    order: int = 0  # its place in the global order the queues are laid out from


@dataclasses.dataclass(frozen=True)
class StepShape:
    """What a step's instructions are cut from: the model's widths, the row's KV length and the
    tiling (rows a GEMV tile, keys an attention split)."""

    cfg: ModelConfig
    kv_len: int
    tile_rows: dict  # stage -> output rows a tile
    split_tokens: int
    bytes_per_weight: int = 2

    def widths(self) -> dict:
        c = self.cfg
        qkv = (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
        # stage -> (output rows, K): gate_up's tile holds rows i and i + I, so its output rows
        # count the activation's I rows and each reads 2 x K weights
        return {"qkv": (qkv, c.hidden_size), "o": (c.hidden_size, c.num_heads * c.head_dim),
                "gate_up": (c.intermediate_size, 2 * c.hidden_size),
                "down": (c.hidden_size, c.intermediate_size),
                "lm_head": (c.vocab_size, c.hidden_size)}


def default_shape(cfg: ModelConfig, kv_len: int, num_sms: int, min_split_tokens: int = 64,
                  max_tile_bytes: int | None = TILE_BYTES) -> StepShape:
    """Every GEMV stage cut into whole waves of num_sms tiles of equal rows (one wave, or as many
    as keep a tile's weights within max_tile_bytes: a loader then holds the next tiles while its
    SM waits), the attention's keys into splits of at least min_split_tokens, at most num_sms
    tiles over the KV heads."""
    shape = StepShape(cfg, kv_len, {}, 1)
    rows = {}
    for stage, (n, k) in shape.widths().items():
        waves = 1
        if max_tile_bytes is not None:
            waves = max(1, -(-n * k * shape.bytes_per_weight // (num_sms * max_tile_bytes)))
        rows[stage] = -(-n // (num_sms * waves))
    splits = max(1, num_sms // cfg.num_kv_heads)
    split_tokens = max(min_split_tokens, -(-kv_len // splits))
    return dataclasses.replace(shape, tile_rows=rows, split_tokens=split_tokens)


def _tiles(n: int, rows: int) -> list[tuple[int, int]]:
    return [(lo, min(lo + rows, n)) for lo in range(0, n, rows)]


def stage_instructions(shape: StepShape) -> list[Instr]:
    """The step's instructions in its one global order: layer by layer, stage by stage, then the
    LM head's tiles and the argmax over their partial bests. Each waits for every tile of the
    stage before it."""
    c, widths = shape.cfg, shape.widths()
    out: list[Instr] = []
    wait, count = None, 0

    def add_stage(stage: str, layer: int, pieces: list[tuple[int, int, int, int]]):
        nonlocal wait, count
        name = f"{stage}{layer}" if layer >= 0 else stage
        for lo, hi, head, nbytes in pieces:
            out.append(Instr(stage, layer, lo, hi, wait, count, name, nbytes, head, len(out)))
        wait, count = name, len(pieces)

    b = shape.bytes_per_weight
    for layer in range(c.num_layers):
        for stage in STAGES:
            if stage == "attn":
                splits = _tiles(shape.kv_len, shape.split_tokens)
                pieces = [(lo, hi, h, 0) for h in range(c.num_kv_heads) for lo, hi in splits]
            else:
                n, k = widths[stage]
                pieces = [(lo, hi, -1, (hi - lo) * k * b) for lo, hi in _tiles(n, shape.tile_rows[stage])]
            add_stage(stage, layer, pieces)
    n, k = widths["lm_head"]
    add_stage("lm_head", -1, [(lo, hi, -1, (hi - lo) * k * b) for lo, hi in _tiles(n, shape.tile_rows["lm_head"])])
    add_stage("argmax", -1, [(0, 1, -1, 0)])
    return out


def plan_step(shape: StepShape, num_sms: int) -> list[list[Instr]]:
    """The per-SM queues: each stage's tiles dealt round-robin from the SM after the one that
    took the previous stage's last tile (so small stages do not pile onto SM 0), each queue a
    subsequence of the global order."""
    queues: list[list[Instr]] = [[] for _ in range(num_sms)]
    for i, ins in enumerate(stage_instructions(shape)):
        queues[i % num_sms].append(ins)
    return queues


class Deadlock(RuntimeError):
    """No queue's head can run: every head waits on a counter that cannot complete."""


def run_queues(queues: list[list[Instr]], seed: int = 0):
    """Yield ("load" | "store", instruction) events of one legal run of the queues: a queue's
    head loads once its counter is complete and stores (adding to its own counter) some events
    later, and its queue moves on only after the store. Which ready event comes next is drawn
    from `seed`. Raises Deadlock where no event can come and instructions remain."""
    rng = random.Random(seed)
    counters: dict[str, int] = {}
    pos = [0] * len(queues)
    loaded = [False] * len(queues)
    while True:
        ready = []
        for s, q in enumerate(queues):
            if pos[s] == len(q):
                continue
            ins = q[pos[s]]
            if loaded[s] or ins.wait is None or counters.get(ins.wait, 0) >= ins.count:
                ready.append(s)
        if not ready:
            if any(pos[s] < len(q) for s, q in enumerate(queues)):
                stuck = [q[pos[s]] for s, q in enumerate(queues) if pos[s] < len(q)]
                raise Deadlock(f"{len(stuck)} queues stuck, e.g. {stuck[0].signal} waiting on "
                               f"{stuck[0].wait} = {stuck[0].count} (at {counters.get(stuck[0].wait, 0)})")
            return
        s = rng.choice(ready)
        ins = queues[s][pos[s]]
        if not loaded[s]:
            loaded[s] = True
            yield "load", ins
        else:
            loaded[s] = False
            pos[s] += 1
            counters[ins.signal] = counters.get(ins.signal, 0) + 1
            yield "store", ins


def execute(model: CausalLM, token: int, kv: list[tuple[torch.Tensor, torch.Tensor]],
            queues: list[list[Instr]], seed: int = 0) -> tuple[int, torch.Tensor]:
    """One decode step of one row through the queues, on the CPU in fp32: `token` at position
    len(kv's keys), `kv` [layer] -> (keys, values) [Hkv, T, D] of the context before it (this
    step's K/V row is appended to each, as the pool's write is). Returns the argmax token and the
    final normed hidden state. Buffers are shared across layers as the kernel's would be; a
    load reads them as they are at its event, a store writes what its load computed."""
    c = model.config
    d, hq, hkv = c.head_dim, c.num_heads, c.num_kv_heads
    group, pos = hq // hkv, kv[0][0].shape[1]
    eps, position = c.rms_norm_eps, torch.tensor([pos])
    longest = max(i.hi for q in queues for i in q if i.stage == "attn")
    if longest != pos + 1:
        raise ValueError(f"the queues attend over {longest} keys; the context and this token are {pos + 1}")
    keys = [torch.cat([k, torch.zeros(hkv, 1, d)], 1) for k, _ in kv]
    values = [torch.cat([v, torch.zeros(hkv, 1, d)], 1) for _, v in kv]

    def rms(x, w):  # in fp32: a bf16 weight times the fp32 norm promotes
        return TorchOps.rms_norm(x, w, eps)

    buf = {"residual": model.embed_tokens.weight[token].float().clone(),
           "qkv": torch.zeros((hq + 2 * hkv) * d),
           "partial": {}, "act": torch.zeros(c.intermediate_size),
           "logits": torch.zeros(c.vocab_size), "token": -1}
    pending: dict[Instr, object] = {}

    def load(ins: Instr):
        if ins.stage in ("qkv", "gate_up", "lm_head"):  # normed input, each tile its own norm
            layer = model.layers[ins.layer] if ins.layer >= 0 else None
            if ins.stage == "lm_head":
                x = rms(buf["residual"], model.norm)
            else:
                x = rms(buf["residual"], layer.input_norm if ins.stage == "qkv" else layer.post_attn_norm)
            if ins.stage == "qkv":
                w, bias = layer.qkv_proj.weight.float(), layer.qkv_proj.bias
                y = w[ins.lo:ins.hi] @ x + (bias.float()[ins.lo:ins.hi] if bias is not None else 0)
                return y
            if ins.stage == "gate_up":
                w = layer.gate_up_proj.weight.float()
                i = c.intermediate_size
                gate, up = w[ins.lo:ins.hi] @ x, w[i + ins.lo:i + ins.hi] @ x
                return TorchOps.silu_and_mul(torch.cat([gate, up]))
            return model.lm_head_weight.float()[ins.lo:ins.hi] @ x
        if ins.stage == "attn":  # q of the head's group and this row's K/V, made here from qkv
            qkv = buf["qkv"]
            q = qkv[: hq * d].view(hq, d)[ins.head * group:(ins.head + 1) * group]
            k_new = qkv[hq * d:(hq + hkv) * d].view(hkv, d)[ins.head:ins.head + 1]
            v_new = qkv[(hq + hkv) * d:].view(hkv, d)[ins.head]
            layer = model.layers[ins.layer]
            norm = layer.qk_norm()
            if norm is not None:
                q, k_new = norm.apply(q, k_new)
            q, k_new = TorchOps.rope(q[None], k_new[None], position, model.cos_sin_cache)
            q, k_new = q[0], k_new[0, 0]
            k = keys[ins.layer][ins.head, ins.lo:ins.hi].clone()
            v = values[ins.layer][ins.head, ins.lo:ins.hi].clone()
            if ins.lo <= pos < ins.hi:  # the split holding the newest key makes it
                k[pos - ins.lo], v[pos - ins.lo] = k_new, v_new
            s = (q @ k.T) / math.sqrt(d)  # [group, keys]
            m = s.max(-1).values
            p = torch.exp(s - m[:, None])
            return (p @ v) / p.sum(-1)[:, None], m + torch.log(p.sum(-1)), (k_new, v_new, ins.lo <= pos < ins.hi)
        if ins.stage == "o":  # merge every split's partial for the needed heads, then O's rows
            layer = model.layers[ins.layer]
            outs = []
            for h in range(hkv):
                parts = [v for (hd, _), v in sorted(buf["partial"].items()) if hd == h]
                o = torch.stack([p[0] for p in parts])  # [splits, group, D]
                lse = torch.stack([p[1] for p in parts])  # [splits, group]
                w = torch.softmax(lse, 0)
                outs.append((w[..., None] * o).sum(0))
            attn = torch.cat(outs).reshape(-1)
            y = layer.o_proj.weight.float()[ins.lo:ins.hi] @ attn
            return y + buf["residual"][ins.lo:ins.hi]
        if ins.stage == "down":
            w = model.layers[ins.layer].down_proj.weight.float()
            return w[ins.lo:ins.hi] @ buf["act"] + buf["residual"][ins.lo:ins.hi]
        if ins.stage == "argmax":
            return int(torch.argmax(buf["logits"]))
        raise ValueError(f"unknown stage {ins.stage!r}")

    def store(ins: Instr, value):
        if ins.stage == "qkv":
            buf["qkv"][ins.lo:ins.hi] = value
        elif ins.stage == "attn":
            o, lse, (k_new, v_new, owns) = value
            buf["partial"][(ins.head, ins.lo)] = (o, lse)  # one slot a split, every layer's
            if owns:
                keys[ins.layer][ins.head, pos], values[ins.layer][ins.head, pos] = k_new, v_new
        elif ins.stage in ("o", "down"):
            buf["residual"][ins.lo:ins.hi] = value
        elif ins.stage == "gate_up":
            buf["act"][ins.lo:ins.hi] = value
        elif ins.stage == "lm_head":
            buf["logits"][ins.lo:ins.hi] = value
        else:
            buf["token"] = value

    with torch.no_grad():
        for event, ins in run_queues(queues, seed):
            if event == "load":
                pending[ins] = load(ins)
            else:
                store(ins, pending.pop(ins))
        hidden = rms(buf["residual"], model.norm)
    return buf["token"], hidden


@dataclasses.dataclass(frozen=True)
class Machine:
    """What the timing model knows of a GPU. The latencies are the notes' estimates, not
    measurements of this form (it is not built): counter_us from a signal's release to a spinning
    SM's acquire seeing it, load_us for the dependent loads after a wait (activations, partials:
    L2), tile_us for the tile's own reduction and stores."""

    name: str
    bandwidth: float  # bytes / s, the measured copy bandwidth
    num_sms: int
    smem_bytes: int = 200 * 1024  # a CTA's weight buffer (227 KB less the tiles' own)
    counter_us: float = 0.7
    load_us: float = 0.6
    tile_us: float = 0.3


H200 = Machine("H200", 4.24e12, 132)
H100 = Machine("H100", 3.35e12, 132)


def _bytes(ins: Instr, kv_bytes_per_key: int) -> int:
    """What an instruction streams: its weights, or an attention split's keys and values."""
    return ins.weight_bytes + (ins.hi - ins.lo) * kv_bytes_per_key * (ins.stage == "attn")


def predict_step(queues: list[list[Instr]], machine: Machine, kv_bytes_per_key: int) -> dict:
    """Replay the queues in time (microseconds). Each SM's loader streams its instructions' bytes
    (`_bytes`: nothing an instruction streams is written by the step, but for the newest K/V row,
    made in registers) in queue order at bandwidth / num_sms, holding at most smem_bytes that its
    compute has not consumed; an instruction computes from max(its bytes in, its counter complete
    + counter_us, the SM's previous instruction done) for tile_us, plus load_us for the stage's
    inputs where the SM's previous instruction was of another stage, and a counter
    completes at its last tile's end. The bandwidth split evenly assumes every SM streams at once
    (what the form is for); an SM whose window is full does not pass its share to the others.
    Returns the step, the bytes' floor and the mean time an SM's compute spent on counters with
    its bytes already in."""
    rate = machine.bandwidth / machine.num_sms / 1e6  # bytes an SM streams a microsecond
    ends: dict[str, list[float]] = {}
    pos = [0] * len(queues)
    loader = [0.0] * len(queues)  # when each SM's loader is free again
    finished: list[list[float]] = [[] for _ in queues]  # each SM's instructions' compute ends
    waited, total_bytes = 0.0, 0
    remaining = sum(len(q) for q in queues)
    while remaining:
        moved = False
        for s, q in enumerate(queues):
            while pos[s] < len(q):
                ins = q[pos[s]]
                if ins.wait is not None and len(ends.get(ins.wait, ())) < ins.count:
                    break
                nbytes = _bytes(ins, kv_bytes_per_key)
                total_bytes += nbytes
                # the bytes still held for earlier instructions plus these must fit: the newest
                # earlier instruction that does not fit must have computed (freed its buffer)
                start, held, j = loader[s], nbytes, pos[s] - 1
                while j >= 0 and held + _bytes(q[j], kv_bytes_per_key) <= machine.smem_bytes:
                    held += _bytes(q[j], kv_bytes_per_key)
                    j -= 1
                if j >= 0:
                    start = max(start, finished[s][j])
                loader[s] = start + nbytes / rate
                ready = max(ends[ins.wait]) + machine.counter_us if ins.wait else 0.0
                previous = finished[s][-1] if finished[s] else 0.0
                begin = max(loader[s], ready, previous)
                waited += max(0.0, ready - max(loader[s], previous))
                # the dependent loads (the stage's inputs) once a stage: the SM's next tile of
                # the same stage has them already
                fresh = pos[s] == 0 or q[pos[s] - 1].signal != ins.signal
                finished[s].append(begin + machine.load_us * fresh + machine.tile_us)
                ends.setdefault(ins.signal, []).append(finished[s][-1])
                pos[s] += 1
                remaining -= 1
                moved = True
        if not moved:
            raise Deadlock("the timing replay found no queue able to move")
    step = max(f[-1] for f in finished if f)
    floor = total_bytes / machine.bandwidth * 1e6
    return {"step_us": step, "floor_us": floor, "share": floor / step,
            "wait_us_per_sm": waited / len(queues)}
