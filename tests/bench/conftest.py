"""Fixtures for the benchmark-harness tests: a tiny random-weight config file and a runner
that calls the CLI in-process and returns (exit code, stdout, stderr, JSON record)."""

import json

import pytest

TINY_CONFIG = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 256,
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-6, "rope_theta": 1e6, "tie_word_embeddings": True, "eos_token_id": 1,
}


@pytest.fixture(scope="session")
def tiny_config(tmp_path_factory):
    path = tmp_path_factory.mktemp("bench-config") / "tiny.json"
    path.write_text(json.dumps(TINY_CONFIG))
    return str(path)


@pytest.fixture
def run_bench(tmp_path, capsys):
    """run_bench(*argv) -> (stdout, stderr, record); the JSON goes to a fresh tmp file."""
    from flashlet.bench.cli import main

    def run(*argv, out=True):
        # CPU and fp32 on any machine (deterministic greedy agreement); a later --device wins.
        argv = ["--device", "cpu"] + [str(a) for a in argv] + ["--quiet"]
        path = tmp_path / "results.json"
        if out:
            argv += ["--out", str(path)]
        code = main(argv)
        captured = capsys.readouterr()
        assert code == 0, captured.err
        record = json.loads(path.read_text()) if out else None
        return captured.out, captured.err, record

    return run


@pytest.fixture
def no_model_load(monkeypatch):
    """Fail the test if anything builds an Engine or a model (bad input must stop earlier)."""
    from flashlet.models import weights
    from flashlet.bench import engines

    def boom(*a, **k):
        raise AssertionError("a model was loaded before the bad input was reported")

    monkeypatch.setattr(engines, "build_engine", boom)
    monkeypatch.setattr(weights, "random_model", boom)
    monkeypatch.setattr(weights, "load_model", boom)
    import flashlet.core.engine

    monkeypatch.setattr(flashlet.core.engine, "model_from", boom)
