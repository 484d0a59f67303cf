"""Standalone Triton kernels for flashlet, each next to a plain-PyTorch `*_reference`.

Every module holds one kernel family, a Python launcher and its reference:

- `decode_attention`  paged GQA decode attention with split-KV and a log-sum-exp merge (two
                      launches, or one whose last split program merges)
- `prefill_attention` ragged paged causal attention (prefill chunks and decodes in one launch)
- `pdl`               Programmatic Dependent Launch: the two instructions, `pdl_supported`
- `embedding`         embedding rows gathered by token id (with PDL, for the fused decode path)
- `rope_kv_write`     RoPE on Q and K fused with the K/V write into the paged pool
- `rmsnorm`           RMSNorm and fused residual-add + RMSNorm
- `silu_mul`          SiLU-and-mul of the MLP's gate/up projection
- `fp8_gemv`          weight-only FP8 GEMM for decode rows: the fp8 weight streamed once, split-K
- `sampling`          sort-free exact sampling (temperature, min_p, top-k, top-p) with Philox noise
- `ops`               `TritonOps`, the drop-in for `flashlet.models.ops.TorchOps`
- `bench`             the kernel sweep (time, bandwidth, fraction of copy bandwidth)

The kernels need a CUDA device, or the Triton interpreter on the CPU: set the environment
variable TRITON_INTERPRET=1 before these modules are first imported (whether a kernel is
interpreted is decided when its `@triton.jit` decorator runs).
"""
