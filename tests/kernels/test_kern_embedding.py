"""The embedding gather (flashlet/kernels/embedding.py) against index_select."""

from __future__ import annotations

import pytest
import torch

from flashlet.kernels.embedding import gather_rows


@pytest.mark.parametrize("hidden,block", [(896, 1024), (100, 32), (64, 1024)])
def test_gather_rows_matches_index_select(kh, hidden, block):
    weight = torch.randn(50, hidden, device=kh.device).to(torch.bfloat16)
    ids = torch.tensor([3, 0, 49, 3], device=kh.device)
    out = torch.full((4, hidden), float("nan"), device=kh.device, dtype=torch.bfloat16)
    assert gather_rows(weight, ids, out, block=block) is out
    assert torch.equal(out, weight.index_select(0, ids))


def test_gather_rows_refuses_bad_shapes(kh):
    weight = torch.randn(10, 16, device=kh.device)
    ids = torch.tensor([1], device=kh.device)
    with pytest.raises(ValueError, match="do not fit"):
        gather_rows(weight, ids, torch.empty(2, 16, device=kh.device))
    with pytest.raises(ValueError, match="one dtype"):
        gather_rows(weight, ids, torch.empty(1, 16, device=kh.device, dtype=torch.float16))
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="Programmatic Dependent Launch"):
            gather_rows(weight, ids, torch.empty(1, 16, device=kh.device), pdl=True)
