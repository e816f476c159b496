"""Terminal progress for long work: one redrawn status line on a terminal, periodic log
lines otherwise (CI logs, Snakemake logs).

Owns: formatting step / total (the run's RL steps, numbered as in metrics.jsonl), reward,
accuracy, tokens/s and ETA, and notices of repeated events (retries), rate-limited. Does not
own: metric computation or persistence (logger.py).
"""

from __future__ import annotations

import sys
import time


def _fmt_eta(seconds: float) -> str:
    if seconds != seconds or seconds < 0:  # NaN
        return "?"
    m, s = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


class Progress:
    """Progress of RL steps `start+1 .. stop` of a run of `total` steps, numbered globally (as in
    metrics.jsonl, TensorBoard and the archive): epoch 2 of a 12-step run shows `step 7/12` on.
    The ETA is to `stop` (where this process ends; named when it is not the run's end)."""

    def __init__(self, total: int, mode: str = "auto", stream=None, label: str = "train", start: int = 0,
                 stop: int | None = None):
        self.total = max(1, total)
        self.start = max(0, start)
        self.stop = self.total if stop is None else max(self.start + 1, min(stop, self.total))
        self.stream = stream or sys.stderr
        self.label = label
        if mode == "auto":
            mode = "line" if getattr(self.stream, "isatty", lambda: False)() else "log"
        self.mode = mode
        self.t0 = time.monotonic()
        self._last_logged = self.start - 1
        self._every = max(1, (self.stop - self.start) // 20)
        self._open_line = False
        self._notices: dict[str, tuple[float | None, int]] = {}  # key -> (last printed, count since)

    def update(self, step: int, **fields: float) -> None:
        """step = the run's number of completed steps (global)."""
        if self.mode == "off":
            return
        elapsed = time.monotonic() - self.t0
        done = step - self.start
        rate = done / elapsed if elapsed > 0 else 0.0
        eta = (self.stop - step) / rate if rate > 0 else float("nan")
        parts = [f"[{self.label}] step {step}/{self.total}"]
        for k, v in fields.items():
            if v is None:
                continue
            parts.append(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}")
        until = f" (to step {self.stop})" if self.stop != self.total else ""
        parts.append(f"elapsed {_fmt_eta(elapsed)} eta {_fmt_eta(eta)}{until}")
        text = " | ".join(parts)
        if self.mode == "line":
            self.stream.write("\r" + text[:160].ljust(100))
            self._open_line = True
            self.stream.flush()
        elif step == self.stop or step - self._last_logged >= self._every or done == 1:
            self.stream.write(text + "\n")
            self.stream.flush()
            self._last_logged = step

    def message(self, text: str) -> None:
        if self.mode == "off":
            return
        if self._open_line:
            self.stream.write("\n")
            self._open_line = False
        self.stream.write(text + "\n")
        self.stream.flush()

    def notice(self, key: str, text: str, every_s: float = 5.0) -> None:
        """A repeated event (a retried failure): the first of `key` is printed at once, later ones
        at most once every `every_s` seconds, with how many came since the last one printed."""
        now = time.monotonic()
        last, count = self._notices.get(key, (None, 0))
        count += 1
        if last is not None and now - last < every_s:
            self._notices[key] = (last, count)
            return
        self._notices[key] = (now, 0)
        self.message(text if last is None else f"{text} ({count} since the last such notice)")

    def close(self) -> None:
        if self._open_line:
            self.stream.write("\n")
            self.stream.flush()
            self._open_line = False
