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
    cache_rows: torch.Tensor  # [num_tokens] the KV cache row each token's key and value go to

    @classmethod
    def from_prompts(
        cls, lengths: list[int], rows: list[int], device: torch.device
    ) -> PrefillBatch:
        positions = torch.cat([torch.arange(length) for length in lengths]).to(device)
        req_indptr = torch.tensor([0, *accumulate(lengths)])
        cache_rows = torch.cat([torch.full((n,), row) for n, row in zip(lengths, rows)])
        return cls(positions=positions, req_indptr=req_indptr, cache_rows=cache_rows.to(device))

    def last_token_indices(self) -> torch.Tensor:
        return self.req_indptr[1:] - 1  # [num_requests] where each request's last token sits


@dataclass
class DecodeBatch:
    """One new token per request; everything before it is read from the KV cache."""

    positions: torch.Tensor  # [num_requests] position of each request's new token
    cache_rows: torch.Tensor  # [num_requests] each request's KV cache row

    @property
    def seq_lens(self) -> torch.Tensor:
        return self.positions + 1  # [num_requests] cached tokens to attend to, the new one included


Batch = PrefillBatch | DecodeBatch  # what the model's forward pass receives
