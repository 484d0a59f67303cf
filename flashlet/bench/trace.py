"""A run's raw timeline (when each request was sent, when each of its tokens arrived, what
every step cost) and the figures derived from it, shared by the engine, the peers and --url."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from flashlet.bench.common import samples, summarize

# Trace.itl_shape: a gap is long over LONG_GAP x the median gap, short under SHORT_GAP x it.
LONG_GAP = 1.5
SHORT_GAP = 0.5


@dataclass
class Trace:
    requested: list[int]  # output tokens asked for, per request
    prompt_lens: list[int]
    submit: list[float] = field(default_factory=list)  # when each request was sent
    token_times: list[list[float]] = field(default_factory=list)  # arrival of each output token
    outputs: list[list[int] | None] = field(default_factory=list)  # output token ids (None: failed)
    start: float = 0.0
    end: float = 0.0
    step_s: list[float] = field(default_factory=list)  # duration of every step / forward
    num_preemptions: int = 0
    failed: int = 0
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        n = len(self.requested)
        self.submit = self.submit or [0.0] * n
        self.token_times = self.token_times or [[] for _ in range(n)]
        self.outputs = self.outputs or [None] * n

    @property
    def duration(self) -> float:
        return self.end - self.start

    def output_tokens(self) -> int:
        return sum(len(o) for o in self.outputs if o is not None)

    def ttft(self) -> list[float]:
        return [t[0] - s for s, t in zip(self.submit, self.token_times) if t]

    def itl(self) -> list[float]:
        return [b - a for t in self.token_times for a, b in zip(t, t[1:])]

    def itl_shape(self) -> dict | None:
        """Where the long token gaps come from. Over every stream's gaps in order: `long`, the
        share over LONG_GAP x their median; `late`, the share that are long and followed by one
        under SHORT_GAP x the median: the token reached its reader late and the next one on
        time (a hop between the engine and the reader slept), where a long gap followed by a
        usual one is a slow step. None without gaps."""
        gaps = [np.diff(times) for times in self.token_times if len(times) > 1]
        if not gaps:
            return None
        median = float(np.median(np.concatenate(gaps)))
        total = long = late = 0
        for g in gaps:
            slow = g > LONG_GAP * median
            total, long = total + g.size, long + int(slow.sum())
            late += int((slow[:-1] & (g[1:] < SHORT_GAP * median)).sum())
        return {"median_ms": median * 1e3, "long": long / total, "late": late / total}

    def metrics(self, keep_samples: bool = True) -> dict:
        """Throughput and latency figures (ms), with raw samples for the distribution plots."""
        out_tokens = self.output_tokens()
        done = sum(1 for o in self.outputs if o is not None)
        dur = max(self.duration, 1e-12)
        ttft, itl = self.ttft(), self.itl()
        m = {
            "num_requests": len(self.requested),
            "completed": done,
            "failed": self.failed,
            "prompt_tokens": int(sum(self.prompt_lens)),
            "output_tokens": out_tokens,
            "output_tokens_requested": int(sum(self.requested)),
            "duration_s": self.duration,
            "output_tok_s": out_tokens / dur,
            "total_tok_s": (out_tokens + sum(self.prompt_lens)) / dur,
            "requests_per_s": done / dur,
            "ttft_ms": summarize(ttft, 1e3),
            "itl_ms": summarize(itl, 1e3),
            "itl_shape": self.itl_shape(),
            "step_ms": summarize(self.step_s, 1e3),
            "num_steps": len(self.step_s),
            "num_preemptions": self.num_preemptions,
        }
        m.update(self.extra)
        if keep_samples:
            m["samples"] = {"ttft_ms": samples(ttft, 1e3), "itl_ms": samples(itl, 1e3)}
        return m
