"""The decode benchmark's plot: tok/s against batch size, one line per backend (and context),
with the speed-of-light curve of the result's `sol_curve` (uniform routing, datasheet
bandwidth) when it has one. Drawn with matplotlib's object API on the Agg canvas: no
display, no pyplot state. matplotlib is the optional `bench` extra."""

from __future__ import annotations

import importlib.util
from pathlib import Path


def plotting_available() -> bool:
    return importlib.util.find_spec("matplotlib") is not None


def backend_label(row: dict) -> str:
    """The backend, and for tools/engine_bench.py's rows "through the engine" (with "each step
    waited for" when decode_ahead was off)."""
    if row.get("path") != "engine":
        return row["backend"]
    return row["backend"] + (" through the engine" if row.get("decode_ahead", True) else
                             " through the engine, each step waited for")


def series(rows: list[dict]) -> dict[str, list[tuple[int, float]]]:
    """Label -> [(batch, tok/s)] sorted by batch. The label is the backend (backend_label), with
    the context when rows have several, and the commit when rows of joined results would
    otherwise collide."""
    several_contexts = len({r["context"] for r in rows}) > 1
    keys = [(backend_label(r), r["context"], r["batch"]) for r in rows]
    collide = len(set(keys)) < len(keys)
    out: dict[str, list[tuple[int, float]]] = {}
    for r in rows:
        label = backend_label(r) + (f" @ {r['context']}" if several_contexts else "")
        label += f" ({r.get('commit', '?')})" if collide else ""
        out.setdefault(label, []).append((r["batch"], r["tok_s"]))
    return {k: sorted(v) for k, v in out.items()}


def title(result: dict) -> str:
    contexts = ", ".join(str(c) for c in sorted({r["context"] for r in result["rows"]}))
    commits = ", ".join(dict.fromkeys(r.get("commit", result.get("commit", "?")) for r in result["rows"]))
    geometry = result.get("geometry", "north")
    model = "North Mini Code" + ("" if geometry == "north" else f" ({geometry} geometry)")
    return (f"{model} decode, {contexts} context, {result.get('device', '?')}\n"
            f"{result.get('date', '?')}, commit {commits}")


def plot_decode(result: dict, path: str | Path) -> Path:
    """Write the PNG for a decode result (the JSON that `python -m northmk.bench decode` writes)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    rows = result.get("rows") or []
    if not rows:
        raise ValueError("a decode result needs rows to plot")
    fig = Figure(figsize=(7.5, 4.8), dpi=130)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    batches = sorted({r["batch"] for r in rows})
    for label, points in series(rows).items():
        xs, ys = zip(*points)
        engine = "through the engine" in label  # squares, dotted, figures below: beside the bench's own
        ax.plot(xs, ys, marker="s" if engine else "o", linestyle=":" if engine else "-", label=label)
        for x, y in points:
            ax.annotate(f"{y:.0f}", (x, y), textcoords="offset points", xytext=(0, -12 if engine else 6),
                        ha="center", fontsize=8)
    curve = result.get("sol_curve")
    if curve:
        bandwidth = result.get("datasheet_bandwidth_bytes_s")
        at = f" at {bandwidth / 1e12:.2f} TB/s" if bandwidth else ""
        ax.plot([p["batch"] for p in curve], [p["tok_s"] for p in curve], "--", color="gray",
                label=f"speed of light{at} (datasheet)")
        batches = sorted(set(batches) | {p["batch"] for p in curve if p["batch"] & (p["batch"] - 1) == 0})
    ax.set_xscale("log", base=2)
    ax.set_xticks(batches, [str(b) for b in batches])
    ax.set_ylim(bottom=0)
    ax.set_xlabel("batch size (rows decoding together)")
    ax.set_ylabel("decode tok/s (all rows)")
    ax.set_title(title(result), fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png")
    return path
