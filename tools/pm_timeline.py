"""DRAM throughput over one decode step, from ncu's PM sampling:

    python tools/pm_timeline.py NCU_RAW.csv [--metric SUBSTR] [--dip PCT] [--step-us US]

NCU_RAW.csv is what `NCU=1 NCU_SECTIONS=PmSampling NCU_EXTRA="--pm-sampling-interval 1000"
tools/gpu_run.sh` leaves as $OUT/ncu-raw.csv: ncu's raw page with every metric's instances,
where each PM-sampled metric is one value per sample. The kernel's samples are those where the
SMs had active cycles. A layer boundary shows as a deep dip of the DRAM series (below --dip
percent): the chain from a layer's last writes to the next layer's streams leaves DRAM idle.
The samples between two dips one layer apart are folded, offset 0 at the dip, and the mean per
offset printed; the samples after the last dip (the LM head) are averaged apart. With --step-us
(the step's measured time) the offsets are converted to microseconds as well.
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
    if ACTIVE not in out:
        raise ValueError(f"{path}: no sampled {ACTIVE} (was it written with --print-metric-instances values, "
                         "from the PmSampling section?)")
    # other metrics with instances (occupancy tables, per-warp counts) are not samples
    return {n: v for n, v in out.items() if len(v) == len(out[ACTIVE])}


def pick(series: dict[str, np.ndarray], substr: str) -> tuple[str, np.ndarray]:
    names = [n for n in series if substr in n]
    if len(names) != 1:
        raise ValueError(f"--metric {substr!r} matches {len(names)} sampled metrics: " + ", ".join(sorted(series)))
    return names[0], series[names[0]]


def active_window(series: dict[str, np.ndarray]) -> slice:
    """The samples in which the SMs had active cycles (the kernel ran)."""
    on = np.flatnonzero(series[ACTIVE] > 0)
    if len(on) == 0:
        raise ValueError("no sample with active SM cycles")
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


def fold(values: np.ndarray, at: list[int], before: int = 3) -> tuple[int, np.ndarray]:
    """The layer period (the median spacing of the dips) and the mean of the segments that start
    `before` samples ahead of a dip and span a period, over the dips whose next one is a period on
    (within one sample: a layer whose boundary dipped less is skipped, not folded across two)."""
    if len(at) < 3:
        raise ValueError(f"{len(at)} dips: too few to fold (is --dip too low?)")
    period = int(np.median(np.diff(at)))
    segments = [values[a - before:a - before + period] for a, b in zip(at, at[1:])
                if abs(b - a - period) <= 1 and a >= before]
    if not segments:
        raise ValueError("no two dips a period apart")
    return period, np.mean(segments, axis=0)


def report(values: np.ndarray, name: str, below: float, step_us: float | None = None) -> str:
    at = dips(values, below)
    period, mean = fold(values, at)
    at = [a for a in at if a < len(values) - period]  # the kernel's own end is no boundary
    us = step_us / len(values) if step_us else None
    unit = f" ({us:.3f} us a sample)" if us else ""
    last = at[-1]
    lines = [f"{name}: {len(values)} samples in the kernel{unit}, mean {values.mean():.1f}",
             f"{len(at)} dips under {below:g}; layer period {period} samples"
             + (f" ({period * us:.1f} us)" if us else "")
             + f"; mean over a folded layer {mean[3:].mean():.1f}, after the last dip (the LM head) "
             f"{values[last + 3:].mean():.1f}",
             "offset from the dip, samples" + (" (us)" if us else "") + ": mean"]
    for i, v in enumerate(mean):
        off = i - 3
        when = f" ({off * us:6.1f})" if us else ""
        lines.append(f"  {off:4d}{when} {v:6.1f} {'#' * int(v / 2)}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv", type=Path)
    ap.add_argument("--metric", default="dramc__read_throughput", help="a substring of one sampled metric's name")
    ap.add_argument("--dip", type=float, default=10.0, help="a layer boundary's dip is under this value")
    ap.add_argument("--step-us", type=float, help="the step's time, to print offsets in us")
    args = ap.parse_args(argv)
    try:
        series = read_series(args.csv)
        name, values = pick(series, args.metric)
        print(report(values[active_window(series)], name, args.dip, args.step_us))
    except (OSError, ValueError, csv.Error) as e:
        print(f"tools/pm_timeline.py: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
