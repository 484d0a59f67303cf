"""The fused greedy graph's input advance (kernels/step_advance.py): the kernel (the interpreter
on the CPU, the GPU where there is one) and the host form the CPU's stand-in graphs run, each
against a loop over the rows."""

from __future__ import annotations

import pytest
import torch

from flashlet.kernels.step_advance import advance_decode_inputs, advance_decode_inputs_host

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


def _expected(f: dict[str, torch.Tensor]) -> dict[str, list[int]]:
    """The advance, row by row."""
    out = {name: t.tolist() for name, t in f.items()}
    for i, slot in enumerate(out["slot_mapping"]):
        if slot // PAGE != SCRATCH:
            out["input_ids"][i] = out["tokens"][i]
            for name in ("positions", "slot_mapping", "kv_lens", "last_page_len"):
                out[name][i] += 1
    return out


@pytest.mark.parametrize("host", [False, True])
@pytest.mark.parametrize("rows,padding", [(1, 0), (3, 1), (16, 0), (5, 11)])
def test_advance_moves_real_rows_on_and_leaves_padding(kh, rows, padding, host):
    """Real rows take their token and move on by one; padding rows (the scratch page) stay."""
    if host and kh.device != "cpu":
        pytest.skip("the host form takes CPU tensors")
    f = _fields(kh.device, rows, padding, seed=rows)
    want = _expected(f)
    (advance_decode_inputs_host if host else advance_decode_inputs)(*f.values(), SCRATCH, PAGE)
    assert {name: t.tolist() for name, t in f.items()} == want
    assert f["positions"][rows:].tolist() == [0] * padding


def test_advance_rejects_fields_of_other_lengths(kh):
    f = _fields(kh.device, 4, 0, seed=0)
    f["kv_lens"] = f["kv_lens"][:3]
    with pytest.raises(ValueError, match="rows differ"):
        advance_decode_inputs(*f.values(), SCRATCH, PAGE)
