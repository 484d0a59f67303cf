"""The command lines fail fast and explain themselves: one-line usage errors with
exit code 2 before any model loads (no engine core starts), the port and the backend checked
first, SIGTERM during the model load (in the engine-core process), help text for every flag, a
sampling --seed apart from --weights-seed."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from server_helpers import ServerProcess, wait_until

from flashlet import SamplingParams
from flashlet.__main__ import build_parser as generate_parser
from flashlet.config import EngineConfig
from flashlet.server.cli import build_parser as server_parser

REPO = Path(__file__).resolve().parents[2]
TINY_CONFIG = {  # random weights at a tiny Qwen2 shape (no tokenizer)
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 256,
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-6, "rope_theta": 1e6, "tie_word_embeddings": True, "eos_token_id": 1,
}


def _run(*args, env=None, timeout=120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, env=env)


BAD_USAGE = [
    ("flashlet", ["--temperature", "-1"], "temperature must be finite in fp32"),
    ("flashlet", ["--max-new-tokens", "0"], "max_new_tokens must be an integer >= 1"),
    ("flashlet", ["--top-p", "0"], "top_p must be in (0, 1]"),
    ("flashlet", ["--page-size", "3"], "page_size must be a power of two"),
    ("flashlet", ["--max-num-seqs", "x"], "invalid int value"),
    ("flashlet.server", ["--max-waiting", "0"], "--max-waiting must be >= 1"),
    ("flashlet.server", ["--max-request-bytes", "0"], "--max-request-bytes must be > 0"),
    ("flashlet.server", ["--max-tokens-cap", "-3"], "--max-tokens-cap must be >= 1"),
    ("flashlet.server", ["--nope"], "unrecognized arguments: --nope"),
    ("flashlet.server", ["a", "--model", "b"], "the model is given twice"),
    ("flashlet.server", ["--chat-template", "no/such/file.jinja"], "not a file and not a Jinja"),
    ("flashlet.server", ["--allowed-origins", "[1]"], "JSON list of strings"),
    ("flashlet.server", ["--api-server-count", "0"], "--api-server-count must be >= 1, got 0"),
    ("flashlet.server", ["--api-server-count", "-2"], "--api-server-count must be >= 1, got -2"),
    ("flashlet.server", ["--api-key", ""], "--api-key is empty"),
    ("flashlet.server", ["--api-key", "  "], "--api-key is empty"),
    ("flashlet.server", ["--served-model-name", ""], "--served-model-name is empty"),
    ("flashlet.server", ["--max-model-len", "-1"], "max_model_len must be >= 1"),
    ("flashlet.server", ["--busy-poll-ms", "-1"], "--busy-poll-ms must be in [0, 1000], got -1"),
    ("flashlet.server", ["--busy-poll-ms", "nan"], "--busy-poll-ms must be in [0, 1000], got nan"),
]


def _case_id(v):
    return v if isinstance(v, str) and not v.startswith("-") else None


def _main_in_process(module: str, args: list[str], monkeypatch, capsys) -> tuple[int, str]:
    """`python -m module args` run here (no interpreter start: most of the cost of a case);
    -> (exit code, stderr). Getting past the checks fails the test instead of loading."""
    import flashlet.__main__ as generate_cli
    import flashlet.llm
    import flashlet.server.cli as server_cli

    def loaded(*a, **k):
        raise AssertionError("got past the checks: a model would load")

    monkeypatch.setattr(flashlet.llm, "LLM", loaded)
    monkeypatch.setattr(server_cli, "bind_api_server_sockets", loaded)
    main = {"flashlet": generate_cli.main, "flashlet.server": server_cli.main}[module]
    with pytest.raises(SystemExit) as stopped:
        main(list(args))
    return stopped.value.code, capsys.readouterr().err


@pytest.mark.parametrize("module,args,needle", BAD_USAGE, ids=_case_id)
def test_bad_usage_is_one_line_and_exit_code_2_before_loading(module, args, needle, monkeypatch,
                                                              capsys):
    code, err = _main_in_process(module, args, monkeypatch, capsys)
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], err


@pytest.mark.parametrize("module,args,needle", [BAD_USAGE[0], BAD_USAGE[-1]], ids=_case_id)
def test_bad_usage_from_the_command_line(module, args, needle):
    """The same through a real `python -m` (one case a command line): exit code 2, one line,
    no traceback, nothing loaded."""
    done = _run("-m", module, *args)
    assert done.returncode == 2, (done.stdout, done.stderr)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], done.stderr
    assert "Traceback" not in done.stderr
    assert "model:" not in done.stdout and "loading model" not in done.stderr  # nothing loaded


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine "
                    "without CUDA")
@pytest.mark.parametrize("backend", ["triton", "flashinfer"])
def test_gpu_backend_without_cuda_is_refused_at_start(backend, monkeypatch, capsys):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    for module in ("flashlet.server", "flashlet"):
        code, err = _main_in_process(module, ["--backend", backend], monkeypatch, capsys)
        assert code == 2, err
        lines = err.strip().splitlines()
        assert len(lines) == 1 and "needs a CUDA GPU" in lines[0], err


def test_port_in_use_is_reported_before_the_model_loads(tiny_qwen2):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = _run("-m", "flashlet.server", "--model", str(tiny_qwen2), "--port", str(port))
    assert done.returncode == 1, done.stderr
    assert f"cannot listen on 127.0.0.1:{port}" in done.stderr
    assert "loading model" not in done.stderr and "serving on" not in done.stderr


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="SO_REUSEPORT groups: Linux")
def test_port_held_by_another_reuseport_group_is_reported_with_several_api_servers(tiny_qwen2):
    # Our own SO_REUSEPORT sockets could join that group: the plain probe bind must refuse.
    with socket.socket() as taken:
        taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = _run("-m", "flashlet.server", "--model", str(tiny_qwen2), "--port", str(port),
                    "--api-server-count", "2")
    assert done.returncode == 1, done.stderr
    assert f"cannot listen on 127.0.0.1:{port}" in done.stderr
    assert "loading model" not in done.stderr


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="SO_REUSEPORT groups: Linux")
def test_api_server_sockets_share_the_port_and_only_listening_ones_get_connections():
    from flashlet.server.cli import bind_api_server_sockets

    sockets = bind_api_server_sockets("127.0.0.1", 0, 3)
    try:
        port = sockets[0].getsockname()[1]
        assert len({id(s) for s in sockets}) == 3
        assert {s.getsockname()[1] for s in sockets} == {port}
        sockets[0].listen()  # the others: bound, as a child's is until it has warmed up
        clients = [socket.create_connection(("127.0.0.1", port)) for _ in range(12)]
        accepted = []
        for sock in sockets:
            sock.setblocking(False)
            while True:
                try:
                    accepted.append((sock, sock.accept()[0]))
                except (BlockingIOError, OSError):
                    break
        assert len(accepted) == 12 and all(sock is sockets[0] for sock, _ in accepted)
        for _, conn in accepted:
            conn.close()
        for client in clients:
            client.close()
    finally:
        for sock in sockets:
            sock.close()
    one = bind_api_server_sockets("127.0.0.1", 0, 1)[0]
    with one:  # one API process: a plain socket, as before
        assert one.getsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT) == 0


SLOW_LOAD = """
import sys
sys.path.insert(0, {folder!r})
import slow_core
import flashlet.server.core_client

flashlet.server.core_client.run_engine_core = slow_core.run  # spawned by reference
from flashlet.server.cli import main
sys.exit(main(sys.argv[1:]))
"""
SLOW_CORE = """
import os, time
import flashlet.core.engine
from flashlet.server.engine_core import run_engine_core

def slow_init(self, *args, **kwargs):  # a load that takes long, as a big model's does
    with open(os.path.join(os.path.dirname(__file__), "core.pid"), "w") as f:
        f.write(str(os.getpid()))
    time.sleep(300)

def run(*args):  # the engine-core process
    flashlet.core.engine.Engine.__init__ = slow_init
    run_engine_core(*args)
"""


def _process_gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return True
    return state in ("Z", "X")  # a zombie waits only for its parent to reap it


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_during_model_load_exits_at_once(tiny_qwen2, sig, tmp_path):
    """The model loads in the engine-core process: a signal then ends the core and the server
    at once, with exit code 0, and leaves no core process behind."""
    (tmp_path / "slow_core.py").write_text(SLOW_CORE)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    proc = subprocess.Popen([sys.executable, "-c", SLOW_LOAD.format(folder=str(tmp_path)),
                             "--model", str(tiny_qwen2), "--port", str(port)], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    pid_file = tmp_path / "core.pid"
    try:
        wait_until(lambda: pid_file.exists() and pid_file.read_text(), 120,
                   "the engine core to start loading", interval=0.05)
        core_pid = int(pid_file.read_text())
        assert "loading model" in "".join(lines)
        time.sleep(0.5)  # uvicorn is up and listening by now
        proc.send_signal(sig)
        rc = proc.wait(30)  # a bound for a hang, not a speed test: the log shows it stopped early
        reader.join(5)
        log = "".join(lines)
        assert rc == 0, log
        assert "stopped while the model was loading" in log
        assert "terminate called" not in log and "serving on" not in log
        wait_until(lambda: _process_gone(core_pid), 5, "the engine core to be gone")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_every_flag_has_help():
    for parser in (server_parser(), generate_parser()):
        for action in parser._actions:
            if action.option_strings and action.dest != "help":
                assert action.help and action.help.removesuffix(" (default: %(default)s)"), \
                    f"{parser.prog} {action.option_strings[0]} has no help"
    text = server_parser().format_help()
    assert "tokens per KV page" in text  # from EngineConfig's field comment


def test_vllm_flag_names_and_positional_model(tmp_path):
    from flashlet.server.cli import _model_argument, read_chat_template

    args = server_parser().parse_args(["some/model", "--block-size", "32", "--enforce-eager",
                                       "--no-enable-prefix-caching", "--allowed-origins",
                                       '["http://a.test", "http://b.test"]'])
    _model_argument(args)
    config = EngineConfig.from_cli(args)
    assert (config.model, config.page_size, config.cuda_graph, config.enable_prefix_cache) == (
        "some/model", 32, False, False)
    assert args.allowed_origins == ("http://a.test", "http://b.test")
    defaults = EngineConfig.from_cli(server_parser().parse_args([]))
    assert (defaults.page_size, defaults.cuda_graph, defaults.enable_prefix_cache) == (
        EngineConfig.page_size, EngineConfig.cuda_graph, EngineConfig.enable_prefix_cache)
    assert server_parser().parse_args(["--allowed-origins", "http://a, http://b"]
                                      ).allowed_origins == ("http://a", "http://b")
    template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    path = tmp_path / "t.jinja"
    path.write_text(template)
    assert read_chat_template(str(path)) == read_chat_template(template) == template


def test_sampling_seed_is_not_the_weights_seed():
    args = generate_parser().parse_args(["--seed", "7", "--weights-seed", "3", "--temperature",
                                         "0.8"])
    assert args.seed == 7 and EngineConfig.from_cli(args).weights_seed == 3
    assert server_parser().parse_args(["--weights-seed", "5"]).weights_seed == 5


def test_sampling_params_takes_vllms_max_tokens():
    assert SamplingParams(max_tokens=5).max_new_tokens == 5
    assert SamplingParams(max_new_tokens=9).max_tokens == 9
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=5, max_new_tokens=9)
    with pytest.raises(ValueError, match="max_new_tokens must be an integer >= 1"):
        SamplingParams(max_tokens=0)


@pytest.mark.slow
def test_random_weights_server_returns_token_ids(tmp_path):
    config = tmp_path / "tiny.json"
    config.write_text(json.dumps(TINY_CONFIG))
    p = ServerProcess("--config", str(config), "--max-num-pages", "32", "--no-access-log")
    try:
        p.wait_serving(120)
        import httpx

        r = httpx.post(p.url + "/generate", timeout=60,
                       json={"prompt": [1, 2, 3], "max_new_tokens": 3, "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert r.json()["text"] == "" and len(r.json()["token_ids"]) == 3
        p.proc.send_signal(signal.SIGTERM)
        assert p.proc.wait(60) == 0, p.log
    finally:
        p.kill()


@pytest.mark.parametrize("cpus,tp,count", [(1, 1, 1), (2, 1, 1), (7, 1, 1), (8, 1, 2), (12, 1, 3),
                                           (16, 1, 4), (128, 1, 4), (16, 2, 1)])
def test_the_default_api_server_count_follows_the_cpus(cpus, tp, count):
    from flashlet.server.cli import default_api_server_count

    assert default_api_server_count(cpus, tp) == count


def test_api_server_count_flag_overrides_the_default(monkeypatch):
    import flashlet.server.cli as cli

    monkeypatch.setattr(cli, "usable_cpus", lambda: 32)
    args = server_parser().parse_args([])
    assert args.api_server_count is None
    cli._resolve_api_server_count(args)
    assert args.api_server_count == 4 and "32 CPUs" in args.api_server_count_reason
    args = server_parser().parse_args(["--api-server-count", "1"])
    cli._resolve_api_server_count(args)
    assert args.api_server_count == 1 and args.api_server_count_reason == "--api-server-count"
