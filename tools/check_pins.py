"""Check that the pinned dependencies resolve on PyPI alone (CI: `make check-pins`).

A machine's own pip set-up can hide a broken pin set: here /etc/pip.conf and PIP_FIND_LINKS
add a local wheel directory (a CPU torch among others) and /etc/xdg/pip a constraints file.
This runs pip's resolver with none of that (a clean environment, PIP_CONFIG_FILE=/dev/null,
--isolated) against PyPI, for `.[dev,cuda]` as `make setup` installs it on a CUDA machine, without
installing anything: `--dry-run --report`. Wheels only, and PyPI serves each wheel's metadata
on its own (PEP 658), so no multi-GB torch wheel is downloaded: about 1-2 minutes, mostly
network round trips. Fails (exit 1) on ResolutionImpossible, on a package that PyPI alone
cannot supply, or when the resolved torch/triton are not the pinned ones.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PYPI_FILES = "https://files.pythonhosted.org/"


def pinned(name: str, text: str) -> str | None:
    match = re.search(rf'"{re.escape(name)}==([^"]+)"', text)
    return match.group(1) if match else None


def resolve(requirements: list[str], report: Path, home: str) -> subprocess.CompletedProcess:
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": home,
           "PIP_CONFIG_FILE": os.devnull}  # no pip.conf, no find-links, no constraints
    for var in ("SSL_CERT_FILE", "HTTPS_PROXY", "https_proxy", "NO_PROXY", "no_proxy"):
        if var in os.environ:
            env[var] = os.environ[var]
    cert = Path("/etc/ssl/certs/ca-certificates.crt")  # the system store, if there is one
    cmd = [sys.executable, "-m", "pip", "install", "--isolated", "--dry-run", "--ignore-installed",
           "--quiet", "--no-cache-dir", "--only-binary", ":all:", "--report", str(report),
           *(["--cert", str(cert)] if cert.exists() else []), *requirements]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


def main() -> int:
    pyproject = (REPO / "pyproject.toml").read_text()
    want = {name: pinned(name, pyproject) for name in ("torch", "triton")}
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="check-pins-") as home:
        report = Path(home) / "report.json"
        done = resolve([".[dev,cuda]"], report, home)
        if done.returncode != 0:
            errors = [line for line in done.stderr.splitlines() if line.startswith("ERROR")]
            print("pins do NOT resolve on PyPI alone:\n" + "\n".join(errors or [done.stderr]),
                  file=sys.stderr)
            return 1
        installs = json.loads(report.read_text())["install"]
    got = {i["metadata"]["name"].lower(): i["metadata"]["version"] for i in installs}
    foreign = [f'{i["metadata"]["name"]} ({i["download_info"]["url"]})' for i in installs
               if i["metadata"]["name"] != "flashlet"
               and not i["download_info"]["url"].startswith(PYPI_FILES)]
    problems = [f"{name}: resolved {got.get(name)}, pinned {version}"
                for name, version in want.items() if version and got.get(name) != version]
    if foreign:
        problems.append("not from PyPI: " + ", ".join(foreign))
    if problems:
        print("pin check failed:\n  " + "\n  ".join(problems), file=sys.stderr)
        return 1
    print(f"pins resolve on PyPI alone: {len(installs)} packages (torch {got.get('torch')}, "
          f"triton {got.get('triton')}) in {time.monotonic() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
