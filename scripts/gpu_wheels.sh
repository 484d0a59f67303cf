#!/usr/bin/env bash
# Fetches, on a machine with PyPI access, what scripts/gpu_run.sh needs on the GPU machine that
# neither the repository nor that machine holds (it reaches no registry), into ignored folders:
#   .whl/         the server extra's wheels (pyproject.toml) with their dependencies, for the
#                 GPU machine's CPython 3.12, manylinux x86-64 (~16 MB): `serve` installs them
#   .whl-cute1/, .whl-cute2/ ...  the CuTe DSL (the fused decode path) at the recommended pin,
#                 CUTE_DSL_VERSION: since 4.6 its wheels (the meta wheel, libs-base, libs-core,
#                 libs-cu12) come to ~97 MB, over the 64 MiB one device call carries, so they are
#                 tarred and split into equal parts of at most PART_MB, one folder each, each with
#                 the tar's manifest (sha256, part count). Carry one folder a call: `cute_env`
#                 (scripts/gpu_run.sh) gathers the parts in /tmp and installs once all are there.
#                 (Unpacked, its .so files already stripped, and xz -9'd: 66 MB, still over what
#                 one call carries beside the ~7 MB repository; so two parts, 2026-12-05)
#   .whl-cute/    the fallback: the last one-wheel DSL, 4.3.5 (~56 MB), until the GPU confirms
#                 the pin; `cute_env` installs it too and the newest installed one is used
#   .whl-fi/      FlashInfer and the packages it imports that such a machine lacks (~37 MB,
#                 --no-deps: the CuTe DSL it needs, >= 4.6.2, is the pin above; with 4.3.5
#                 `import flashinfer` fails): gpu_run.sh installs them into /tmp/fi and
#                 `fi-parity` runs with and without them. It travels with .whl/ and .tok/ (~57 MB)
#   .whl-triton/  the Triton that pyproject.toml pins (torch 2.13's, 3.7.1), for the GPU machine,
#                 whose python3 holds 3.6 (torch 2.11's): every GPU figure so far compiled our
#                 kernels with 3.6, a user's install compiles them with the pin. Its 198 MB wheel
#                 made to fit one call (~38 MB): libtriton.so stripped of its symbols (440 ->
#                 180 MB), xz-compressed, without the CUDA binaries it bundles (ptxas and the
#                 rest: 3.6 bundles the same CUDA 12.8 release, which gpu_run.sh links in)
#                 and without its profiler (proton, CUPTI). gpu_run.sh compiles every part with it
#                 once a call has carried it (TRITON_PIN=0: the image's), `triton-pin-ab` compares the two
#   .tok/smollm2  the SmolLM2 tokenizer `serve` loads (scripts/export_tokenizer.py)
#   bash scripts/gpu_wheels.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$([[ -x .venv/bin/python ]] && echo .venv/bin/python || echo python3)}  # make setup's venv: flashlet and the embedded model
CUTE_DSL_VERSION=4.8.1      # flashlet/kernels/cute_gemv.py's CUTE_DSL_PIN
CUTE_DSL_FALLBACK=nvidia-cutlass-dsl==4.3.5  # its oldest supported release, one wheel
PART_MB=50                  # a part's most MiB: room left for the repository in a 64 MiB call
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
"$PY" -m pip download -q --no-deps "${TARGET[@]}" -d .whl-cute "$CUTE_DSL_FALLBACK"
"$PY" -m pip download -q --no-deps "${TARGET[@]}" -d .whl-fi "${FLASHINFER[@]}"

# The pinned DSL: its wheels in one tar (outside the repository), split into numbered folders.
stage=$(mktemp -d) && trap 'rm -rf "$stage"' EXIT
"$PY" -m pip download -q --no-deps "${TARGET[@]}" -d "$stage/wheels" \
  "nvidia-cutlass-dsl==$CUTE_DSL_VERSION" "nvidia-cutlass-dsl-libs-base==$CUTE_DSL_VERSION" \
  "nvidia-cutlass-dsl-libs-core==$CUTE_DSL_VERSION" "nvidia-cutlass-dsl-libs-cu12==$CUTE_DSL_VERSION"
name=cute-dsl-$CUTE_DSL_VERSION
tar cf "$stage/$name.tar" -C "$stage/wheels" .
bytes=$(stat -c %s "$stage/$name.tar")
parts=$(( (bytes + PART_MB * 1048576 - 1) / (PART_MB * 1048576) ))
(cd "$stage" && split -n "$parts" -d -a 2 "$name.tar" "$name.tar.part")
sha=$(sha256sum < "$stage/$name.tar" | cut -d' ' -f1)
rm -rf .whl-cute[0-9]*/
for ((i = 1; i <= parts; i++)); do
  mkdir -p ".whl-cute$i"
  mv "$stage/$name.tar.part$(printf %02d $((i - 1)))" ".whl-cute$i/"
  echo "$sha $parts" > ".whl-cute$i/$name.manifest"
done
# The pinned Triton for the GPU machine's CPython (TRITON_PIN_PYTHON: 3.11 builds one this machine
# can import, to check the pack), made to fit one call (see .whl-triton/ above).
TRITON_PIN=$("$PY" -c "import re; print(re.search(r'\"triton==([^\"]+)\"', open('pyproject.toml').read())[1])")
pin_py=${TRITON_PIN_PYTHON:-3.12}
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$pin_py" \
  --platform manylinux_2_28_x86_64 -d "$stage/triton" "triton==$TRITON_PIN"
mkdir -p "$stage/triton/pkg" && (cd "$stage/triton/pkg" && python3 -m zipfile -e ../triton-*.whl .)
(cd "$stage/triton/pkg/triton" && strip --strip-unneeded _C/libtriton.so &&
 rm -rf backends/nvidia/bin backends/nvidia/lib/cupti _C/libproton.so instrumentation)
rm -rf .whl-triton && mkdir -p .whl-triton
tar -C "$stage/triton/pkg" -cf - . | xz -T0 -9 > ".whl-triton/triton-$TRITON_PIN-py$pin_py-lean.tar.xz"
[[ -f .tok/smollm2/tokenizer.json ]] || "$PY" scripts/export_tokenizer.py
du -sh .whl .whl-cute .whl-cute[0-9]* .whl-fi .whl-triton .tok
