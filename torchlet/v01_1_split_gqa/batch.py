"""What a forward pass over several requests needs to know besides the token ids."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import torch


@dataclass
class RaggedBatch:
    """The tokens of several requests concatenated into one flat list, without padding.

    Request i owns the tokens req_indptr[i]:req_indptr[i + 1] (a CSR-style index pointer).
    """

    positions: torch.Tensor  # [num_tokens] position of each token inside its own request
    req_indptr: torch.Tensor  # [num_requests + 1], on the CPU: Python loops over it

    @classmethod
    def from_lengths(cls, lengths: list[int], device: torch.device) -> RaggedBatch:
        positions = torch.cat([torch.arange(length) for length in lengths]).to(device)
        req_indptr = torch.tensor([0, *accumulate(lengths)])
        return cls(positions=positions, req_indptr=req_indptr)

    def last_token_indices(self) -> torch.Tensor:
        return self.req_indptr[1:] - 1  # [num_requests] where each request's last token sits


Batch = RaggedBatch  # what the model's forward pass receives
