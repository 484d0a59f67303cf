"""scripts/fidelity.py end to end on the CPU: a tiny Qwen3 config, the torch backend, fp32
against fp32 (exact agreement expected), results written as JSON."""

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "fidelity.py"
TINY = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 512,
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "rms_norm_eps": 1e-6,
        "rope_theta": 1e6, "max_position_embeddings": 512, "tie_word_embeddings": True}


def load_script():
    spec = importlib.util.spec_from_file_location("fidelity", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_fidelity_runs_end_to_end_on_a_tiny_config(tmp_path):
    config = tmp_path / "tiny.json"
    config.write_text(json.dumps(TINY))
    out = tmp_path / "fidelity.json"
    rc = load_script().main(["--config", str(config), "--device", "cpu", "--dtype", "float32",
                             "--backend", "torch", "--num-seqs", "2", "--seq-len", "128",
                             "--chunk", "48", "--json", str(out)])
    assert rc == 0
    (result,) = json.loads(out.read_text())
    assert result["positions"] == 256
    assert result["distinct_fp32_argmax"] > 50  # not a degenerate model
    torch_run = result["backends"]["torch"]
    assert torch_run["agreement"] == 1.0 and torch_run["disagreements"] == []
    assert torch_run["max_abs_logit_diff"] < 1e-4


def test_fewer_than_256_positions_is_refused():
    with pytest.raises(SystemExit):
        load_script().parse_args(["--num-seqs", "1", "--seq-len", "100"])
