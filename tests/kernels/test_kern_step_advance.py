"""The fused greedy graph's input advance (kernels/step_advance.py) against its torch reference
(the interpreter on the CPU, the GPU where there is one)."""

from __future__ import annotations

import pytest
import torch

from flashlet.kernels.step_advance import advance_decode_inputs, advance_decode_inputs_reference

PAGE, SCRATCH = 16, 7


def _fields(device, rows: int, padding: int, seed: int) -> dict[str, torch.Tensor]:
    """A padded decode step's inputs: `rows` real rows on pages other than SCRATCH, then
    `padding` rows on its first slot, as StepBuffers pads them."""
    g = torch.Generator().manual_seed(seed)
    pages = torch.randint(0, 64, (rows,), generator=g)
    pages[pages == SCRATCH] = SCRATCH + 1
    offset = torch.randint(0, PAGE - 1, (rows,), generator=g)
    positions = torch.randint(0, 8, (rows,), generator=g) * PAGE + offset
    pad = torch.zeros(padding, dtype=torch.int64)
    f = dict(input_ids=torch.cat([torch.randint(0, 1000, (rows,), generator=g), pad]),
             positions=torch.cat([positions, pad]),
             slot_mapping=torch.cat([pages * PAGE + offset, pad + SCRATCH * PAGE]),
             kv_lens=torch.cat([positions + 1, pad + 1]).int(),
             last_page_len=torch.cat([offset + 1, pad + 1]).int(),
             tokens=torch.randint(0, 1000, (rows + padding,), generator=g))
    return {k: v.to(device) for k, v in f.items()}


@pytest.mark.parametrize("rows,padding", [(1, 0), (3, 1), (16, 0), (5, 11)])
def test_advance_matches_the_reference(kh, rows, padding):
    """Real rows take their token and move on by one; padding rows (the scratch page) stay."""
    got, want = _fields(kh.device, rows, padding, seed=rows), _fields(kh.device, rows, padding, seed=rows)
    before = {k: v.clone() for k, v in got.items()}
    advance_decode_inputs(*got.values(), SCRATCH, PAGE)
    advance_decode_inputs_reference(*want.values(), SCRATCH, PAGE)
    for name in got:
        assert torch.equal(got[name], want[name]), name
    assert torch.equal(got["input_ids"][:rows], before["tokens"][:rows])
    assert torch.equal(got["positions"][:rows], before["positions"][:rows] + 1)
    for name in ("input_ids", "positions", "slot_mapping", "kv_lens", "last_page_len"):
        assert torch.equal(got[name][rows:], before[name][rows:]), name


def test_advance_rejects_fields_of_other_lengths(kh):
    f = _fields(kh.device, 4, 0, seed=0)
    f["kv_lens"] = f["kv_lens"][:3]
    with pytest.raises(ValueError, match="rows differ"):
        advance_decode_inputs(*f.values(), SCRATCH, PAGE)
