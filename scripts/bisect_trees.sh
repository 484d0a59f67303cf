#!/usr/bin/env bash
# Writes older trees for a GPU test's bisection where a device call carries them: each commit's
# flashlet/, tests/, scripts/, lab/ and pyproject.toml into bisect/<short hash>/ (untracked and not
# ignored, so `run` copies them with the checkout: ~6.4 MB a tree, mind the 64 MiB a call).
#   bash scripts/bisect_trees.sh 4d41fa9 bc637cc HEAD      then   TESTS_AT="-k split_contexts
#   tests/gpu/test_gpu_fused_decode.py" bash scripts/gpu_run.sh tests-at       then   rm -rf bisect
set -euo pipefail
cd "$(dirname "$0")/.."
for c in "$@"; do
  d="bisect/$(git rev-parse --short "$c")"
  rm -rf "$d" && mkdir -p "$d"
  git archive "$c" flashlet tests scripts lab pyproject.toml | tar -x -C "$d"
  echo "$d  $(git log -1 --format='%ad %s' --date=short "$c" | cut -c1-90)"
done
du -sh bisect
