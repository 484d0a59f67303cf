"""scripts/spec_bench.py on the CPU: its bench-only proposer proposes a known continuation with
each step's first corrupted token placed from evenly spread quantiles (so a run's acceptance is
the one asked), `own_continuation` finds the continuation the speculating engine reproduces, so
a timed run proposes along its whole length, and --grid runs the issue's grid within a budget."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from flashlet import LLM
from tests.conftest import load_script

NGRAM = {"method": "ngram", "num_speculative_tokens": 4}


class FakeRequest:
    def __init__(self, request_id, output_token_ids):
        self.request_id, self.output_token_ids = request_id, output_token_ids


def test_each_step_proposes_the_continuation_with_its_first_corrupted_token_placed():
    bench = load_script("spec_bench")
    continuation = list(range(2, 2002))
    proposer = bench.CorruptedCopyProposer(continuation, 0.7, vocab=5000, seed=4)
    again = bench.CorruptedCopyProposer(continuation, 0.7, vocab=5000, seed=4)
    for step in range(50):  # the k proposals, intact up to the step's first corrupted one
        done = continuation[: 10 + 3 * step]
        tokens = proposer.propose([FakeRequest(0, done)], 4)[0]
        assert tokens == again.propose([FakeRequest(0, done)], 4)[0]  # the same every round
        intact = proposer.intact_run(step, 4)
        truth = continuation[len(done): len(done) + 4]
        assert tokens[:intact] == truth[:intact] and tokens[intact + 1:] == truth[intact + 1:]
        assert intact == 4 or tokens[intact] != truth[intact]
    # P(at least j intact) = match^j over the steps, as independent corruption gives it
    runs = [proposer.intact_run(step, 4) for step in range(1000)]
    assert all(abs(sum(r >= j for r in runs) / 1000 - 0.7**j) < 0.01 for j in range(1, 5))
    assert all(0 <= t < 5000 for t in tokens)
    # nothing once the output parts from the continuation
    parted = continuation[:10] + [1]
    assert proposer.propose([FakeRequest(1, parted)], 4) == [[]]
    assert proposer.propose([FakeRequest(1, parted + continuation[11:13])], 4) == [[]]


def test_own_continuation_holds_and_the_timed_run_proposes_to_the_end(tiny_qwen2, monkeypatch):
    """A first guess that parts from the engine's output at token 10 (as a verify step's rounding
    parts a GPU run from the plain engine's): the fixed point replaces it with the engine's own
    continuation, which the next run reproduces, accepting every proposal at match 1.0."""
    bench = load_script("spec_bench")
    monkeypatch.setattr(bench, "NEW_TOKENS", 40)
    with LLM(model=str(tiny_qwen2), speculative_config=NGRAM) as llm:
        vocab = llm.engine.model_config.vocab_size
        prompt = [(i * 31 + 7) % vocab for i in range(12)]
        truth = bench.generate(llm, prompt)
        wrong = truth[:10] + [(t + 1) % vocab for t in truth[10:]]
        known, rounds, held = bench.own_continuation(llm, prompt, wrong, k=4, match=1.0)
        assert (known, held) == (truth, True) and rounds == 2
        assert bench.own_continuation(llm, prompt, wrong, k=4, match=1.0, max_rounds=1)[1:] == (1, False)
        llm.engine.spec.proposer = bench.CorruptedCopyProposer(known, 1.0, vocab, seed=4)
        before = bench.spec_counters(llm)
        _, tokens, steps = bench.timed_generate(llm, prompt)
        drafts, proposed, accepted = (b - a for a, b in zip(before, bench.spec_counters(llm)))
    assert tokens == known and accepted == proposed > 0
    assert steps <= -(-40 // 5) + 1  # five tokens a step, but the prompt's step


def test_own_continuation_holds_with_corrupted_proposals(tiny_qwen2, monkeypatch):
    match = 0.5
    bench = load_script("spec_bench")
    monkeypatch.setattr(bench, "NEW_TOKENS", 40)
    with LLM(model=str(tiny_qwen2), speculative_config=NGRAM) as llm:
        vocab = llm.engine.model_config.vocab_size
        prompt = [(i * 31 + 7) % vocab for i in range(12)]
        known, _, held = bench.own_continuation(llm, prompt, [], k=4, match=match)
        assert held
        llm.engine.spec.proposer = bench.CorruptedCopyProposer(known, match, vocab, seed=4)
        before = bench.spec_counters(llm)
        assert bench.generate(llm, prompt) == known
        drafts, proposed, accepted = (b - a for a, b in zip(before, bench.spec_counters(llm)))
    assert 0 < accepted < proposed


def test_the_table_prints_each_row_with_its_step_time_and_rounds(capsys):
    bench = load_script("spec_bench")
    row = {"k": 4, "asked": 0.7, "match": 0.7, "tok_s": 1000.0, "speedup": 0.5, "acceptance_rate": 0.7,
           "mean_accepted_length": 2.8, "steps": 64, "rounds": 3, "held": False,
           "fused_verify_share": 0.0, "same_tokens": False, "parted_at": 40}
    bench.print_table([{"config": "tiny", "ngram": [row],
                        "plain": {"tok_s": 2000.0, "steps": 256, "fused_decode": False}}])
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1].split() == ["tiny", "4", "0.70", "0.70", "0.70", "2.80", "1000", "0.50", "4.000",
                                 "0.00", "3", "(held:", "no)", "at", "40"]
    assert lines[-2].split()[8:10] == ["0.500", "(fused"]  # the plain row: 256 tokens / 2000 / 256 steps


def test_a_run_on_a_tiny_config_gives_a_row_per_k_and_match(tiny_qwen2, monkeypatch, capsys):
    """run_config end to end on the CPU (bf16, random weights of the tiny shape): every row's
    timed run reproduces the continuation it was proposed, all accepted at match 1.0."""
    bench = load_script("spec_bench")
    monkeypatch.setattr(bench, "NEW_TOKENS", 24)
    result = bench.run_config(str(tiny_qwen2 / "config.json"), [2, 4], [0.7, 1.0], None, repeats=3)
    assert [(r["k"], r["match"]) for r in result["ngram"]] == [(2, 0.7), (2, 1.0), (4, 0.7), (4, 1.0)]
    assert all(r["held"] and r["same_tokens"] for r in result["ngram"])
    assert all(r["acceptance_rate"] == 1.0 for r in result["ngram"] if r["match"] == 1.0)
    assert len(capsys.readouterr().out.splitlines()) == 1 + 4  # each row as it is measured
    bench.print_table([result])
    assert len(capsys.readouterr().out.splitlines()) == 3 + 4


def test_phases_time_each_part_of_the_timed_steps(tiny_qwen2, monkeypatch, capsys):
    """--phases: each row holds its timed call's host time a step by part (the speculating
    rows their proposer's and verification's too), and prints it under the row."""
    bench = load_script("spec_bench")
    monkeypatch.setattr(bench, "NEW_TOKENS", 12)
    result = bench.run_config(str(tiny_qwen2 / "config.json"), [2], [], None, phases=True,
                              acceptance=[1.0])  # (--acceptance 1.0: match 1.0)
    assert [r["match"] for r in result["ngram"]] == [1.0]
    plain, row = result["plain"]["host_us"], result["ngram"][0]["host_us"]
    assert {"step", "read", "schedule", "prepare", "load", "forward"} <= set(plain)
    assert {"step", "finish", "propose", "schedule", "prepare", "launched"} <= set(row)
    assert all(us > 0 for us in row.values()) and row["step"] > row["propose"]
    bench.print_table([result])
    assert sum("host us/step" in line for line in capsys.readouterr().out.splitlines()) == 2


def test_host_step_bench_stub_is_accepted_at_its_rate(tmp_path):
    """bench_host_step --spec K --stub-forward --accept R: the stub's text is proposed and
    accepted (about K + 1 tokens a step at R = 1, fewer at R = 0.5), and --phases times the
    speculating step's parts."""
    bench = load_script("bench_host_step")
    folder = bench.save_tiny_model("qwen2", tmp_path, num_hidden_layers=1, hidden_size=32,
                                   intermediate_size=32, num_attention_heads=2,
                                   num_key_value_heads=1,
                                   max_position_embeddings=100 + bench.new_tokens(3))
    per_step = {}
    for accept in (1.0, 0.5):
        engine = bench.decoding_engine(str(folder), 1, spec_k=3)
        bench.stub_forward(engine, accept)
        phases = bench.StepPhases(engine)
        (req,) = engine.scheduler.running
        before = len(req.output_token_ids)
        for _ in range(20):
            engine.step()
        per_step[accept] = (len(req.output_token_ids) - before) / 20
        assert {"finish", "propose", "schedule", "prepare", "load"} <= set(phases.per_step_us())
    assert per_step[1.0] > 3.5 and 1.2 < per_step[0.5] < per_step[1.0]


def test_host_step_bench_runs_the_fused_stub_as_a_gpu_plans_it():
    """bench_host_step --fused --stub-forward --spec 4 (its own process: the fused stub patches
    module state for good): the speculating steps run with the fused path's parts timed, the
    greedy tokens' plan among them, and more than one token a step is accepted at 0.7."""
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "scripts/bench_host_step.py", "--seqs", "1", "--stub-forward",
                          "--fused", "--spec", "4", "--accept", "0.7", "--phases", "--steps", "10",
                          "--rounds", "1"], cwd=root, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-2000:]
    tokens = re.search(r"seqs=1: .* ([0-9.]+) tokens a request a step", out.stdout)
    assert tokens and float(tokens.group(1)) > 1.2, out.stdout
    parts = re.search(r"host us a step: (.*)", out.stdout)
    assert parts and {"greedy_tokens", "load", "propose", "step - read"} <= {
        p.rsplit(" ", 1)[0] for p in parts.group(1).split(", ")}, out.stdout


def walk_acceptance(bench, proposer, continuation, k: int) -> float:
    """The acceptance a greedy engine whose output is `continuation` measures over it
    (NEW_TOKENS new tokens, the first one the prompt's): each step takes the proposals up to
    the room max_new_tokens leaves, accepts up to the first one off the continuation, and adds
    its own token."""
    at, proposed, accepted, new = 1, 0, 0, bench.NEW_TOKENS
    while at < new:
        tokens = proposer.propose([FakeRequest(0, continuation[:at])], k)[0][: new - at - 1]
        a = 0
        while a < len(tokens) and tokens[a] == continuation[at + a]:
            a += 1
        proposed, accepted, at = proposed + len(tokens), accepted + a, at + a + 1
    return accepted / proposed


def test_acceptance_picks_the_match_whose_copy_is_accepted_at_that_rate():
    """--acceptance A: the match solving expected_acceptance = A for each k; one run of the
    bench's length proposing the corrupted copy is accepted at A within 0.03 (random
    corruption read 0.58 at k = 4, A = 0.7, seed 4 on the H200)."""
    bench = load_script("spec_bench")
    continuation = list(range(3, 3 + bench.NEW_TOKENS))
    for k in (2, 4, 8):
        for asked in (0.5, 0.7, 0.9):
            match = bench.match_for_acceptance(asked, k)
            assert abs(bench.expected_acceptance(match, k) - asked) < 1e-6
            proposer = bench.CorruptedCopyProposer(continuation, match, vocab=30000, seed=k)
            measured = walk_acceptance(bench, proposer, continuation, k)
            assert abs(measured - asked) < 0.03, (k, asked, measured)
    assert bench.match_for_acceptance(1.0, 4) == 1.0
    assert round(bench.match_for_acceptance(0.7, 4), 2) == 0.86
    with pytest.raises(ValueError, match="--acceptance"):
        bench.match_for_acceptance(0.0, 4)


def test_the_engine_measures_the_acceptance_asked(tiny_qwen2, monkeypatch):
    """run_config --acceptance 0.7 on a tiny model: the engine's own counters read 0.7 within
    0.03 at k = 2, 4 and 8 (the rows hold their continuation, so proposals run to the end)."""
    bench = load_script("spec_bench")
    result = bench.run_config(str(tiny_qwen2 / "config.json"), [2, 4, 8], [], None,
                              acceptance=[0.7])
    assert [r["k"] for r in result["ngram"]] == [2, 4, 8]
    for row in result["ngram"]:
        assert row["held"] and row["same_tokens"], row
        assert abs(row["acceptance_rate"] - 0.7) < 0.03, (row["k"], row["acceptance_rate"])


def test_the_grid_runs_its_configs_in_order_and_skips_those_past_the_budget(monkeypatch, capsys,
                                                                           tmp_path):
    """--grid: each GRID config with its own k values and acceptance rates; a config after the
    first does not start once --budget-s has passed, and the table says so."""
    bench = load_script("spec_bench")
    ran = []

    def run_config(config, ks, matches, draft, max_rounds, phases, acceptance, repeats, engine_args):
        ran.append((config, ks, acceptance))
        row = {"k": ks[0], "asked": acceptance[0], "match": 0.9, "tok_s": 2.0, "speedup": 2.0,
               "acceptance_rate": acceptance[0], "mean_accepted_length": 2.0, "steps": 64,
               "rounds": 1, "held": True, "fused_verify_share": 1.0, "same_tokens": True,
               "parted_at": None}
        return {"config": config, "ngram": [row],
                "plain": {"tok_s": 1.0, "steps": 256, "fused_decode": True}}

    monkeypatch.setattr(bench, "run_config", run_config)
    monkeypatch.setattr(sys, "argv", ["spec_bench.py", "--grid"])
    assert bench.main() == 0
    assert ran == [(c, list(ks), list(a)) for c, ks, a in bench.GRID]
    ran.clear()
    out = tmp_path / "grid.json"
    monkeypatch.setattr(sys, "argv", ["spec_bench.py", "--grid", "--budget-s", "-1",
                                      "--json", str(out)])
    assert bench.main() == 0
    assert [c for c, _, _ in ran] == [bench.GRID[0][0]]
    assert ["skipped" in res for res in json.loads(out.read_text())] == [False, True]
    out = capsys.readouterr().out.splitlines()
    assert out[-1].startswith(f"{bench.GRID[1][0]:14} not run:")
