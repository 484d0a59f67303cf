"""The kernel sweep: refuses the CPU outside smoke mode; smoke mode produces sane rows."""

from __future__ import annotations

import pytest
import torch

from flashlet.kernels.bench import KERNELS, format_rows, main, run_kernel_sweep


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU refusal is only reachable without CUDA")
def test_sweep_refuses_the_cpu():
    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        run_kernel_sweep("cpu")
    assert main(["--device", "cpu", "--kernels", "decode"]) == 2


def test_smoke_sweep_produces_rows(kh):
    rows = run_kernel_sweep(kh.device, smoke=True)
    assert {r["kernel"] for r in rows} == set(KERNELS)
    for r in rows:
        assert r["triton_us"] > 0 and r["reference_us"] > 0, r
        assert r["bytes"] > 0 and r["flops"] > 0 and r["copy_gbps"] > 0
        assert r["triton_gbps"] == pytest.approx(r["bytes"] / (r["triton_us"] * 1e-6) / 1e9)
        assert r["triton_frac_copy_bw"] == pytest.approx(r["triton_gbps"] / r["copy_gbps"])
        assert r["max_rel_err_vs_reference"] < 1e-5, r
        if kh.device == "cpu":
            assert r["flashinfer_us"] is None
    table = format_rows(rows)
    assert len(table.splitlines()) == len(rows) + 1


def test_smoke_sweep_accepts_the_bench_cli_arguments(kh):
    """flashlet.bench passes device/dtype (as a name)/page_size/seed/quick/progress by keyword."""
    advanced = []

    class Task:
        def advance(self, n=1):
            advanced.append(n)

    class Progress:
        def task(self, description, total):
            assert total > 0
            return Task()

    rows = run_kernel_sweep(
        device=kh.device, dtype="float32", page_size=2, seed=3, quick=True, progress=Progress(), smoke=True,
        kernels=("decode", "silu_mul"),
    )
    assert [r["kernel"] for r in rows].count("decode") == 1
    assert len(advanced) == len(rows)
