"""Tensor parallelism: one model split over the GPUs of a host (or of several, under torchrun).

Every rank holds a slice of every layer, Megatron-style: QKV and gate/up are split by output
(column-parallel: each rank owns whole attention heads and a slice of the MLP's intermediate
size), O and down by input (row-parallel: each rank's partial sum is all-reduced). The
embedding and the LM head are split by vocabulary: a rank looks up only the token ids in its
range (zeros elsewhere, then an all-reduce), and computes the logits of its range, all-gathered
so that rank 0 holds the whole row. K/V heads are split like query heads; a model with fewer
K/V heads than ranks replicates each over `world_size // num_kv_heads` ranks. Each rank keeps
a KV pool of its own heads, with the same page ids everywhere.

Why all-gather the logits rather than a distributed argmax: sampling (temperature, top-k/p,
seeded generators) needs the whole row on one rank, one code path serves greedy and sampled
rows, and the gather is a single collective that lives inside the captured decode graph.

Rank 0 runs the engine: scheduler, radix cache, sampling. Before each forward it broadcasts the
scheduler's update of the step batch (scheduler.BatchUpdate, pickled, over a gloo group, so the
workers build the layout on the host while the GPU still runs the step before) and then the
step's input ids on the device (they carry the tokens the step before sampled, never read on
the host: overlap keeps working). Workers (`flashlet/distributed/tp_worker.py`) apply the update to their
own persistent batch, as rank 0's runner does, and run the same forward on the same layout. With one rank none
of this exists: `tp` is None and the model runs no collective.

Ranks meet through torch.distributed's `env://` rendezvous (MASTER_ADDR, MASTER_PORT, RANK,
WORLD_SIZE, LOCAL_RANK): rank 0 spawns the others with torch.multiprocessing, or torchrun
starts them all.
"""

from __future__ import annotations

import atexit
import datetime
import gc
import logging
import os
import pickle
import socket
import sys
import threading
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

log = logging.getLogger("flashlet")

# Bounds start-up (rendezvous, model loading on every rank) and every collective of the
# model; FLASHLET_TP_TIMEOUT_S overrides it (seconds).
DEFAULT_TIMEOUT_S = 600.0
# The step channel waits between requests for as long as the server is idle.
IDLE_TIMEOUT = datetime.timedelta(days=365)
WATCHDOG_PERIOD_S = 0.2
# After a worker died, how long rank 0 may stay blocked in a collective before the watchdog
# ends the process (a collective on a dead peer can block in C++ where no exception reaches it).
DEAD_WORKER_GRACE_S = 30.0

_STOP, _STEP = 0, 1  # the step channel's header: [kind, bytes of the pickled update]


class WorkerDiedError(RuntimeError):
    """A tensor-parallel rank died or stopped answering: the engine cannot go on."""


# ---- how the model splits ------------------------------------------------------------------
@dataclass(frozen=True)
class LocalShape:
    """This rank's slice of a model: head counts, MLP width and vocabulary rows it owns."""

    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_rows: int  # rows of the embedding / LM head shard (padded so every rank has as many)
    q_head_start: int = 0
    kv_head_start: int = 0
    intermediate_start: int = 0
    vocab_start: int = 0


def local_shape(cfg, rank: int = 0, world_size: int = 1) -> LocalShape:
    """The slice of `cfg` (a ModelConfig) that `rank` of `world_size` holds; the whole model
    for one rank. Raises ValueError for a model that does not split that way."""
    if world_size == 1:
        return LocalShape(cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size, cfg.vocab_size)
    hq, hkv = cfg.num_heads, cfg.num_kv_heads
    if hq % world_size:
        raise ValueError(f"tensor_parallel_size {world_size} does not divide the model's "
                         f"{hq} attention heads")
    if hkv % world_size and world_size % hkv:
        raise ValueError(f"tensor_parallel_size {world_size} and the model's {hkv} K/V heads: "
                         f"one must divide the other")
    if cfg.intermediate_size % world_size:
        raise ValueError(f"tensor_parallel_size {world_size} does not divide the model's "
                         f"intermediate size {cfg.intermediate_size}")
    local_kv = max(hkv // world_size, 1)
    # With fewer K/V heads than ranks, ranks r*hkv//world share K/V head r*hkv//world.
    kv_start = rank * local_kv if hkv >= world_size else rank * hkv // world_size
    vocab_rows = -(-cfg.vocab_size // world_size)
    inter = cfg.intermediate_size // world_size
    return LocalShape(hq // world_size, local_kv, inter, vocab_rows,
                      q_head_start=rank * (hq // world_size), kv_head_start=kv_start,
                      intermediate_start=rank * inter, vocab_start=rank * vocab_rows)


def _parts(name: str, cfg) -> list[int] | None:
    """Rows of each checkpoint tensor fused into our parameter `name` (q|k|v, gate|up), or
    None for a parameter that is not fused."""
    d = cfg.head_dim
    if name.endswith(("qkv_proj.weight", "qkv_proj.bias")):
        return [cfg.num_heads * d, cfg.num_kv_heads * d, cfg.num_kv_heads * d]
    if name.endswith("gate_up_proj.weight"):
        return [cfg.intermediate_size, cfg.intermediate_size]
    return None


def _slice_part(name: str, part: int, t: torch.Tensor, cfg, shape: LocalShape):
    """Part `part` of our parameter `name` (whole, as in the checkpoint) -> (its first row in
    this rank's parameter, this rank's slice of it)."""
    d = cfg.head_dim
    q = slice(shape.q_head_start * d, (shape.q_head_start + shape.num_heads) * d)
    kv = slice(shape.kv_head_start * d, (shape.kv_head_start + shape.num_kv_heads) * d)
    mlp = slice(shape.intermediate_start, shape.intermediate_start + shape.intermediate_size)
    local_q, local_kv = shape.num_heads * d, shape.num_kv_heads * d
    if name.endswith(("qkv_proj.weight", "qkv_proj.bias")):  # column-parallel, by heads
        return (0, t[q]) if part == 0 else (local_q + (part - 1) * local_kv, t[kv])
    if name.endswith("gate_up_proj.weight"):  # column-parallel, by intermediate rows
        return part * shape.intermediate_size, t[mlp]
    if name.endswith("o_proj.weight"):  # row-parallel: the input columns of this rank's heads
        return 0, t[:, q]
    if name.endswith("down_proj.weight"):
        return 0, t[:, mlp]
    if name in ("embed_tokens.weight", "lm_head"):  # vocab-parallel
        return 0, t[shape.vocab_start : shape.vocab_start + shape.vocab_rows]
    return 0, t  # norms, O's bias (added once, after the all-reduce): on every rank whole


def shard_state_dict(state: dict, cfg, shape: LocalShape) -> dict:
    """A whole state dict in our parameter names -> this rank's slices of it (copies)."""
    out = {}
    for name, t in state.items():
        sizes = _parts(name, cfg) or [t.shape[0]]
        pieces = [_slice_part(name, i, part, cfg, shape)[1]
                  for i, part in enumerate(t.split(sizes, dim=0))]
        t = torch.cat(pieces, dim=0) if len(pieces) > 1 else pieces[0]
        if name in ("embed_tokens.weight", "lm_head") and t.shape[0] < shape.vocab_rows:
            pad = t.new_zeros((shape.vocab_rows - t.shape[0],) + tuple(t.shape[1:]))
            t = torch.cat([t, pad], dim=0)  # the last rank: padded to the common shard size
        out[name] = t.contiguous().clone()
    return out


def checkpoint_slicer(cfg, shape: LocalShape):
    """For the streaming loader: (our name, first row in the whole parameter, checkpoint
    tensor) -> (first row in this rank's parameter, this rank's slice of the tensor)."""

    def slice_tensor(name: str, row: int, t: torch.Tensor):
        sizes = _parts(name, cfg) or [t.shape[0]]
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        return _slice_part(name, starts.index(row), t, cfg, shape)

    return slice_tensor


# ---- one rank's view of the group ----------------------------------------------------------
class TensorParallel:
    """This rank's place in the tensor-parallel group and the collectives the model and the
    engine use. Built by `start`; `None` stands for a single device everywhere."""

    def __init__(self, rank: int, world_size: int, local_rank: int, device: torch.device,
                 control, workers: list | None = None):
        self.rank, self.world_size, self.local_rank = rank, world_size, local_rank
        self.device = device
        self.control = control  # gloo group for the step layout (host tensors)
        self.workers = workers or []  # processes rank 0 spawned (none under torchrun)
        self.failure: str | None = None  # set by the watchdog when a worker died
        self._watchdog: threading.Thread | None = None
        self._closed = False
        self._reported = False  # rank 0's caller got a WorkerDiedError
        self.threads_before = torch.get_num_threads()  # restored on shutdown

    def shape(self, cfg) -> LocalShape:
        return local_shape(cfg, self.rank, self.world_size)

    # ---- collectives inside the model (the same calls eagerly and under graph capture) ----
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of every rank's partial x, in place."""
        dist.all_reduce(x)
        return x

    def embed(self, weight: torch.Tensor, input_ids: torch.Tensor, vocab_start: int):
        """Vocab-parallel embedding: this rank's rows for ids in its range, zeros elsewhere,
        summed over ranks."""
        local = input_ids - vocab_start
        mine = (local >= 0) & (local < weight.shape[0])
        x = torch.nn.functional.embedding(local.clamp(0, weight.shape[0] - 1), weight)
        x = x * mine.unsqueeze(-1).to(x.dtype)
        return self.all_reduce(x)

    def gather_vocab(self, logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """[N, vocab_rows] of this rank -> [N, vocab_size] (every rank's columns in order)."""
        n, rows = logits.shape
        logits = logits.contiguous()
        if dist.get_backend() == "gloo":  # gloo lacks all_gather_into_tensor
            parts = [torch.empty_like(logits) for _ in range(self.world_size)]
            dist.all_gather(parts, logits)
            full = torch.cat(parts, dim=1)
        else:
            out = torch.empty((self.world_size, n, rows), dtype=logits.dtype, device=logits.device)
            dist.all_gather_into_tensor(out, logits)
            full = out.permute(1, 0, 2).reshape(n, self.world_size * rows)
        return full[:, :vocab_size]

    def agree_min(self, value: int) -> int:
        """The smallest `value` over all ranks (e.g. KV pages every rank can hold)."""
        t = torch.tensor([value], dtype=torch.int64)
        try:
            dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.control)
        except RuntimeError as e:  # a rank died while loading
            raise self._failed(e) from e
        return int(t.item())

    # ---- the step channel: rank 0 -> workers ---------------------------------------------
    def send_step(self, update, input_ids: torch.Tensor) -> None:
        """Rank 0: the scheduler's BatchUpdate (host, gloo: each rank's runner applies it to
        its own batch and pads the layout the same way) and the step's input ids (device, as
        loaded) to every worker."""
        body = torch.frombuffer(bytearray(pickle.dumps(update, pickle.HIGHEST_PROTOCOL)),
                                dtype=torch.uint8)
        self._control_broadcast(torch.tensor([_STEP, body.numel()], dtype=torch.int64))
        self._control_broadcast(body)
        self._broadcast_input_ids(input_ids)

    def recv_step(self):
        """A worker: the next step's BatchUpdate, or None when rank 0 shuts down."""
        header = torch.empty(2, dtype=torch.int64)
        self._control_broadcast(header)
        if header[0].item() == _STOP:
            return None
        body = torch.empty(int(header[1]), dtype=torch.uint8)
        self._control_broadcast(body)
        return pickle.loads(body.numpy().tobytes())

    def recv_input_ids(self, input_ids: torch.Tensor) -> None:
        """A worker: the step's input ids from rank 0, into its own device buffer."""
        self._broadcast_input_ids(input_ids)

    def _broadcast_input_ids(self, input_ids: torch.Tensor) -> None:
        dist.broadcast(input_ids, src=0)

    def _control_broadcast(self, t: torch.Tensor) -> None:
        try:
            dist.broadcast(t, src=0, group=self.control)
        except RuntimeError as e:
            raise self._failed(e) from e

    # ---- failures and shutdown ------------------------------------------------------------
    def start_watchdog(self) -> None:
        """Rank 0 with spawned workers: notice a worker that dies, whatever rank 0 is doing."""
        if self.workers:
            self._watchdog = threading.Thread(target=self._watch, name="flashlet-tp-watchdog",
                                              daemon=True)
            self._watchdog.start()

    def _watch(self) -> None:
        while not self._closed:
            dead = [p for p in self.workers if not p.is_alive()]
            if dead:
                self.failure = _dead_message(dead)
                log.error("%s", self.failure)
                self._abort_collectives()
                self._exit_if_still_blocked()
                return
            time.sleep(WATCHDOG_PERIOD_S)

    def _abort_collectives(self) -> None:
        """Make collectives blocked on the dead peer fail instead of waiting for the timeout."""
        if self.device.type != "cuda":
            return  # gloo notices a closed connection by itself
        try:
            dist.distributed_c10d._abort_process_group()
        except Exception as e:  # best effort: the grace period below still bounds the wait
            log.warning("could not abort the NCCL communicators: %s", e)

    def _exit_if_still_blocked(self) -> None:
        deadline = time.monotonic() + DEAD_WORKER_GRACE_S
        while time.monotonic() < deadline:
            if self._closed or self._reported:
                return
            time.sleep(WATCHDOG_PERIOD_S)
        print(f"flashlet: {self.failure}; rank 0 is still blocked in a collective after "
              f"{DEAD_WORKER_GRACE_S:.0f} s, exiting", file=sys.stderr, flush=True)
        os._exit(1)

    def check(self) -> None:
        """Before rank 0's step: raise WorkerDiedError if the watchdog saw a worker die."""
        if self.rank != 0:
            raise RuntimeError(f"rank {self.rank} runs rank 0's steps (tp_worker.serve), "
                               f"not steps of its own")
        if self.failure is not None:
            self._reported = True
            raise WorkerDiedError(self.failure)

    def _failed(self, error: BaseException) -> WorkerDiedError:
        """The error rank 0's caller gets (the watchdog then leaves the process alone)."""
        self._reported = True
        return WorkerDiedError(self._describe_failure(error))

    def _describe_failure(self, error: BaseException) -> str:
        self._worker_dies_soon(error)
        dead = [p for p in self.workers if not p.is_alive()]
        if dead:
            return _dead_message(dead)
        if self.failure is not None:
            return self.failure
        who = "rank 0" if self.rank else "a tensor-parallel rank"
        return f"tensor-parallel group broken ({who} gone?): {type(error).__name__}: {error}"

    def failure_from(self, error: BaseException) -> WorkerDiedError | None:
        """The WorkerDiedError behind `error`, if a worker is dead (None: an ordinary error)."""
        if isinstance(error, WorkerDiedError):
            return error
        if (self.failure is not None or self._worker_dies_soon(error)
                or isinstance(error, dist.DistError)):  # e.g. a peer gone under torchrun
            return self._failed(error)
        return None

    def _worker_dies_soon(self, error: BaseException, within_s: float = 2.0) -> bool:
        """Whether a worker is dead or about to be: a peer's closed socket can reach rank 0
        before the dying process can be reaped."""
        deadline = time.monotonic() + (within_s if isinstance(error, RuntimeError) else 0)
        while True:
            if any(not p.is_alive() for p in self.workers):
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)

    def shutdown(self, join_timeout_s: float = 30.0) -> None:
        """Rank 0: tell the workers to stop, leave the group (every rank at once, since NCCL's
        tear-down may wait for the peers), wait for the workers. Idempotent."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.shutdown)
        if self.rank == 0 and self.failure is None and all(p.is_alive() for p in self.workers):
            try:
                self._control_broadcast(torch.tensor([_STOP, 0]))
            except WorkerDiedError as e:
                log.warning("tensor-parallel shutdown: %s", e)
        # After a failure NCCL's communicators are aborted already; gloo's close cleanly.
        if dist.is_initialized() and (self.failure is None or self.device.type != "cuda"):
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            dist.destroy_process_group()
        deadline = time.monotonic() + join_timeout_s
        for p in self.workers:
            p.join(max(deadline - time.monotonic(), 0.1))
            if p.is_alive():
                log.warning("tensor-parallel worker pid %d did not stop; terminating it", p.pid)
                p.kill()
                p.join(5)
        torch.set_num_threads(self.threads_before)


def _dead_message(dead) -> str:
    parts = [f"pid {p.pid} " + (f"killed by signal {-p.exitcode}" if (p.exitcode or 0) < 0
                                else f"exit code {p.exitcode}") for p in dead]
    return ("tensor-parallel worker died (" + "; ".join(parts)
            + "): the engine cannot continue; see the worker's output above for its error")


# ---- starting the group --------------------------------------------------------------------
def launched_by_torchrun() -> bool:
    """True when the environment names this process's rank (torchrun, or a spawned worker)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def launched_rank() -> int:
    return int(os.environ.get("RANK", 0)) if launched_by_torchrun() else 0


def timeout() -> datetime.timedelta:
    text = os.environ.get("FLASHLET_TP_TIMEOUT_S", DEFAULT_TIMEOUT_S)
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not 0 < seconds < float("inf"):
        raise ValueError(f"FLASHLET_TP_TIMEOUT_S={text!r}: expected a positive number of seconds")
    return datetime.timedelta(seconds=seconds)


def start(config, device: torch.device, model_config, worker_entry) -> TensorParallel | None:
    """Join (or, as rank 0 outside torchrun, create) the tensor-parallel group of `config`;
    None for tensor_parallel_size 1. model_config (a ModelConfig): its split is checked before
    any process starts. worker_entry(config, rank, world_size, master_port): what a spawned
    rank runs."""
    world = config.tensor_parallel_size
    if world == 1:
        return None
    local_shape(model_config, 0, world)  # raises ValueError where the model does not split
    wait = timeout()  # a bad FLASHLET_TP_TIMEOUT_S is refused here, before any process starts
    if dist.is_initialized():
        gc.collect()  # an engine dropped but not collected yet leaves its group as it goes
    if dist.is_initialized():
        raise ValueError("a torch.distributed group is already running in this process (another "
                         "tensor-parallel engine?): shut it down first")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast stays off
    workers = []
    if launched_by_torchrun():
        if int(os.environ["WORLD_SIZE"]) != world:
            raise ValueError(f"tensor_parallel_size {world} but WORLD_SIZE is "
                             f"{os.environ['WORLD_SIZE']}: start as many ranks as the size")
        rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", 0))
    else:
        rank, local_rank = 0, 0
        workers = _spawn_workers(worker_entry, config, world, device)
    device = _rank_device(device, local_rank)
    backend = "nccl" if device.type == "cuda" else "gloo"
    threads = torch.get_num_threads()
    if device.type == "cpu":  # ranks share the cores: spinning OpenMP threads would starve peers
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    try:
        dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world,
                                timeout=wait)
        control = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
        _warm_up(device)
    except Exception as e:
        for p in workers:
            p.kill()
        raise WorkerDiedError(f"tensor-parallel start-up failed on rank {rank}: {e}") from e
    tp = TensorParallel(rank, world, local_rank, device, control, workers)
    tp.threads_before = threads
    tp.start_watchdog()
    if rank == 0:
        atexit.register(tp.shutdown)  # workers stop even if the engine is never shut down
    log.info("tensor parallel: rank %d of %d on %s (%s)", rank, world, device, backend)
    return tp


def _rank_device(device: torch.device, local_rank: int) -> torch.device:
    if device.type != "cuda":
        return device
    if local_rank >= torch.cuda.device_count():
        raise ValueError(f"rank with LOCAL_RANK {local_rank} has no GPU "
                         f"({torch.cuda.device_count()} visible)")
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def _warm_up(device: torch.device) -> None:
    """One collective on each group, so NCCL's lazy set-up never happens inside a capture."""
    x = torch.ones(1, device=device)
    dist.all_reduce(x)
    if x.item() != dist.get_world_size():
        raise RuntimeError(f"all-reduce warm-up gave {x.item()}")


def _spawn_workers(worker_entry, config, world: int, device: torch.device) -> list:
    """Rank 0 outside torchrun: pick a free port and start ranks 1..world-1 (spawn)."""
    if device.type == "cuda" and torch.cuda.device_count() < world:
        raise ValueError(f"tensor_parallel_size {world} needs {world} GPUs, "
                         f"{torch.cuda.device_count()} visible")
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(_free_port())
    ctx = torch.multiprocessing.get_context("spawn")
    workers = []
    for rank in range(1, world):
        p = ctx.Process(target=worker_entry, args=(config, rank, world, os.environ["MASTER_PORT"]),
                        name=f"flashlet-tp{rank}", daemon=True)
        p.start()
        workers.append(p)
    return workers


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
