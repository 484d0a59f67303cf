"""`python -m flashlet.bench`: the benchmark harness.

Drives the Engine in-process (closed-loop serving, decode saturation, a single stream, the
offline batch, a scheduler micro-benchmark, the kernel sweep), or a running flashlet server over
HTTP (`--url`), optionally next to Hugging Face transformers on the same weights (`--peer`).
Writes every figure to a JSON file (`--out`), a markdown table to stdout and PNG plots (`--plot`).

Modules: `cli` (flags, validation, dispatch), `workloads` (the in-process runs), `peers`
(Hugging Face runs), `remote` (the HTTP client), `report` (tables, JSON, plots), `common`
(timing, statistics, environment).
"""
