"""Each Triton kernel of v09/v10 against its PyTorch counterpart (the v08 code it replaces), with
odd sizes, partial blocks and partial pages; and the masked lanes of the last block must not
write past the end of the output."""

import pytest
import torch
import torch.nn.functional as F
from torchlet_testing import DEVICE, triton_can_run

if not triton_can_run():
    pytest.skip(
        "Triton needs CUDA, or TRITON_INTERPRET=1 set before triton was first imported",
        allow_module_level=True,
    )

from torchlet.v08_paged_gqa_py import layers as torch_layers  # noqa: E402
from torchlet.v08_paged_gqa_py.attention import paged_decode_gqa  # noqa: E402
from torchlet.v08_paged_gqa_py.batch import DecodeBatch  # noqa: E402
from torchlet.v09_triton_basics import triton_ops  # noqa: E402
from torchlet.v10_triton_paged_gqa.triton_paged_attention import paged_gqa_decode  # noqa: E402

ATOL = 2e-5


def randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE)


# --- RMSNorm --------------------------------------------------------------------------------------


@pytest.mark.parametrize("num_tokens, hidden_size", [(1, 1), (3, 37), (4, 64), (2, 1025)])
def test_rms_norm_matches_pytorch(num_tokens, hidden_size):
    x, weight = randn(num_tokens, hidden_size, seed=1), randn(hidden_size, seed=2)
    reference = torch_layers.RMSNorm(hidden_size, eps=1e-6).to(DEVICE)
    reference.weight.data.copy_(weight)
    expected = reference(x)
    torch.testing.assert_close(triton_ops.rms_norm(x, weight, 1e-6), expected, atol=ATOL, rtol=0)


def test_rms_norm_masked_lanes_write_nothing():
    num_tokens, hidden_size = 3, 37  # BLOCK = 64: 27 masked lanes per row
    x, weight = randn(num_tokens, hidden_size, seed=3), randn(hidden_size, seed=4)
    buffer = torch.full((num_tokens * hidden_size + 64,), float("nan"), device=DEVICE)
    out = buffer[: num_tokens * hidden_size].view(num_tokens, hidden_size)
    triton_ops.rms_norm_kernel[(num_tokens,)](x, weight, out, hidden_size, 1e-6, BLOCK=64)
    assert not out.isnan().any()
    assert buffer[num_tokens * hidden_size :].isnan().all()


# --- RoPE -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "num_tokens, num_heads, head_dim", [(1, 1, 2), (3, 5, 12), (4, 6, 64), (2, 3, 10)]
)
def test_rope_matches_pytorch(num_tokens, num_heads, head_dim):
    x = randn(num_tokens, num_heads, head_dim, seed=5)
    positions = torch.tensor([0, 7, 300, 4095][:num_tokens], device=DEVICE)
    cos, sin = torch_layers.rope_cos_sin(positions, head_dim, theta=10000.0)
    expected = torch_layers.apply_rope(x, cos, sin)
    torch.testing.assert_close(triton_ops.rope(x, cos, sin), expected, atol=ATOL, rtol=0)


def test_rope_leaves_position_zero_unrotated():
    x = randn(1, 3, 12, seed=6)
    cos, sin = torch_layers.rope_cos_sin(torch.zeros(1, device=DEVICE), 12, theta=10000.0)
    torch.testing.assert_close(triton_ops.rope(x, cos, sin), x, atol=ATOL, rtol=0)


# --- SwiGLU activation ----------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(1, 1), (1, 1023), (1, 1024), (1, 1025), (3, 1000)])
def test_silu_mul_matches_pytorch(shape):
    gate, up = randn(*shape, seed=7) * 4, randn(*shape, seed=8)
    expected = F.silu(gate) * up
    torch.testing.assert_close(triton_ops.silu_mul(gate, up), expected, atol=ATOL, rtol=1e-6)


def test_silu_mul_masked_lanes_write_nothing():
    num_elements, block = 1025, 1024  # the second program has 1 live lane and 1023 masked ones
    gate, up = randn(num_elements, seed=9), randn(num_elements, seed=10)
    buffer = torch.full((num_elements + block,), float("nan"), device=DEVICE)
    out = buffer[:num_elements]
    triton_ops.silu_mul_kernel[(2,)](gate, up, out, num_elements, BLOCK=block)
    torch.testing.assert_close(out, F.silu(gate) * up, atol=ATOL, rtol=1e-6)
    assert buffer[num_elements:].isnan().all()


# --- paged GQA decode -----------------------------------------------------------------------------


def paged_problem(num_slots, num_heads, num_kv_heads, head_dim, page_size, seq_lens, seed=0):
    """Random queries, a random page pool, and each slot's pages scattered through it."""
    max_pages = max(-(-n // page_size) for n in seq_lens) + 1  # one spare entry: the null page
    num_pages = 1 + num_slots * max_pages
    k_cache = randn(num_pages, page_size, num_kv_heads, head_dim, seed=seed)
    v_cache = randn(num_pages, page_size, num_kv_heads, head_dim, seed=seed + 1)
    pages = torch.randperm(num_pages - 1, generator=torch.Generator().manual_seed(seed)) + 1
    page_table = torch.zeros(num_slots, max_pages, dtype=torch.int32)
    for slot, seq_len in enumerate(seq_lens):
        used = -(-seq_len // page_size)
        page_table[slot, :used] = pages[slot * max_pages : slot * max_pages + used].int()
    q = randn(num_slots, num_heads, head_dim, seed=seed + 2)
    seq_lens = torch.tensor(seq_lens, device=DEVICE)
    return q, k_cache, v_cache, page_table.to(DEVICE), seq_lens


PAGED_CASES = [
    # num_slots, num_heads, num_kv_heads, head_dim, page_size, seq_lens
    (4, 6, 2, 12, 4, [1, 4, 5, 11]),  # groups of 3, head_dim 12, partial and full pages
    (3, 4, 4, 16, 8, [8, 9, 17]),  # plain multi-head attention (groups of 1)
    (2, 8, 1, 10, 16, [3, 33]),  # multi-query attention, head_dim 10
]


@pytest.mark.parametrize("case", PAGED_CASES)
def test_paged_gqa_decode_matches_pytorch(case):
    *shape, page_size, seq_lens = case
    q, k_cache, v_cache, page_table, lens = paged_problem(*shape, page_size, seq_lens)
    scale = shape[3] ** -0.5
    batch = DecodeBatch(positions=lens - 1, slots=torch.arange(len(seq_lens), device=DEVICE))
    expected = paged_decode_gqa(q, k_cache, v_cache, page_table, batch, scale)
    got = paged_gqa_decode(q, k_cache, v_cache, page_table, lens, scale)
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=1e-5)


def test_paged_gqa_decode_ignores_what_lies_past_the_sequence():
    q, k_cache, v_cache, page_table, lens = paged_problem(2, 6, 2, 12, 4, [5, 2], seed=3)
    scale = 12**-0.5
    clean = paged_gqa_decode(q, k_cache, v_cache, page_table, lens, scale)
    for slot, seq_len in enumerate(lens.tolist()):  # poison the tail of each slot's last page
        last_page = page_table[slot, (seq_len - 1) // 4]
        k_cache[last_page, seq_len % 4 or 4 :] = float("nan")
        v_cache[last_page, seq_len % 4 or 4 :] = float("nan")
    k_cache[0], v_cache[0] = float("nan"), float("nan")  # the null page, too
    poisoned = paged_gqa_decode(q, k_cache, v_cache, page_table, lens, scale)
    torch.testing.assert_close(poisoned, clean)


def test_paged_gqa_decode_wants_power_of_two_pages():
    q, k_cache, v_cache, page_table, lens = paged_problem(1, 2, 1, 8, 3, [4])
    with pytest.raises(ValueError, match="power-of-two page_size"):
        paged_gqa_decode(q, k_cache, v_cache, page_table, lens, 1.0)
