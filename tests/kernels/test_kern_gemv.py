"""The one-row GEMV against F.linear: odd sizes (masking at both block edges), bias, a weight
that is a view; and TritonOpsGemv.linear's dispatch (GEMV for one row, cuBLAS for more)."""

from __future__ import annotations

import pytest
import torch

from flashlet.kernels.gemv import block_n_for, gemv, gemv_reference
from flashlet.kernels.ops import TritonOps, TritonOpsGemv
from flashlet.ops import TorchOps


def _randn(*shape, seed, device):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(device)


@pytest.mark.parametrize("n,k", [(1, 1), (5, 7), (37, 130), (64, 128), (130, 300)])
@pytest.mark.parametrize("bias", [False, True])
def test_gemv_matches_linear(kh, n, k, bias):
    x = _randn(1, k, seed=n, device=kh.device)
    w = _randn(n, k, seed=n + 1, device=kh.device)
    b = _randn(n, seed=n + 2, device=kh.device) if bias else None
    got = gemv(x, w, b, block_k=32)  # several K tiles, the last one partial
    assert got.shape == (1, n)
    assert kh.rel_err(got, gemv_reference(x, w, b)) < 1e-5


def test_gemv_reads_a_row_slice_of_a_larger_weight(kh):
    full = _randn(48, 40, seed=3, device=kh.device)
    w = full[:, :24]  # rows strided by 40: the kernel must use the row stride
    x = _randn(1, 24, seed=4, device=kh.device)
    assert kh.rel_err(gemv(x, w), gemv_reference(x, w)) < 1e-5


def test_gemv_refuses_more_than_one_row(kh):
    with pytest.raises(ValueError, match="one row"):
        gemv(torch.zeros(2, 8, device=kh.device), torch.zeros(4, 8, device=kh.device))


def test_block_n_gives_a_few_programs_per_sm():
    assert block_n_for(1152, 132) == 4
    assert block_n_for(9728, 132) == 16
    assert block_n_for(151936, 132) == 64


def test_linear_dispatch(kh, monkeypatch):
    import flashlet.kernels.ops as ops_module

    calls = []
    monkeypatch.setattr(ops_module, "gemv", lambda *a: calls.append(a) or gemv(*a))
    w = _randn(6, 10, seed=5, device=kh.device)
    one, two = _randn(1, 10, seed=6, device=kh.device), _randn(2, 10, seed=7, device=kh.device)
    for ops in (TritonOps, TritonOpsGemv):
        for x in (one, two):
            assert kh.rel_err(ops.linear(x, w), TorchOps.linear(x, w)) < 1e-5
    assert len(calls) == 1, "only TritonOpsGemv with one row goes through the GEMV"
