"""scripts/gpu_run.sh, read without a GPU: it parses, its header lists exactly the parts its
case statement runs (the header is the only place a reader learns what a part measures), and
its PYTHONPATH helper takes the pinned Triton off the arms that compare against it."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_run.sh"


def _parts() -> tuple[set[str], set[str]]:
    """(parts the header lists, parts the case statement has an arm for)."""
    text = SCRIPT.read_text()
    header = text.split("\nset -uo pipefail")[0]
    listed = set(re.findall(r"^#   ([a-z0-9][a-z0-9-]*)\s", header, re.M)) - {"bash"}  # `#   bash scripts/...`: usage
    arms = {name for arm in re.findall(r"^    ([a-z0-9|-]+)\)", text, re.M) for name in arm.split("|")}
    return listed, arms


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash on this machine")
def test_gpu_run_parses():
    proc = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_every_part_is_in_the_header_and_has_an_arm():
    listed, arms = _parts()
    assert "setup" in arms and "triton-pin-ab" in arms  # the reader found the case statement
    assert arms - listed == set(), "parts the header does not describe"
    assert listed - arms == {"all"}, "parts the header lists that nothing runs"


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash on this machine")
@pytest.mark.parametrize("path,want", [
    ("/tmp/cute/4.8.1/dsl:/tmp/cute/4.8.1:/tmp/triton-pin/3.7.1:.::/tmp/site",
     "/tmp/cute/4.8.1/dsl:/tmp/cute/4.8.1:.::/tmp/site"),
    ("/tmp/triton-pin/3.7.1:.::/tmp/site", ".::/tmp/site"),
    (".::/tmp/site:/tmp/triton-pin/3.7.1", ".::/tmp/site"),
    (".::/tmp/site", ".::/tmp/site"),  # no pin: unchanged
    ("/tmp/triton-pin/3.7.1x:.", "/tmp/triton-pin/3.7.1x:."),  # only the whole entry goes
], ids=["behind-the-dsl", "first", "last", "absent", "a-longer-name"])
def test_without_pin_drops_only_the_pinned_tritons_entry(path, want):
    """triton-pin-ab's 3.6 arm runs with `without_pin`'s PYTHONPATH: the pinned Triton's entry
    gone wherever the call put it (first, or behind the CuTe DSL's roots), nothing else touched."""
    text = SCRIPT.read_text()
    func = re.search(r"^without_pin\(\) \{.*?^\}", text, re.M | re.S)[0]
    script = f'{func}\nPIN_TRITON=/tmp/triton-pin/3.7.1\nPYTHONPATH="$1"\nwithout_pin'
    proc = subprocess.run(["bash", "-c", script, "bash", path], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == want


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash on this machine")
def test_with_pin_puts_the_pinned_triton_first_once():
    """The pinned arms (triton-pin, triton-pin-ab, attn-pdl-ab) run with `with_pin`'s PYTHONPATH:
    the pinned Triton first, the rest as `without_pin` leaves it (f76f346's with_pin called
    itself: a recursion that never returned)."""
    text = SCRIPT.read_text()
    without = re.search(r"^without_pin\(\) \{.*?^\}", text, re.M | re.S)[0]
    with_ = re.search(r"^with_pin\(\) \{.*$", text, re.M)[0]  # one line
    script = f'{without}\n{with_}\nPIN_TRITON=/tmp/triton-pin/3.7.1\nPYTHONPATH="$1"\nwith_pin'
    path = "/tmp/cute/4.8.1/dsl:/tmp/cute/4.8.1:/tmp/triton-pin/3.7.1:.::/tmp/site"
    # In a process group of its own: were with_pin to call itself again, its chain of subshells
    # would outlive a plain timeout's kill of the first one (it did, once, eating the memory).
    proc = subprocess.Popen(["bash", "-c", script, "bash", path], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise AssertionError("with_pin did not return within 30 s") from None
    assert proc.returncode == 0, err
    assert out.strip() == "/tmp/triton-pin/3.7.1:/tmp/cute/4.8.1/dsl:/tmp/cute/4.8.1:.::/tmp/site"


def test_tests_one_row_names_every_fused_preset_of_the_gpu_test():
    """`tests-one-row` lists the preset cases by node id (pytest's -k cannot pick a batch id):
    exactly the GPU test's FUSED_PRESETS, so a preset the path comes to serve is not left out."""
    from tests.gpu.test_gpu_fused_decode import FUSED_PRESETS

    arm = re.search(r"^    tests-one-row\).*?;;", SCRIPT.read_text(), re.M | re.S)[0]
    named = re.search(r"for p in ([^;]+);", arm)[1].split()
    assert named == list(FUSED_PRESETS)
