"""scripts/fused_decode_bench.py --streams on the CPU: N streams through one LLM.generate call
each, first call and a second with fresh prompts, then a one-token call the decode rate is
taken against, on a tiny model (the GPU figures come from the same function on the H200)."""

import flashlet
from tests.conftest import load_script


def test_streams_time_every_count_twice_and_the_table_rates_them_against_one(tiny_qwen2, monkeypatch):
    bench = load_script("fused_decode_bench")
    real = flashlet.LLM
    made = []

    def tiny_llm(config, backend, dtype, max_num_pages, **kw):
        made.append(real(str(tiny_qwen2), backend="torch", dtype="float32", max_num_pages=128, **kw))
        return made[-1]

    monkeypatch.setattr(flashlet, "LLM", tiny_llm)
    res = bench.streams_in_this_process("tiny", [], [1, 3], 6, prompt_len=20)
    assert set(res["streams"]) == {"1", "3"} and res["prompt_len"] == 20
    for row in res["streams"].values():
        assert row["first_per_stream_tok_s"] > 0 and row["second_per_stream_tok_s"] > 0
        assert row["decode_tok_s"] > 0
    assert len(made) == 1  # one engine for every N: each count after the first is a warm engine

    lines = bench.streams_table({"default": res}, [1, 3], 6)
    rows = [ln.split() for ln in lines[2:]]
    assert [r[1] for r in rows] == ["1", "3"]
    assert "20-token prompts" in lines[0]
    assert float(rows[0][-2]) == 1.0  # N = 1 against itself
    second_1, second_3 = (res["streams"][n]["second_per_stream_tok_s"] for n in ("1", "3"))
    assert float(rows[1][-2]) == round(second_3 / second_1, 2)
    assert float(rows[1][-1]) == round(res["streams"]["3"]["decode_tok_s"], 1)
