#!/usr/bin/env bash
# Fetches, on a machine with PyPI access, what scripts/gpu_run.sh needs on the GPU machine that
# neither the repository nor that machine holds (it reaches no registry), into ignored folders:
#   .whl/         the server extra's wheels (pyproject.toml) with their dependencies, for the
#                 GPU machine's CPython 3.12, manylinux x86-64 (~16 MB): `serve` installs them
#   .whl-cute/    the CuTe DSL wheel (~56 MB; the fused decode path): `cute_env` installs it.
#                 A device call carries at most 64 MiB, so it travels without .whl/
#   .whl-fi/      FlashInfer and the packages it imports that such a machine lacks (~37 MB,
#                 --no-deps: its newer CuTe DSL is left out, the fused path brings its own):
#                 gpu_run.sh installs them into /tmp/fi and `fi-parity` runs with and without
#                 them. It travels with .whl/ and .tok/ (~57 MB), after a call that carried .whl-cute/
#   .tok/smollm2  the SmolLM2 tokenizer `serve` loads (scripts/export_tokenizer.py)
#   bash scripts/gpu_wheels.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$([[ -x .venv/bin/python ]] && echo .venv/bin/python || echo python3)}  # make setup's venv: flashlet and the embedded model
CUTE_DSL=nvidia-cutlass-dsl==4.3.5  # flashlet/kernels/cute_gemv.py's version
# The FlashInfer release seen working on the H200 (../shared/notes/gpu.md) and what it imports
FLASHINFER=(flashinfer-python==0.6.18.post1 apache-tvm-ffi==0.1.15.post2 cuda-tile==1.7.0
            nccl4py==0.6.0 nvidia-cudnn-frontend==1.32.0 einops==0.8.2 ninja==1.13.2
            nvidia-ml-py==13.615.71 tabulate==0.10.0)
TARGET=(--only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
mapfile -t SERVER < <("$PY" -c "import tomllib
for r in tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies']['server']:
    print(r)")
"$PY" -m pip download -q "${TARGET[@]}" -d .whl "${SERVER[@]}"
"$PY" -m pip download -q --no-deps "${TARGET[@]}" -d .whl-cute "$CUTE_DSL"
"$PY" -m pip download -q --no-deps "${TARGET[@]}" -d .whl-fi "${FLASHINFER[@]}"
[[ -f .tok/smollm2/tokenizer.json ]] || "$PY" scripts/export_tokenizer.py
du -sh .whl .whl-cute .whl-fi .tok
