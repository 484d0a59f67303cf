"""Record the static decode step once as a CUDA graph, then replay it.

A decode step of a small batch launches hundreds of small kernels, and on a GPU the time to
launch them from Python dominates. `torch.cuda.CUDAGraph` records the kernels of one run, with
their arguments (tensor addresses included), and `replay()` relaunches the whole sequence with a
single call. That is only correct if every replay reads and writes the same addresses, which is
what StaticDecodeStep guarantees: new inputs are copied into its buffers before each replay.
"""

from __future__ import annotations

import torch

from .static_decode import StaticDecodeStep


class CudaGraphDecodeStep:
    def __init__(self, step: StaticDecodeStep):
        self.step = step
        self.graph = torch.cuda.CUDAGraph()
        with torch.inference_mode():
            self.warm_up()
            with torch.cuda.graph(self.graph):  # records the kernels instead of running them
                step.run()

    def warm_up(self, runs: int = 3) -> None:
        """Run a few times eagerly on a side stream: lazy set-up work (cuBLAS handles, kernel
        caches, Triton compilation) must not happen while a graph is being recorded."""
        side_stream = torch.cuda.Stream()
        side_stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side_stream):
            for _ in range(runs):
                self.step.run()
        torch.cuda.current_stream().wait_stream(side_stream)

    def set_inputs(self, input_ids: list[int], positions: list[int]) -> None:
        self.step.set_inputs(input_ids, positions)

    def run(self) -> torch.Tensor:
        """Replay the recorded kernels; the answer lands in the step's `next_ids` buffer."""
        self.graph.replay()
        return self.step.next_ids
