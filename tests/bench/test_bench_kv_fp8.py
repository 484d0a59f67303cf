"""`python -m flashlet.bench ... --kv-cache-dtype fp8`: decode-sat runs over an fp8 KV pool and
the record says the cache's dtype and token capacity (issue 31's decode-sat comparison)."""

import pytest

from flashlet.bench.cli import main


def test_decode_sat_runs_over_an_fp8_cache_and_records_its_capacity(run_bench, tiny_config):
    runs = {}
    for kv in ("auto", "fp8"):
        _, _, rec = run_bench("--config", tiny_config, "--workload", "decode-sat",
                              "--decode-batch", 2, "--decode-prompt-len", 16,
                              "--decode-tokens", 4, "--max-num-pages", 16,
                              "--kv-cache-dtype", kv, "--no-warmup")
        runs[kv] = rec
    fp8 = runs["fp8"]["engine"]
    assert fp8["kv_cache_dtype"] == "fp8" and fp8["kv_tokens_total"] == 16 * 16
    assert "fp8" in runs["fp8"]["command"]
    assert runs["auto"]["engine"]["kv_cache_dtype"] == "auto"


def test_an_unknown_kv_cache_dtype_is_refused_before_any_model_loads(no_model_load, capsys,
                                                                     tiny_config):
    with pytest.raises(SystemExit) as exit_info:
        main(["--config", tiny_config, "--kv-cache-dtype", "int4"])
    assert exit_info.value.code == 2 and "'int4'" in capsys.readouterr().err
