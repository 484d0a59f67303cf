"""lm-eval against the server: every per-choice loglikelihood equals lm-eval's `hf` model.

Starts the server on the embedded SmolLM2-135M (CPU, fp32), runs lm-eval's
`local-completions` model on a 20-question multiple-choice task defined here
(scripts/data/lm_eval/: a task YAML and its JSONL data), then lm-eval's `hf` model on the same
converted folder, and checks that each choice's loglikelihood agrees within --tolerance
(1e-4). lm-eval scores a choice with {"echo": true, "logprobs": 1, "max_tokens": 1} on
/v1/completions and sums the prompt logprobs of the continuation's tokens, so this is the
server's prompt logprobs end to end. Exit status 0 when all agree.

    pip install -e ".[eval]"        # lm-eval, pinned
    python scripts/lm_eval_check.py [--port 8011] [--limit N]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # the data set is a local file
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = Path(__file__).resolve().parent.parent
TASK_DIR = ROOT / "scripts" / "data" / "lm_eval"
TASK = "flashlet_tiny_mc"


def main() -> int:
    args = parse_args()
    from flashlet.models.weights import embedded_model_dir

    model_dir = embedded_model_dir()
    include = task_folder(Path(tempfile.mkdtemp(prefix="flashlet-lm-eval-")))
    with serve(args.port) as name:
        served = choice_loglikelihoods(evaluate(
            "local-completions", f"base_url=http://127.0.0.1:{args.port}/v1/completions,"
            f"model={name},tokenizer={model_dir},tokenizer_backend=huggingface,"
            "tokenized_requests=True,num_concurrent=1,max_retries=1", include, args.limit, 8))
    reference = choice_loglikelihoods(evaluate(
        "hf", f"pretrained={model_dir},dtype=float32,device=cpu", include, args.limit, 4))
    return report(served, reference, args.tolerance)


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--port", type=int, default=8011)
    p.add_argument("--limit", type=int, default=None, help="only the first N questions")
    p.add_argument("--tolerance", type=float, default=1e-4)
    return p.parse_args()


def task_folder(folder: Path) -> Path:
    """The task YAML, with its data file's path made absolute, in a folder for lm-eval."""
    text = (TASK_DIR / f"{TASK}.yaml").read_text()
    data = TASK_DIR / "tiny_mc.jsonl"
    (folder / f"{TASK}.yaml").write_text(text.replace("test: tiny_mc.jsonl", f"test: {data}"))
    return folder


class serve:
    """`python -m flashlet.server` on the embedded model for the `with` block; yields the
    model's name on /v1."""

    def __init__(self, port: int):
        self.port = port

    def __enter__(self) -> str:
        import httpx

        self.proc = subprocess.Popen(
            [sys.executable, "-m", "flashlet.server", "--host", "127.0.0.1", "--port",
             str(self.port)], cwd=ROOT)
        url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"the server exited with status {self.proc.returncode}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    return httpx.get(url + "/v1/models").json()["data"][0]["id"]
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise SystemExit("the server did not become healthy in 600 s")

    def __exit__(self, *exc) -> None:
        self.proc.terminate()
        self.proc.wait(60)


def evaluate(model: str, model_args: str, include: Path, limit: int | None, batch: int) -> dict:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    return simple_evaluate(model=model, model_args=model_args, tasks=[TASK],
                           task_manager=TaskManager(include_path=str(include)),
                           batch_size=batch, limit=limit, log_samples=True)


def choice_loglikelihoods(results: dict) -> dict[tuple[int, int], float]:
    """{(question, choice): loglikelihood} from lm-eval's logged samples."""
    table = {}
    for sample in results["samples"][TASK]:
        for j, resp in enumerate(sample["resps"]):
            loglikelihood = resp[0][0] if isinstance(resp[0], (list, tuple)) else resp[0]
            table[sample["doc_id"], j] = float(loglikelihood)
    return table


def report(served: dict, reference: dict, tolerance: float) -> int:
    if served.keys() != reference.keys():
        print(f"FAIL: the runs scored different choices ({len(served)} vs {len(reference)})")
        return 1
    diffs = {key: abs(served[key] - reference[key]) for key in served}
    worst = max(diffs, key=diffs.get)
    bad = [key for key, d in diffs.items() if d > tolerance]
    questions = {q for q, _ in served}
    same = sum(a == b for a, b in zip(_picks(served), _picks(reference)))
    print(f"{len(diffs)} choices of {len(questions)} questions: max |server - hf| = "
          f"{diffs[worst]:.2e} (question {worst[0]}, choice {worst[1]}: server "
          f"{served[worst]:.6f}, hf {reference[worst]:.6f}); {len(bad)} beyond {tolerance:g}; "
          f"same pick on {same}/{len(questions)} questions")
    return 1 if bad else 0


def _picks(table: dict) -> list[int]:
    """The most likely choice of each question, in question order."""
    best: dict[int, int] = {}
    for (q, j), loglikelihood in sorted(table.items()):
        if q not in best or loglikelihood > table[q, best[q]]:
            best[q] = j
    return [best[q] for q in sorted(best)]


if __name__ == "__main__":
    sys.exit(main())
