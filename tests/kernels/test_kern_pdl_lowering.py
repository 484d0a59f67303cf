"""The per-op kernels' Programmatic Dependent Launch, lowered for sm_90a (no GPU needed): each
signals its dependents and waits once, and loads nothing a kernel of the step writes before the
wait; the fp8 GEMM asks L2 for its first weight lines there. Bit-identical results with and
without PDL are checked on the GPU (test_kern_fp8_gemv.py, tests/gpu/)."""

from __future__ import annotations

import json
import textwrap

import pytest

_LOWER = textwrap.dedent("""
    import json, sys
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from flashlet.kernels import fp8_gemv, rmsnorm, rope_kv_write, silu_mul

    def lower(fn, types, consts, warps, stages):
        sig = {n: "i32" for n in fn.arg_names}
        sig.update(types)
        sig.update({c: "constexpr" for c in consts})
        k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts),
                           target=GPUTarget("cuda", 90, 32),
                           options=dict(num_warps=warps, num_stages=stages, launch_pdl=True))
        lines = k.asm["ptx"].splitlines()
        wait = [i for i, l in enumerate(lines) if "griddepcontrol.wait" in l]
        before = lines[: wait[0]] if wait else []
        return dict(launch=sum("griddepcontrol.launch_dependents" in l for l in lines),
                    wait=len(wait), loads_before_wait=sum("ld.global" in l for l in before),
                    prefetch_before_wait=sum("prefetch.global.L2" in l for l in before),
                    prefetch=sum("prefetch.global.L2" in l for l in lines))

    gemm_types = dict(X="*bf16", W="*fp8e4nv", SCALE="*fp32", BIAS="*bf16", Y="*bf16",
                      PARTIAL="*fp32", COUNTS="*i32")
    gemm = dict(HAS_BIAS=True, SPLIT=True, DOT_FP32=False, BIT_WIDEN=True, USE_PDL=True,
                PREFETCH_K=512, BLOCK_M=16, BLOCK_N=64, BLOCK_K=256)
    cases = {
        "fp8_gemm": (fp8_gemv._fp8_gemm_kernel, gemm_types, dict(gemm, SILU_MUL=False), 4, 3),
        "fp8_gemm silu_mul": (fp8_gemv._fp8_gemm_kernel, gemm_types, dict(gemm, SILU_MUL=True), 4, 3),
        "add_rms_norm": (rmsnorm._rmsnorm_kernel,
                         dict(X="*bf16", R="*bf16", W="*bf16", Y="*bf16", RO="*bf16", eps="fp32"),
                         dict(BLOCK_H=1024, HAS_RESIDUAL=True, USE_PDL=True), 4, 1),
        "silu_mul": (silu_mul._silu_mul_kernel, dict(X="*bf16", Y="*bf16"),
                     dict(BLOCK=1024, USE_PDL=True), 4, 1),
        "rope_kv_write": (rope_kv_write._rope_kv_write_kernel,
                          dict(Q="*bf16", K="*bf16", V="*bf16", QO="*bf16", KO="*bf16", Pos="*i64",
                               CosSin="*fp32", KC="*bf16", VC="*bf16", Slots="*i64",
                               k_inv_scale="fp32", v_inv_scale="fp32", QW="*bf16", KW="*bf16",
                               norm_eps="fp32"),
                          dict(NUM_Q_HEADS=14, NUM_KV_HEADS=2, HQ_PAD=16, HKV_PAD=2, HALF=32,
                               HALF_PAD=32, PAGE_SIZE=16, APPLY_ROPE=True, WRITE_K_OUT=False,
                               WRITE_KV=True, CACHE_FP8=False, QK_NORM=False, USE_PDL=True), 1, 1),
    }
    for name in json.loads(sys.argv[1]):
        print(json.dumps(lower(*cases[name])), flush=True)
""")

KERNELS = ["fp8_gemm", "fp8_gemm silu_mul", "add_rms_norm", "silu_mul", "rope_kv_write"]


@pytest.fixture(scope="module")
def lowered(kh) -> dict:
    return dict(zip(KERNELS, kh.lowered_by_one_child(["-c", _LOWER, json.dumps(KERNELS)], len(KERNELS))))


@pytest.mark.slow
@pytest.mark.xdist_group("sm90-pdl-lowering")  # --dist loadgroup: one worker, one child
@pytest.mark.parametrize("kernel", KERNELS)
def test_per_op_kernels_signal_then_wait_before_any_load(lowered, kernel):
    got = lowered[kernel]
    assert (got["launch"], got["wait"]) == (1, 1)
    assert got["loads_before_wait"] == 0  # everything they load may come from the kernel before
    if kernel.startswith("fp8_gemm"):  # but the weights' first lines are asked of L2 first
        assert got["prefetch_before_wait"] == got["prefetch"] > 0
    else:
        assert got["prefetch"] == 0
