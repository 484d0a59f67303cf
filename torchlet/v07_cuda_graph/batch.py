"""What a forward pass needs to know besides the token ids: a prefill pass (whole prompts) or a
decode pass (one new token per request)."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import torch


@dataclass
class PrefillBatch:
    """The prompts of several requests concatenated into one flat list, without padding.

    Request i owns the tokens req_indptr[i]:req_indptr[i + 1] (a CSR-style index pointer).
    """

    positions: torch.Tensor  # [num_tokens] position of each token inside its own request
    req_indptr: torch.Tensor  # [num_requests + 1], on the CPU: Python loops over it
    slots: torch.Tensor  # [num_tokens] the decode slot of each token's request

    @classmethod
    def from_prompts(
        cls, lengths: list[int], slots: list[int], device: torch.device
    ) -> PrefillBatch:
        positions = torch.cat([torch.arange(length) for length in lengths]).to(device)
        req_indptr = torch.tensor([0, *accumulate(lengths)])
        token_slots = torch.cat([torch.full((n,), slot) for n, slot in zip(lengths, slots)])
        return cls(positions=positions, req_indptr=req_indptr, slots=token_slots.to(device))

    def last_token_indices(self) -> torch.Tensor:
        return self.req_indptr[1:] - 1  # [num_requests] where each request's last token sits


@dataclass
class DecodeBatch:
    """One new token per decode slot, every slot, in slot order: a fixed-width batch whose row s
    is slot s. Empty slots carry a dummy token at position 0, and their output is ignored."""

    positions: torch.Tensor  # [num_slots] position of each slot's new token
    slots: torch.Tensor  # [num_slots] = 0, 1, ..., num_slots - 1

    @property
    def seq_lens(self) -> torch.Tensor:
        return self.positions + 1  # [num_slots] cached tokens to attend to, the new one included


Batch = PrefillBatch | DecodeBatch  # what the model's forward pass receives
