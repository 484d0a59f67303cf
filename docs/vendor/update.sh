#!/usr/bin/env bash
# Re-vendor the documentation site's browser libraries from the npm registry (see VENDORED.md).
set -euo pipefail
DIFF=8.0.4
DIFF2HTML=3.4.56
HLJS=11.11.1

here="$(cd "$(dirname "$0")" && pwd)"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
cd "$tmp"
npm pack --silent "diff@$DIFF" "diff2html@$DIFF2HTML" "@highlightjs/cdn-assets@$HLJS" >/dev/null
for t in *.tgz; do mkdir -p "${t%.tgz}" && tar xzf "$t" -C "${t%.tgz}"; done

cp "diff-$DIFF/package/dist/diff.min.js" "diff-$DIFF/package/LICENSE" "$here/diff/"
cp "diff2html-$DIFF2HTML/package/bundles/js/diff2html-ui-base.min.js" \
   "diff2html-$DIFF2HTML/package/bundles/css/diff2html.min.css" \
   "diff2html-$DIFF2HTML/package/LICENSE.md" "$here/diff2html/"
cp "highlightjs-cdn-assets-$HLJS/package/highlight.min.js" \
   "highlightjs-cdn-assets-$HLJS/package/styles/github.min.css" \
   "highlightjs-cdn-assets-$HLJS/package/LICENSE" "$here/highlight.js/"
(cd "$here" && sha256sum */*.js */*.css */LICENSE*)
