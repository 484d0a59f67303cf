"""The decode step on buffers allocated once. Every step reads its inputs from, and writes its
output to, the same tensors at the same addresses, and nothing inside it depends on the data for
a shape or needs the host (no `.item()`, no new host-to-device copies): exactly what a CUDA graph
(v07) can record once and replay."""

from __future__ import annotations

import torch

from .batch import DecodeBatch


class StaticDecodeStep:
    def __init__(self, model: torch.nn.Module, num_slots: int, device: torch.device):
        self.model = model
        self.inputs = torch.zeros(2, num_slots, dtype=torch.long, device=device)  # [2, num_slots]
        self.input_ids = self.inputs[0]  # [num_slots] each slot's newest token (views: the
        self.positions = self.inputs[1]  # [num_slots] and its position  same memory as inputs)
        self.next_ids = torch.zeros(num_slots, dtype=torch.long, device=device)  # [num_slots]
        slots = torch.arange(num_slots, device=device)
        self.batch = DecodeBatch(positions=self.positions, slots=slots)

    def set_inputs(self, input_ids: list[int], positions: list[int]) -> None:
        """Copy this step's inputs into the buffers, in place: one host-to-device copy."""
        self.inputs.copy_(torch.tensor([input_ids, positions], dtype=torch.long))

    def run(self) -> torch.Tensor:
        """Forward pass and greedy pick for every slot; the answer lands in `next_ids`."""
        hidden = self.model(self.input_ids, self.batch)  # [num_slots, hidden_size]
        self.next_ids.copy_(self.model.logits(hidden).argmax(dim=-1))
        return self.next_ids
