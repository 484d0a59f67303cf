"""A tensor-parallel worker (ranks 1..N-1): runs rank 0's steps on its slice of the model.

The loop is four calls per step: receive the scheduler's update of the step batch (over gloo),
apply it to this rank's persistent batch as rank 0 does (`ModelRunner.prepare`: the same rows,
the same layout), load the layout into the step buffers (`ModelRunner.load`: the same CUDA-graph
padding; no fed rows, since rank 0 sends the input ids) and receive the input ids on the device, then the same forward as rank 0 (its all-reduces and the logits
all-gather pair with rank 0's; the logits are dropped, since only rank 0 samples). A STOP
message from rank 0 ends it.

The engine is built by whoever started the rank: `worker_main` for a rank that rank 0 spawned
(given the Engine class, so this module imports no engine), `serve_if_worker` for one that
torchrun started and that runs the caller's script.
"""

from __future__ import annotations

import logging
import os
import threading
import time

log = logging.getLogger("flashlet")


def worker_main(engine_class, config, rank: int, world_size: int, master_port: str) -> None:
    """Entry point of a rank that rank 0 spawned: the env:// variables torchrun would set,
    then the engine, then its steps until rank 0 stops."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=master_port, RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    _exit_with_parent()
    serve(engine_class(config))


def serve_if_worker(engine) -> None:
    """Under torchrun every rank runs the caller's code: on a rank other than 0, run rank 0's
    steps and exit (SystemExit(0)) when it stops, so only rank 0 goes on."""
    if engine.tp is not None and engine.tp.rank != 0:
        serve(engine)
        raise SystemExit(0)


def serve(engine) -> None:
    """Run rank 0's steps until it sends STOP, then leave the group."""
    tp, runner = engine.tp, engine.runner
    log.info("tensor-parallel worker rank %d ready", tp.rank)
    while True:
        update = tp.recv_step()
        if update is None:
            break
        layout = runner.prepare(update).without_feed()
        input_ids, meta = runner.load(layout)  # waits until the host staging is free
        tp.recv_input_ids(input_ids)
        runner.forward(input_ids, meta)
    engine.shutdown()


def _exit_with_parent() -> None:
    """A spawned worker whose rank 0 vanished (killed, not shut down) exits too."""
    parent = os.getppid()

    def watch():
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="flashlet-tp-parent-watch", daemon=True).start()
