"""How trainctl writes quantities for people: durations, percentages, SI counts, TFLOP/s and byte sizes.
One home for each format, used by the report, the plan and the CLI (no rich, no torch)."""

from __future__ import annotations

import math


def _sig3(v: float) -> str:
    """Three significant digits, no exponent: 1.08, 12.4, 452."""
    if not v:
        return "0"
    v = float(f"{v:.3g}")  # round first: 99.99 is 100, not 100.0
    return f"{v:.{max(0, 2 - math.floor(math.log10(abs(v))))}f}"


def dur(s: float | None) -> str:
    """A duration in the unit that fits it: ns, µs, ms (three significant digits), s, then minutes, hours, days."""
    if s is None:
        return "-"
    if abs(s) < 0.5e-9:  # below what any clock here resolves: a difference of two equal figures' rounding
        return "0 s"
    for unit, scale in (("ns", 1e-9), ("µs", 1e-6), ("ms", 1e-3)):
        if abs(s) < scale * 999.5:  # 999.7 ms reads as 1.00 s
            return f"{_sig3(s / scale)} {unit}"
    if abs(s) < 120:
        return f"{s:.2f} s"
    m, sec = divmod(round(s), 60)  # whole seconds first: 599.7 s is 10m 00s, not 9m 60s
    if m >= 48 * 60:  # an MTBF, a checkpoint interval of a big job: days read better than 1575h
        return f"{int(m) // 1440}d {int(m) % 1440 // 60:02d}h"
    return f"{int(m) // 60}h {int(m) % 60:02d}m" if m >= 60 else f"{int(m)}m {sec:02.0f}s"


def figure(x: float | None) -> str:
    """A quantity with its digits in view: whole numbers with separators from 100 up (and whole ones below),
    three significant digits below (0.000146 GPU-hours, not 0)."""
    if x is None:
        return "-"
    return f"{x:,.0f}" if abs(x) >= 99.95 or float(x).is_integer() else _sig3(x)


def days(s: float) -> str:
    """A long wall clock in days (2 days and more), a shorter one as a duration: 1,234.5 days, 5h 02m."""
    return f"{s / 86400:,.1f} days" if s >= 2 * 86400 else dur(s)


def energy(mwh: float) -> str:
    """Energy in the unit that shows it: MWh, kWh or Wh."""
    for unit, per_mwh in (("MWh", 1.0), ("kWh", 1e3)):
        if abs(mwh * per_mwh) >= 1:
            return f"{figure(mwh * per_mwh)} {unit}"
    return f"{figure(mwh * 1e6)} Wh"


def pct(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{100 * x:.{digits}f}%"


def si(x: float | None, unit: str = "") -> str:
    if x is None:
        return "-"
    for suffix, div in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= div:
            return f"{x / div:.2f} {suffix}{unit}"
    return f"{x:.3g} {unit}".rstrip()


def tflops(x: float | None) -> str:
    """TFLOP/s: two decimals from 1 up, three significant digits below (a CPU's 0.00795)."""
    return "-" if x is None else (f"{x:,.2f}" if x >= 1 else f"{x:.3g}")


def decimal_size(n: float | None) -> str:
    """Bytes in decimal units that fit the size (B, kB, MB, GB, TB; 10^3 steps), as the planner and the GPU
    catalog count them (an H100's 80 GB)."""
    if n is None:
        return "-"
    for unit, div in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= div:
            return f"{n / div:,.2f} {unit}"
    return f"{n:,.0f} B"


def size(n: float | None) -> str:
    """Bytes in binary units (memory, checkpoint sizes)."""
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def count(n: int, noun: str) -> str:
    """A whole number of things, with thousands separators and the noun's plural: 1 step, 2,048 nodes."""
    return f"{n:,} {noun}{'' if n == 1 else 's'}"
