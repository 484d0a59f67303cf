#!/usr/bin/env bash
# Fetches, on a machine with PyPI access, what scripts/gpu_run.sh needs on the GPU machine that
# neither the repository nor that machine holds (it reaches no registry), into ignored folders:
#   .whl/         the server extra's wheels (pyproject.toml) with their dependencies, for the
#                 GPU machine's CPython 3.12, manylinux x86-64 (~16 MB): `serve` installs them
#   .whl-cute/, .whl-cute1/  the CuTe DSL (the fused decode path), each version as a pack: the
#                 tree `pip install --target` makes of its wheels, tarred and xz -9'd (their .so
#                 files come stripped), split into parts beside a manifest (sha256, part count,
#                 "xz"). The last one-wheel DSL, 4.3.5 (58.6 MB as a wheel, ~41 MB packed), goes
#                 whole into .whl-cute/; the pin, CUTE_DSL_VERSION (its four wheels ~97 MB, ~66 MB
#                 packed: more than one call carries beside the ~8 MB repository), in two parts
#                 that leave both folders ~53 MB (each under CARRY_MB): the smaller beside 4.3.5
#                 in .whl-cute/, the larger in .whl-cute1/.
#                 Carry .whl-cute/ in a machine's first call (it runs under 4.3.5) and .whl-cute1/
#                 in its second: from then on every part runs under the pin, whose compiled GEMVs
#                 load from its disk cache where 4.3.5 compiles them in every process
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
CUTE_DSL_FALLBACK=4.3.5     # its oldest supported release, one wheel
CARRY_MB=56                 # a folder's most MiB: room left for the repository in a 64 MiB call
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
"$PY" -m pip download -q --no-deps "${TARGET[@]}" -d .whl-fi "${FLASHINFER[@]}"

# The CuTe DSL packs: each version's wheels unpacked into one tree (what pip --target makes of
# them), tarred and xz'd outside the repository, then split into the carried folders.
stage=$(mktemp -d) && trap 'rm -rf "$stage"' EXIT
pack() {  # pack VERSION WHEEL...: $stage/cute-dsl-VERSION.tar (xz'd) and its sha256
  local tree=$stage/tree-$1 w
  mkdir -p "$tree"
  for w in "${@:2}"; do (cd "$tree" && python3 -m zipfile -e "$w" .); done
  tar -C "$tree" -cf - . | xz -T0 -9 > "$stage/cute-dsl-$1.tar"
  sha256sum < "$stage/cute-dsl-$1.tar" | cut -d' ' -f1
}
place() {  # place VERSION SHA PARTS FOLDER...: part i of the pack into folder i, each with the manifest
  local i=0 f
  for f in "${@:4}"; do
    mkdir -p "$f"
    mv "$stage/cute-dsl-$1.tar.part$(printf %02d $i)" "$f/"
    echo "$2 $3 xz" > "$f/cute-dsl-$1.manifest"
    i=$((i + 1))
  done
}
rm -rf .whl-cute .whl-cute[0-9]*/
"$PY" -m pip download -q --no-deps "${TARGET[@]}" -d "$stage/w-fallback" "nvidia-cutlass-dsl==$CUTE_DSL_FALLBACK"
sha=$(pack "$CUTE_DSL_FALLBACK" "$stage"/w-fallback/*.whl)
mv "$stage/cute-dsl-$CUTE_DSL_FALLBACK.tar" "$stage/cute-dsl-$CUTE_DSL_FALLBACK.tar.part00"
place "$CUTE_DSL_FALLBACK" "$sha" 1 .whl-cute
"$PY" -m pip download -q --no-deps "${TARGET[@]}" -d "$stage/w-pin" \
  "nvidia-cutlass-dsl==$CUTE_DSL_VERSION" "nvidia-cutlass-dsl-libs-base==$CUTE_DSL_VERSION" \
  "nvidia-cutlass-dsl-libs-core==$CUTE_DSL_VERSION" "nvidia-cutlass-dsl-libs-cu12==$CUTE_DSL_VERSION"
sha=$(pack "$CUTE_DSL_VERSION" "$stage"/w-pin/*.whl)
# The pin in two parts that leave both folders the same size (the most room for the repository
# in either call): part00 alone in .whl-cute1/, part01 beside 4.3.5 in .whl-cute/.
fallback=$(stat -c %s .whl-cute/cute-dsl-$CUTE_DSL_FALLBACK.tar.part00)
pinned=$(stat -c %s "$stage/cute-dsl-$CUTE_DSL_VERSION.tar")
(cd "$stage" && split -b $(( (fallback + pinned + 1) / 2 )) -d -a 2 "cute-dsl-$CUTE_DSL_VERSION.tar" \
   "cute-dsl-$CUTE_DSL_VERSION.tar.part")
place "$CUTE_DSL_VERSION" "$sha" 2 .whl-cute1 .whl-cute
for f in .whl-cute .whl-cute1; do
  (( $(cat "$f"/* | wc -c) <= CARRY_MB * 1048576 )) || { echo "$f is over ${CARRY_MB} MiB" >&2; exit 1; }
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
du -sh .whl .whl-cute .whl-cute1 .whl-fi .whl-triton .tok
