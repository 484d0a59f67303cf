"""lab/ncu_step.py's reading of Nsight Compute's raw CSV (no GPU or ncu here: a report in the
shape `ncu --import R --csv --page raw` prints, with its units row and thousands separators)."""

import importlib.util
import io
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "lab" / "ncu_step.py"
spec = importlib.util.spec_from_file_location("ncu_step", SCRIPT)
ncu_step = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ncu_step)

STALL = "smsp__average_warps_issue_stalled_{}_per_issue_active.ratio"
HEADER = ['"ID"', '"Process ID"', '"Kernel Name"', '"dram__bytes_read.sum"', '"dram__bytes_write.sum"',
          '"gpu__time_duration.sum"', '"launch__grid_size"', '"launch__registers_per_thread"',
          f'"{STALL.format("long_scoreboard")}"', f'"{STALL.format("barrier")}"', f'"{STALL.format("wait")}"']
REPORT = "\n".join([
    "==PROF== Disconnected from process 123",
    ",".join(HEADER),
    '"","","","Mbyte","Kbyte","usecond","","","","",""',
    '"0","123","void kernel_cutlass_gemv<(int)1>(float *, int)","2.00","0.50","1.00","132","96","3.5","0.2","1.1"',
    '"1","123","_one_launch_kernel","1.50","4.00","2.50","128","128","9.0","2.5","0.4"',
    '"2","123","void kernel_cutlass_gemv<(int)1>(float *, int)","1,200.00","0","1,000.00","132","96","1.0","0","0"',
])


def test_summary_reads_units_separators_and_stalls():
    out = io.StringIO()
    kernels = ncu_step.summarize(REPORT.splitlines(), out)
    assert [k["name"] for k in kernels] == ["kernel_cutlass_gemv", "_one_launch_kernel", "kernel_cutlass_gemv"]
    assert kernels[0]["us"] == 1.0 and abs(kernels[0]["mb"] - 2.0005) < 1e-9  # Mbyte + Kbyte
    assert kernels[2]["us"] == 1000.0 and kernels[2]["mb"] == 1200.0  # "1,200.00"
    assert kernels[1]["stalls"][0] == ("long_scoreboard", 9.0) and [s for s, _ in kernels[1]["stalls"]] == [
        "long_scoreboard", "barrier", "wait"]
    text = out.getvalue()
    assert "3 kernels, 1003.5 us" in text
    family = next(line for line in text.splitlines() if line.startswith("kernel_cutlass_gemv") and "1001.0" in line)
    assert family.split()[1] == "2"  # two launches of the family


def test_a_report_without_kernels_says_so(capsys):
    assert ncu_step.main(["summarize", "/dev/null"]) == 1
    assert "no kernel rows" in capsys.readouterr().err


def test_source_summary_ranks_lines_by_stall_samples_or_shows_the_report():
    report = ['"Kernel Name","_one_launch_kernel"', '"#","Source","Warp Stall Sampling (All Samples)",'
              '"Warp Stall Sampling (Not-issued Samples)"',
              '"10","m_i = 0","5","4"', '"11","x = tl.load(p)","90","80"', '"12","tl.atomic_add(c, 1)","1,005","900"']
    out = io.StringIO()
    assert ncu_step.summarize_source(report, out=out)
    ranked = [line.split()[0] for line in out.getvalue().splitlines()[1:]]
    assert ranked == ["12", "11", "10"]  # by all samples, "1,005" read as 1005
    sass = ['"# Address","Source","Warp Stall Sampling (All Samples)"',
            '"00007f00","LDG.E.128 R4, desc[UR4][R2.64]","40"', '"00007f10","HMMA.16816.F32.BF16 R8, R4, R6, R8","3"']
    out = io.StringIO()
    assert ncu_step.summarize_source(sass, out=out)  # the SASS view: one row an instruction
    assert out.getvalue().splitlines()[1].split()[:2] == ["00007f00", "40"]
    assert "PDL wait" not in out.getvalue()  # no ACQBULK: not a PDL kernel
    out = io.StringIO()
    assert ncu_step.summarize_source(sass[:2] + ['"00007f08","ACQBULK","1"'] + sass[2:], out=out)
    assert out.getvalue().splitlines()[-1] == ("before the PDL wait (ACQBULK, instruction 1 of 3): "
                                               "40 of 44 samples (91%); after it 4")
    out = io.StringIO()  # 2026-12-05's CUDA view: lines with no sample columns
    assert not ncu_step.summarize_source(['"File Name","/x/decode_attention.py"', '"Line No","Source"',
                                          '"1","import triton"'], out=out)
    out = io.StringIO()
    assert not ncu_step.summarize_source(['"ID","Something else"', '"1","2"'], out=out)
    assert "first lines" in out.getvalue() and "Something else" in out.getvalue()
