"""Formatting helpers for human-readable CLI output (no I/O)."""

from __future__ import annotations

import json
import math
import time
from datetime import UTC, datetime
from typing import Any


def human_bytes(n: int | float | None) -> str:
    if n is None:
        return "-"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{int(value)} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def human_time(ts: float | None, now: float | None = None) -> str:
    """``2026-01-02 03:04:05 UTC (12 s ago)``; ``-`` for a missing timestamp."""
    if not isinstance(ts, int | float):
        return "-"
    try:
        stamp = datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    except (OverflowError, OSError, ValueError):  # (a damaged record: any number at all)
        return f"{str(ts)[:24]} (not a time)"
    return f"{stamp} ({human_age((now or time.time()) - ts)} ago)"


def json_line(record: Any, **kwargs: Any) -> str:
    """``record`` as strict JSON: a non-finite number (a damaged record may hold one) becomes
    null, so every parser reads the output."""
    return json.dumps(_finite(record), allow_nan=False, **kwargs)


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def human_age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    seconds = max(seconds, 0.0)
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    if seconds < 172800:
        return f"{seconds / 3600:.0f} h"
    return f"{seconds / 86400:.0f} d"


def table(headers: list[str], rows: list[list[str]]) -> list[str]:
    """Left-aligned columns separated by two spaces."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h)
              for i, h in enumerate(headers)]
    out = []
    for row in [headers, *rows]:
        out.append("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())
    return out
