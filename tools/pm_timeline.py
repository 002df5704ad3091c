"""DRAM throughput over one decode step, from ncu's PM sampling:

    python tools/pm_timeline.py NCU_RAW.csv [--metric SUBSTR] [--dip FRACTION] [--step-us US]

NCU_RAW.csv is ncu's raw page with every metric's instances (`--page raw --csv
--print-metric-instances values`), as `NCU=1 NCU_SECTIONS=PmSampling NCU_EXTRA=
"--pm-sampling-interval 1000" tools/gpu_run.sh` leaves it in $OUT/ncu-raw.csv, or as an ncu run
with `--metrics pmsampling:dram__bytes_read.sum` writes it (export that one with `--print-units
base`: in its display unit a sample rounds to 10 MB). Each PM-sampled metric is one value per
sample; the kernel's samples are those where the SMs had active cycles (or, without that series,
from the metric's first to its last sample above 1% of its peak). Every layer of a batch-1 step
dips once to near zero (below --dip times the series' peak): with the same launch's task times
beside it (the bench's profiled step, ncu's --launch-skip 5 with --warmup 1 --steps 4), between
the last bytes of the layer's QKV tiles and the first of its GATE_UP tiles, while the routing is
computed (benchmarks/NOTES.md, session 49). The samples from one dip to the next a layer on are
folded, offset 0 at the dip, and the mean per offset printed; the samples after the last dip
(the LM head) are averaged apart. With --step-us (the step's measured time) the offsets are in
microseconds as well, and a bytes metric is printed as TB/s.
"""

from __future__ import annotations

import argparse
import csv
import re
import sys
from pathlib import Path

import numpy as np

SERIES = re.compile(r"\(([-0-9.,; ]*)\)\s*$")
ACTIVE = "sm__cycles_active.avg"
BEFORE = 3  # samples shown ahead of each folded dip


def read_series(path: Path) -> dict[str, np.ndarray]:
    """Every metric of the file's first kernel that has one value per sample, by name (the part
    after ncu's section prefix, e.g. 'dramc__read_throughput.avg.pct_of_peak_sustained_elapsed')."""
    csv.field_size_limit(sys.maxsize)  # a series of thousands of samples is one field
    rows = list(csv.reader(path.open(newline="")))
    if len(rows) < 3:
        raise ValueError(f"{path}: want a header, a units row and a kernel's row (ncu --page raw --csv)")
    out = {}
    for name, value in zip(rows[0], rows[2]):
        m = SERIES.search(value)
        if not m or ";" not in m[1]:
            continue
        out[name.split(".TriageCompute.")[-1]] = np.array([float(x.replace(",", "")) for x in m[1].split(";")])
    if ACTIVE in out:  # the PmSampling section's: other metrics with instances (occupancy tables) are no samples
        return {n: v for n, v in out.items() if len(v) == len(out[ACTIVE])}
    sampled = {n: v for n, v in out.items() if n.startswith("pmsampling:")}  # --metrics pmsampling:NAME
    if not sampled:
        raise ValueError(f"{path}: no sampled metric (was it written with --print-metric-instances values, "
                         "from the PmSampling section or pmsampling: metrics?)")
    return sampled


def pick(series: dict[str, np.ndarray], substr: str) -> tuple[str, np.ndarray]:
    names = [n for n in series if substr in n]
    if len(names) != 1:
        raise ValueError(f"--metric {substr!r} matches {len(names)} sampled metrics: " + ", ".join(sorted(series)))
    return names[0], series[names[0]]


def active_window(series: dict[str, np.ndarray], values: np.ndarray) -> slice:
    """The samples in which the SMs had active cycles (the kernel ran), or without that series
    (another pass's) those from the metric's first to its last sample above 1% of its peak (the
    other work of the process leaves a trickle around the kernel)."""
    on = np.flatnonzero(series[ACTIVE] > 0) if ACTIVE in series else np.flatnonzero(values > 0.01 * values.max())
    if len(on) == 0:
        raise ValueError("no sample of the kernel (no active SM cycles, or the metric is all zero)")
    return slice(int(on[0]), int(on[-1]) + 1)


def dips(values: np.ndarray, below: float, merge: int = 3) -> list[int]:
    """Local minima under `below`, one per run of them closer than `merge` samples."""
    out: list[int] = []
    for i in range(1, len(values) - 1):
        if values[i] < below and values[i] <= values[i - 1] and values[i] <= values[i + 1]:
            if out and i - out[-1] < merge:
                continue
            out.append(i)
    return out


def fold(values: np.ndarray, at: list[int], before: int = BEFORE) -> tuple[int, np.ndarray]:
    """The layer period (the median spacing of the dips) and the mean of the segments that start
    `before` samples ahead of a dip and span a period, over the dips whose next one is a period on
    (within one sample: a layer whose dip stayed above the threshold is skipped, not folded across two)."""
    if len(at) < 3:
        raise ValueError(f"{len(at)} dips: too few to fold (is --dip too low?)")
    period = int(np.median(np.diff(at)))
    segments = [values[a - before:a - before + period] for a, b in zip(at, at[1:])
                if abs(b - a - period) <= 1 and a >= before]
    if not segments:
        raise ValueError("no two dips a period apart")
    return period, np.mean(segments, axis=0)


def report(values: np.ndarray, name: str, below: float, step_us: float | None = None) -> str:
    us = step_us / len(values) if step_us else None
    if us and "bytes" in name:  # bytes a sample, as TB/s
        values, below, name = values / (us * 1e6), below / (us * 1e6), name + " (TB/s)"
    at = dips(values, below)
    period, mean = fold(values, at)
    at = [a for a in at if a < len(values) - period]  # the kernel's own end is no dip of a layer
    if not at:
        raise ValueError("every dip lies in the kernel's last layer period")
    unit = f" ({us:.3f} us a sample)" if us else ""
    last = at[-1]
    lines = [f"{name}: {len(values)} samples in the kernel{unit}, mean {values.mean():.2f}",
             f"{len(at)} dips under {below:g}; layer period {period} samples"
             + (f" ({period * us:.1f} us)" if us else "")
             + f"; mean over a folded layer {mean[BEFORE:].mean():.2f}, after the last dip (the LM head) "
             f"{values[last + BEFORE:].mean():.2f}",
             "offset from the dip, samples" + (" (us)" if us else "") + ": mean"]
    for i, v in enumerate(mean):
        off = i - BEFORE
        when = f" ({off * us:6.1f})" if us else ""
        lines.append(f"  {off:4d}{when} {v:6.2f} {'#' * int(50 * v / max(mean.max(), 1e-30))}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv", type=Path)
    ap.add_argument("--metric", help="a substring of one sampled metric's name (default: the DRAM read throughput "
                    "of the PmSampling section, else pmsampling:dram__bytes_read)")
    ap.add_argument("--dip", type=float, default=0.1, help="a layer's dip is under this fraction of the series' peak")
    ap.add_argument("--step-us", type=float, help="the step's time, to print offsets in us")
    args = ap.parse_args(argv)
    if args.step_us is not None and args.step_us <= 0 or not 0 < args.dip < 1:
        ap.error("want --step-us > 0 and --dip in (0, 1)")
    try:
        series = read_series(args.csv)
        metric = args.metric or ("dramc__read_throughput" if any("dramc__read_throughput" in n for n in series)
                                 else "dram__bytes_read")
        name, values = pick(series, metric)
        values = values[active_window(series, values)]
        print(report(values, name, args.dip * values.max(), args.step_us))
    except (OSError, ValueError, csv.Error) as e:
        print(f"tools/pm_timeline.py: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
