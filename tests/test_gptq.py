"""GPTQ rounding into per-row fp8 (`flashlet/models/gptq.py`) and the checkpoint that
`python -m flashlet.quantize` writes: the rounding against a slow column-by-column reference,
the written folder loading back to the very logits of the in-memory rounded model, GPTQ's
output error below round-to-nearest's on the calibration inputs, and the CLI's bad input."""

import shutil

import pytest
import torch

from flashlet import quantize
from flashlet.config import EngineConfig
from flashlet.core.engine import Engine
from flashlet.models.gptq import (DenseAttention, HessianOps, calibration_sequences, gptq_model,
                                  gptq_rows, gptq_rows_searched, scale_fractions)
from flashlet.models.quantization import (FP8, FP8_MAX, QUANTIZED_PROJECTIONS, QuantizedWeight,
                                          is_quantized, quantize_rows)
from flashlet.models.weights import load_model, save_fp8_checkpoint
from tests.conftest import TINY_DIMS


def gptq_reference(w, hessian, damp=0.01):
    """GPTQ without its tricks: act-order, then one column at a time in fp64, each rounding
    error spread over the remaining columns by the inverse Hessian, which then drops that
    column (the OBS update; no Cholesky, no blocks)."""
    w = w.double().clone()
    scale = (w.abs().amax(dim=1) / FP8_MAX).float()
    perm = torch.argsort(hessian.double().diagonal(), descending=True)
    h = hessian.double()[perm][:, perm]
    h += damp * h.diagonal().mean() * torch.eye(len(h), dtype=h.dtype)
    hinv, w = torch.linalg.inv(h), w[:, perm]
    codes = torch.empty_like(w)
    for j in range(w.shape[1]):
        codes[:, j] = (w[:, j] / scale).float().clamp(-FP8_MAX, FP8_MAX).to(FP8).double()
        err = (w[:, j] - codes[:, j] * scale) / hinv[j, j]
        w[:, j + 1:] -= err[:, None] * hinv[j, j + 1:]
        hinv = hinv - hinv[:, j:j + 1] * hinv[j:j + 1, :] / hinv[j, j]
    return codes[:, torch.argsort(perm)].float(), scale


def correlated_inputs(rows, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, k, generator=g) @ torch.randn(k, k, generator=g) / k ** 0.5


def test_gptq_rows_picks_the_codes_of_the_column_by_column_reference():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(12, 40, generator=g) * 0.05
    x = correlated_inputs(256, 40)
    h = x.T @ x / len(x)
    codes, scale = gptq_rows(w, h, block=16)  # blocks that do not divide the 40 columns
    ref_codes, ref_scale = gptq_reference(w, h)
    assert torch.equal(scale, ref_scale)
    assert torch.equal(codes.float(), ref_codes)
    assert not torch.equal(codes, quantize_rows(w)[0])  # not round-to-nearest


def test_gptq_codes_are_finite_e4m3_that_requantize_to_themselves():
    g = torch.Generator().manual_seed(2)
    w = torch.randn(16, 64, generator=g)
    w[3] = 0  # an all-zero row keeps the smallest scale
    x = correlated_inputs(128, 64)
    x[:, 5] = 0  # an input that never fires
    codes, scale = gptq_rows(w, x.T @ x)
    assert codes.dtype == FP8 and scale.dtype == torch.float32
    values = codes.float()
    assert torch.isfinite(values).all() and values.abs().max() <= FP8_MAX
    requantized = (values * scale[:, None] / scale[:, None]).to(FP8)
    assert torch.equal(requantized.view(torch.uint8), codes.view(torch.uint8))
    assert (values[3] == 0).all() and (values[:, 5] == 0).all()
    QuantizedWeight(codes, scale)  # the engine's holder takes them as they are


def row_errors(codes, scale, w, h):
    """Each row's output error on the calibration inputs, e^T H e."""
    e = codes.float() * scale[:, None] - w
    return ((e @ h) * e).sum(dim=1)


def test_scale_search_keeps_each_row_at_or_below_plain_gptqs_error():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(48, 64, generator=g) * 0.05
    w[5] = 0  # an all-zero row: every candidate the same
    x = correlated_inputs(256, 64, seed=3)
    h = x.T @ x / len(x)
    plain_codes, plain_scale = gptq_rows(w, h)
    one = gptq_rows_searched(w, h, candidates=1)  # one candidate: plain GPTQ itself
    assert torch.equal(one[0].view(torch.uint8), plain_codes.view(torch.uint8))
    assert torch.equal(one[1], plain_scale)
    codes, scale = gptq_rows_searched(w, h, candidates=8)
    ours, plain = row_errors(codes, scale, w, h), row_errors(plain_codes, plain_scale, w, h)
    assert (ours <= plain).all() and ours.sum() < 0.95 * plain.sum()
    assert not torch.equal(scale, plain_scale)  # some row took another scale
    # each scale is one of the candidates, none clipping the row's largest entry
    ratio = (w.abs().amax(dim=1) / scale / FP8_MAX)[w.abs().amax(dim=1) > 0]
    fracs = torch.tensor(scale_fractions(8))
    assert ((ratio[:, None] - fracs).abs().min(dim=1).values < 1e-5).all()
    assert codes.dtype == FP8 and (codes.float().abs() <= FP8_MAX).all()
    QuantizedWeight(codes, scale)


def test_scale_fractions_span_one_binade():
    fracs = scale_fractions(8)
    assert fracs[0] == 1 and len(fracs) == 8 and min(fracs) > 0.5
    assert fracs == sorted(fracs, reverse=True)


def random_seqs(n=3, length=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, TINY_DIMS["vocab_size"], (length,), generator=g).tolist()
            for _ in range(n)]


@torch.inference_mode()
def logits_of(model, seq):
    ids = torch.tensor(seq)
    return model.compute_logits(model(ids, torch.arange(len(ids)), DenseAttention()))


def test_written_checkpoint_loads_to_the_logits_of_the_rounded_model(tiny_model, tmp_path):
    source = tmp_path / "source"
    shutil.copytree(tiny_model, source)
    (source / "generation_config.json").write_text("{}")  # another file: copied as it is
    (source / ".converted").write_text("")  # a hidden marker: not
    model, _, _ = load_model(source)
    gptq_model(model, random_seqs())
    out = tmp_path / "out"
    save_fp8_checkpoint(model, source, out)
    assert sorted(f.name for f in out.iterdir()) == [
        "config.json", "generation_config.json", "model.safetensors"]
    loaded, _, _ = load_model(out)  # no quantization asked: the checkpoint says it
    for ours, theirs in zip(model.layers, loaded.layers):
        for p in QUANTIZED_PROJECTIONS:
            a, b = getattr(ours, p).weight, getattr(theirs, p).weight
            assert isinstance(b, QuantizedWeight)
            assert torch.equal(a.qweight.view(torch.uint8), b.qweight.view(torch.uint8))
            assert torch.equal(a.scale, b.scale)
    for seq in random_seqs(2, 30, seed=5):
        assert torch.equal(logits_of(loaded, seq), logits_of(model, seq))
    engine = Engine(EngineConfig(model=str(out), max_num_pages=16))
    assert is_quantized(engine.model)


def test_gptq_keeps_the_calibration_outputs_closer_than_round_to_nearest(tiny_qwen2):
    float_model, _, _ = load_model(tiny_qwen2)
    seqs = random_seqs(4, 64)
    weights = {f"{i}.{p}": getattr(layer, p).weight for i, layer in enumerate(float_model.layers)
               for p in QUANTIZED_PROJECTIONS}
    float_model.ops = HessianOps(weights)  # every layer's inputs as calibration sees them
    for seq in seqs:
        logits_of(float_model, seq)
    model, _, _ = load_model(tiny_qwen2)
    gptq_model(model, seqs)
    for name, w in weights.items():
        i, p = name.split(".")
        h = float_model.ops.hessian(name)
        ours = getattr(model.layers[int(i)], p).weight.dequantize() - w
        q, s = quantize_rows(w)
        nearest = q.float() * s[:, None] - w
        # mean |X dW^T|^2 over the calibration rows = trace(dW H dW^T)
        assert torch.trace(ours @ h @ ours.T) < 0.9 * torch.trace(nearest @ h @ nearest.T), name


def test_gptq_refuses_a_quantized_model_and_empty_calibration(tiny_qwen2):
    model, _, _ = load_model(tiny_qwen2, quantization="fp8")
    with pytest.raises(ValueError, match="already quantized"):
        gptq_model(model, random_seqs())
    with pytest.raises(ValueError, match="calibration sequence"):
        gptq_model(load_model(tiny_qwen2)[0], [])


def test_calibration_sequences_cut_the_stream():
    assert calibration_sequences(list(range(5)), 2) == [[0, 1], [2, 3], [4]]


def word_tokenizer(folder, vocab_size):
    """A whitespace word-level tokenizer saved into a model folder: "w{i}" is token i."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab_size)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(folder)


def test_cli_writes_a_checkpoint_the_engine_loads_with_the_tokenizer(tiny_llama, tmp_path, capsys):
    source = tmp_path / "source"
    shutil.copytree(tiny_llama, source)
    word_tokenizer(source, TINY_DIMS["vocab_size"])
    text = tmp_path / "calib.txt"
    text.write_text(" ".join(f"w{t}" for t in random_seqs(1, 300)[0]))
    out = tmp_path / "out"
    quantize.main(["--model", str(source), "--out", str(out), "--calib-text", str(text),
                   "--calib-tokens", "200", "--seq-len", "64"])
    assert "GPTQ on 200 calibration tokens" in capsys.readouterr().out
    assert (out / "tokenizer.json").exists() and (out / "tokenizer_config.json").exists()
    engine = Engine(EngineConfig(model=str(out), max_num_pages=16))
    assert is_quantized(engine.model) and engine.encode("w3 w4") == [3, 4]


@pytest.mark.parametrize("flags, message", [
    (["--calib-text", "/nonexistent/calib.txt"], "--calib-text: no such file"),
    (["--calib-tokens", "0"], "--calib-tokens must be at least 1"),
    (["--damp", "0"], "--damp must be in"),
    (["--scale-candidates", "0"], "--scale-candidates must be at least 1"),
    ([], "the following arguments are required: --calib-text"),
    (["--device", "tpu:x"], "--device 'tpu:x'"),
], ids=["missing-text", "no-tokens", "no-damping", "no-scales", "no-text-given", "bad-device"])
def test_cli_bad_input_is_one_line_before_the_model_loads(tmp_path, capsys, flags, message):
    text = tmp_path / "calib.txt"
    text.write_text("some calibration words")
    given = ["--calib-text", str(text)] if flags and flags[0] != "--calib-text" else []
    with pytest.raises(SystemExit) as exit_info:
        quantize.main(["--model", str(tmp_path / "no-model"), "--out", str(tmp_path / "o"), *given, *flags])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_cli_refuses_an_out_folder_with_files(tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "x").write_text("keep me")
    (tmp_path / "calib.txt").write_text("some calibration words")
    with pytest.raises(SystemExit) as exit_info:
        quantize.main(["--model", str(tmp_path / "no-model"), "--out", str(out),
                       "--calib-text", str(tmp_path / "calib.txt")])
    assert exit_info.value.code == 2 and "exists and is not an empty folder" in capsys.readouterr().err
    assert (out / "x").read_text() == "keep me"


def test_saving_over_a_folder_with_files_is_refused(tiny_qwen2, tmp_path):
    model, _, _ = load_model(tiny_qwen2, quantization="fp8")
    (tmp_path / "x").write_text("")
    with pytest.raises(FileExistsError):
        save_fp8_checkpoint(model, tiny_qwen2, tmp_path)
