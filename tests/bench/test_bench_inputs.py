"""Bad input to `python -m flashlet.bench` is refused with a message on stderr and exit code 2
before any model is loaded; plus the --url client against a fake streaming server, and the
building blocks (request specs, statistics, tables)."""

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from flashlet.bench.cli import main


def closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


BAD = [
    (["--backend", "nope"], "invalid choice: 'nope'"),
    (["--config", "{tiny}", "--backend", "torch", "nope"], "invalid choice: 'nope'"),
    (["--config", "{tiny}", "--backend", "torch", "triton", "torch"],
     "--backend names torch more than once"),
    (["--config", "{tiny}", "--backend", "torch", "flashinfer", "--device", "cpu"],
     "backend 'flashinfer' is not available on cpu"),
    (["--workload", "scheduler", "--backend", "torch", "triton"],
     "several --backend names apply only to the in-process closed-loop"),
    (["--url", "http://127.0.0.1:1", "--backend", "torch", "triton"], "workloads, not --url"),
    (["--workload", "nope"], "invalid choice: 'nope'"),
    (["--config", "no-such-preset"], "unknown config 'no-such-preset'"),
    (["--config", "{tiny}", "--backend", "flashinfer", "--device", "cpu"], "needs a CUDA device"),
    (["--config", "{tiny}", "--concurrency", "0"], "--concurrency levels must be >= 1"),
    (["--config", "{tiny}", "--concurrency", "4", "4"], "must be distinct"),
    (["--config", "{tiny}", "--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
    (["--config", "{tiny}", "--num-requests", "2", "--concurrency", "4"], "--num-requests (2)"),
    (["--config", "{tiny}", "--requests-per-stream", "0"], "--requests-per-stream and --min-requests"),
    (["--config", "{tiny}", "--prompt-len-range", "50", "10"], "1 <= LO <= HI"),
    (["--config", "{tiny}", "--max-num-pages", "2"], "KV pool too small: one request"),
    (["--config", "qwen2.5-0.5b", "--max-num-pages", "8"], "KV pool too small: one request"),
    (["--config", "{tiny}", "--max-num-pages", "60", "--concurrency", "1", "8",
      "--prompt-len-range", "32", "100"], "KV pool too small for 8 concurrent"),
    (["--config", "{tiny}", "--workload", "decode-sat", "--max-num-pages", "100"],
     "KV pool too small for 128 concurrent"),
    (["--config", "{tiny}", "--prompt-len-range", "32", "1020"], "exceeds the model's context"),
    (["--config", "{tiny}", "--concurrency", "300"], "exceed --max-num-seqs 256"),
    (["--config", "{tiny}", "--model", "x"], "not both"),
    (["--model", "/no/such/folder"], "model:"),
    (["--config", "{tiny}", "--dtype", "int3"], "unknown dtype"),
    (["--config", "{tiny}", "--rate", "2"], "--rate (open-loop Poisson arrivals) needs --url"),
    (["--workload", "scheduler", "--peer", "hf"], "--peer applies to"),
    (["--workload", "scheduler", "--sched-prefill-chunks", "300"], "--sched-prefill-chunks"),
    (["--workload", "single", "--config", "{tiny}", "--single-tokens", "1"], "--single-tokens must be >= 2"),
    (["--url", "http://127.0.0.1:{port}"], "cannot connect to the server"),
    (["--url", "ftp://x"], "must start with http://"),
    (["--url", "http://127.0.0.1:1", "--workload", "offline"], "--url runs the closed-loop"),
    (["--url", "http://127.0.0.1:1", "--workload", "long-prompt-gaps", "--rate", "2"],
     "long-prompt-gaps sends its own arrivals"),
    (["--url", "http://127.0.0.1:1", "--workload", "long-prompt-gaps", "--gap-streams", "0"],
     "--gap-streams must be >= 1"),
    (["--url", "http://127.0.0.1:1", "--client-procs", "0"], "--client-procs must be >= 1"),
    (["--config", "{tiny}", "--client-procs", "2"], "--client-procs applies to --url only"),
    (["--peer", "vllm"], "invalid choice: 'vllm'"),
    (["--config", "{tiny}", "--device", "tpu9"], "is not a device"),
    (["--config", "{tiny}", "--workload", "single", "--single-tokens", "0"], "--single-tokens must be >= 1"),
    (["--config", "{tiny}", "--page-size", "3"], "page_size must be a power of two"),
    (["--workload", "kernels", "--device", "cpu"], "pass --kernels-smoke"),
    (["--workload", "kernels", "--config", "no-such-preset", "--kernels-smoke", "--device", "cpu"],
     "unknown config"),
]


@pytest.mark.parametrize("argv,message", BAD, ids=[" ".join(a)[:60] for a, _ in BAD])
def test_bad_input_exits_before_work(argv, message, tiny_config, no_model_load, capsys):
    argv = [a.replace("{tiny}", tiny_config).replace("{port}", str(closed_port())) for a in argv]
    with pytest.raises(SystemExit) as exc:
        main(argv + ["--quiet"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err, err
    assert "usage:" in err  # argparse's error format: usage line, then the message


def test_closed_loop_levels_take_requests_per_stream_times_their_concurrency(tiny_config, no_model_load):
    """A level sends max(--requests-per-stream x concurrency, --min-requests) requests unless
    --num-requests says how many."""
    from flashlet.bench.cli import build_parser, resolve

    parser = build_parser()
    for extra, want in (([], [8, 8, 32]), (["--requests-per-stream", "16"], [16, 64, 256]),
                        (["--requests-per-stream", "16", "--min-requests", "64"], [64, 64, 256]),
                        (["--num-requests", "40"], [40, 40, 40])):
        args = parser.parse_args(["--config", tiny_config, "--concurrency", "1", "4", "16", *extra])
        resolve(parser, args)
        assert args.level_requests == want, extra


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA message; CUDA is present")
def test_cuda_device_without_cuda(tiny_config, no_model_load, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--config", tiny_config, "--device", "cuda", "--quiet"])
    assert exc.value.code == 2
    assert "CUDA is not available" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU message; CUDA is present")
def test_triton_on_cpu_needs_the_interpreter(tiny_config, no_model_load, monkeypatch, capsys):
    """Every --backend name is checked up front, not only the first."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(SystemExit) as exc:
        main(["--config", tiny_config, "--device", "cpu", "--backend", "torch", "triton",
              "--quiet"])
    assert exc.value.code == 2
    assert "the triton backend needs a CUDA device" in capsys.readouterr().err


def test_kernels_absent_is_a_clear_error(monkeypatch, capsys):
    import sys

    monkeypatch.setitem(sys.modules, "flashlet.kernels.bench", None)  # as if the file were absent
    with pytest.raises(SystemExit) as exc:
        main(["--workload", "kernels", "--quiet"])
    assert exc.value.code == 2
    assert "run_kernel_sweep" in capsys.readouterr().err


def test_unwritable_out_is_refused_up_front(tiny_config, tmp_path, no_model_load, capsys):
    folder = tmp_path / "dir"
    folder.mkdir()
    with pytest.raises(SystemExit):
        main(["--config", tiny_config, "--out", str(folder), "--quiet"])
    assert "is a directory" in capsys.readouterr().err


# ---- --url against a fake server ---------------------------------------------------------
class FakeServer(BaseHTTPRequestHandler):
    """POST /generate_stream: one SSE event per token, a final event with usage, [DONE]."""

    seen = []

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        FakeServer.seen.append((self.path, body))
        if self.path != "/generate_stream":
            self.send_response(404)
            self.end_headers()
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        n = body["max_new_tokens"]
        for i in range(n):
            self.wfile.write(f"data: {json.dumps({'text': f' w{i}'})}\n\n".encode())
            self.wfile.flush()
            time.sleep(0.002)
        final = {"text": "", "finish_reason": "length",
                 "usage": {"prompt_tokens": len(body["prompt"].split()), "completion_tokens": n}}
        self.wfile.write(f"data: {json.dumps(final)}\n\ndata: [DONE]\n\n".encode())

    def log_message(self, *args):
        pass


@pytest.fixture
def fake_server():
    FakeServer.seen = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeServer)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_url_closed_loop(run_bench, fake_server, tmp_path):
    out, _, rec = run_bench("--url", fake_server, "--concurrency", 1, 3, "--num-requests", 6,
                            "--prompt-len-range", 5, 20, "--max-new-tokens", 4,
                            "--plot", tmp_path / "p")
    assert rec["workload"] == "url" and rec["url"] == fake_server
    assert "model" not in rec  # nothing was loaded locally
    for lv in rec["results"]["levels"]:
        assert lv["completed"] == 6 and lv["failed"] == 0
        assert lv["output_tokens"] == lv["output_tokens_requested"] == 24
        assert lv["ttft_ms"]["n"] == 6 and lv["itl_ms"]["n"] == 6 * 3
        assert lv["ttft_ms"]["min"] > 0 and lv["output_tok_s"] > 0
        cpu = lv["machine_cpu"]  # None where the level took no tick of CPU time, or not Linux
        assert cpu is None or (0 <= cpu["busy"] <= 1 and 0 <= cpu["steal"] <= 1)
    assert len(FakeServer.seen) == 12
    path, body = FakeServer.seen[0]
    assert set(body) == {"prompt", "max_new_tokens", "temperature", "ignore_eos"}
    assert body["ignore_eos"] is True
    assert body["temperature"] == 0 and body["max_new_tokens"] == 4
    assert 5 <= len(body["prompt"].split()) <= 20
    assert "| concurrency | engine |" in out and "server" in out
    assert len(rec["plots"]) == 4


def test_url_open_loop(run_bench, fake_server):
    out, _, rec = run_bench("--url", fake_server, "--rate", 50, "--num-requests", 5,
                            "--prompt-len-range", 5, 10, "--max-new-tokens", 3)
    r = rec["results"]
    assert r["mode"] == "open-loop" and r["rate"] == 50
    assert r["completed"] == 5 and r["output_tokens"] == 15 and r["failed"] == 0
    assert "open-loop" in out


def test_url_counts_failures(run_bench, fake_server, monkeypatch):
    """A server error is counted as a failed request, not a crash."""
    monkeypatch.setattr(FakeServer, "do_POST", lambda self: (self.send_response(500),
                                                             self.end_headers()))
    _, _, rec = run_bench("--url", fake_server, "--concurrency", 2, "--num-requests", 2,
                          "--prompt-len-range", 3, 3, "--max-new-tokens", 2)
    lv = rec["results"]["levels"][0]
    assert lv["failed"] == 2 and lv["completed"] == 0 and "HTTP 500" in lv["errors"][0]


# ---- building blocks -----------------------------------------------------------------------
def test_machine_cpu_shares_from_proc_stat(tmp_path, monkeypatch):
    """/proc/stat's cpu line -> busy and stolen shares of all CPUs' time between two readings;
    no file (not Linux) or no time between them -> None."""
    from flashlet.bench import common

    stat = tmp_path / "stat"
    monkeypatch.setattr(common, "PROC_STAT", str(stat))
    stat.write_text("cpu  100 0 50 800 10 0 0 40 0 0\ncpu0 1 2 3\n")
    before = common.machine_cpu()
    assert before == (100, 0, 50, 800, 10, 0, 0, 40)
    # 100 ticks: user 30, system 10, idle 40, iowait 5, softirq 5, steal 10
    stat.write_text("cpu  130 0 60 840 15 0 5 50 0 0\n")
    shares = common.cpu_shares(before, common.machine_cpu())
    assert shares == pytest.approx({"busy": 0.45, "steal": 0.10})
    assert common.cpu_shares(before, before) is None
    stat.unlink()
    assert common.machine_cpu() is None and common.cpu_shares(before, None) is None


def test_specs_are_seeded_and_in_range():
    from flashlet.bench.common import make_specs

    a = make_specs(50, (32, 768), (5, 9), 1000, seed=3, stream=1)
    b = make_specs(50, (32, 768), (5, 9), 1000, seed=3, stream=1)
    c = make_specs(50, (32, 768), (5, 9), 1000, seed=3, stream=2)
    assert [s.prompt for s in a] == [s.prompt for s in b]
    assert [s.prompt_len for s in a] == [s.prompt_len for s in c]  # same lengths per level
    assert [s.prompt for s in a] != [s.prompt for s in c]  # fresh tokens per level
    assert all(32 <= s.prompt_len == len(s.prompt) <= 768 for s in a)
    assert all(5 <= s.max_new_tokens <= 9 for s in a)
    assert all(0 <= t < 1000 for s in a for t in s.prompt)
    assert len({s.prompt_len for s in a}) > 10  # mixed lengths


def test_summarize_and_table():
    from flashlet.bench.common import summarize
    from flashlet.bench.report import table

    s = summarize([1, 2, 3, 4, 100], scale=1e3)
    assert s["n"] == 5 and s["p50"] == 3000 and s["max"] == 100_000 and s["mean"] == 22_000
    assert summarize([])["n"] == 0
    t = table(["a", "b"], [[1, 2.5], ["x", None]])
    assert t.splitlines() == ["| a | b |", "|---|---|", "| 1 | 2.50 |", "| x | – |"]


def test_progress_bar_on_a_terminal(monkeypatch):
    import sys

    from flashlet.bench.common import Progress

    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    with Progress() as p:
        assert p.enabled
        task = p.task("work", 3)
        for _ in range(3):
            task.advance()
        assert p._progress.tasks[0].completed == 3
