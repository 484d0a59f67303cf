"""One compact table from `python -m flashlet.bench` JSON files: end to end beside steady state.

    python scripts/bench_summary.py gpu-out/json/e2e-*.json

Per file and backend: the workload, the model, what `auto` resolved to, engine start (load /
warm-up / capture, s), and
- offline: first run output tok/s (fresh engine), repeat output tok/s, first / repeat;
- decode-sat: end to end tok/s (T(D+1 new) - T(1 new)), steady (harness) tok/s, their ratio;
- single: end to end tok/s and steady decode tok/s.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def rows_of(path: Path) -> list[list]:
    rec = json.loads(path.read_text())
    model = (rec.get("model") or {}).get("name", "?")
    out = []
    for name, res in (rec.get("backends") or {}).items():
        eng = (rec.get("engines") or {}).get(name, {})
        st = eng.get("start") or {}
        start = "/".join(f"{st.get(k, 0):.1f}" for k in ("load_s", "warmup_s", "capture_s"))
        backend = name if eng.get("backend", name) == name else f"{name}->{eng.get('backend')}"
        backend += " +fused" if eng.get("fused_decode") else ""  # one stream on the fused path
        wl = rec.get("workload")
        if wl == "offline":
            first = res.get("first_run") or {}
            figs = [first.get("output_tok_s"), res.get("output_tok_s"), res.get("first_over_repeat"),
                    "first run / repeat"]
        elif wl == "decode-sat":
            e2e = res.get("end_to_end") or {}
            figs = [e2e.get("decode_tok_s"), res.get("decode_tok_s"), e2e.get("over_steady"), "e2e / steady"]
        elif wl == "single":
            e2e, steady = res.get("end_to_end_tok_s"), res.get("decode_tok_s")
            figs = [e2e, steady, e2e / steady if e2e and steady else None, "e2e / steady"]
        else:
            figs = [None, None, None, wl]
        out.append([path.stem, wl, model, backend, start] + figs)
    return out


def fmt(x) -> str:
    if isinstance(x, float):
        return f"{x:.3f}" if x < 10 else f"{x:,.0f}"
    return "-" if x is None else str(x)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="One compact table from flashlet.bench JSON files.")
    parser.add_argument("paths", nargs="*", type=Path, help="bench JSON records")
    paths = parser.parse_args(argv).paths
    head = ["file", "workload", "model", "backend", "start load/warm/capture s", "end to end tok/s",
            "steady/repeat tok/s", "ratio", "ratio is"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for p in paths:
        try:
            rows = rows_of(p)
        except (OSError, ValueError) as e:
            print(f"| {p.stem} | unreadable: {e} |")
            continue
        for r in rows:
            print("| " + " | ".join(fmt(c) for c in r) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
