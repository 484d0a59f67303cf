"""lab/counter_probe.py in the interpreter: its rounds with one program (their spins need every
program resident, which only a GPU gives), each round's store, release, acquire spin and load
folded; its chain of stage launches; its prediction; and both kernels lowered for sm_90a."""

import importlib.util
import pathlib

import pytest
import torch


def probe():
    path = pathlib.Path(__file__).resolve().parents[1] / "lab" / "counter_probe.py"
    spec = importlib.util.spec_from_file_location("counter_probe", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("payload", [0, 5, 16])
def test_one_program_passes_every_round_and_reads_back_its_stores(payload):
    rounds = 3
    out = probe().run(programs=1, rounds=rounds, payload=payload, device="cpu")
    # each round folds the sum of the vector it stored (payload copies of its value) into it
    want = (1 + payload * 1e-6) ** rounds
    assert torch.allclose(out[0], torch.full_like(out[0], want), rtol=1e-6)


def test_each_launch_reads_the_vector_the_launch_before_it_wrote():
    programs, payload = 2, 16  # a slice of 8 a program
    got = probe().launches(programs, count=3, payload=payload, device="cpu", pdl_on=False)
    vec = torch.zeros(payload)
    for _ in range(3):
        total = float(vec.sum())
        vec = torch.tensor([total * 1e-6 + pid + 1 for pid in range(programs) for _ in range(8)])
    torch.testing.assert_close(got, vec)


def test_the_prediction_at_a_measured_boundary_slows_as_the_boundary_grows():
    fast, slow = (probe().predict("qwen2.5-0.5b", us, num_sms=132) for us in (0.5, 3.0))
    assert fast["share_of_h200_limit"] > slow["share_of_h200_limit"]
    assert abs(fast["tok_s"] - 1e6 / fast["step_us"]) <= 1
    # 24 layers x 5 boundaries x 3 us: the chain alone is 360 us, over the 0.5B's ~236 us of bytes
    assert slow["step_us"] > 24 * 5 * 3.0


def test_the_probe_lowers_to_one_release_add_and_an_acquire_spin_for_sm90():
    # compiled in a child: this process interprets its kernels (conftest sets TRITON_INTERPRET)
    import json
    import os
    import subprocess
    import sys

    root = pathlib.Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(root)
    out = subprocess.run([sys.executable, str(root / "lab" / "counter_probe.py"), "--lower", "--payload", "0", "896"],
                         capture_output=True, text=True, env=env, timeout=300, check=True).stdout
    lines = [json.loads(line) for line in out.splitlines()]
    for line in lines:
        assert line["atom.global.gpu.release.add"] == 1
        assert line["ld.global.gpu.acquire"] >= 1
        assert line["griddepcontrol.wait"] == 1 and line["griddepcontrol.launch_dependents"] == 1  # the PDL stage
    assert lines[0]["ld.global.cg"] == 0 and lines[1]["ld.global.cg"] > 0  # the vector read past L1
