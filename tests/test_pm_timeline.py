"""tools/pm_timeline.py's reading of ncu's raw page with PM sampling's instances (ncu and the GPU
that write it are not on CI's machine): the kernel's window, the layer dips, the fold."""

import importlib.util
from pathlib import Path

import numpy as np
import pytest

TOOL = Path(__file__).resolve().parents[1] / "tools" / "pm_timeline.py"
spec = importlib.util.spec_from_file_location("pm_timeline", TOOL)
pm = importlib.util.module_from_spec(spec)
spec.loader.exec_module(pm)

PERIOD, LAYERS, HEAD = 10, 8, 30


def step_series() -> tuple[np.ndarray, np.ndarray]:
    """A step of LAYERS layers (each dips once to 1, with 40 beside the dip and 90 elsewhere),
    then an LM head at 95; idle samples before and after the kernel."""
    layer = np.full(PERIOD, 90.0)
    layer[0], layer[1], layer[-1] = 1.0, 40.0, 40.0
    kernel = np.concatenate([[90.0, 90.0, 40.0], np.tile(layer, LAYERS), [1.0, 40.0, 95.0], np.full(HEAD, 95.0)])
    dram = np.concatenate([np.zeros(5), kernel, np.zeros(4)])
    active = np.concatenate([np.zeros(5), np.full(len(kernel), 2700.0), np.zeros(4)])
    return dram, active


def cell(values: np.ndarray) -> str:
    return "(" + "; ".join(f"{v:,.2f}" for v in values) + ")"


def write_raw(path: Path, dram: np.ndarray, active: np.ndarray) -> None:
    names = ['"ID"', '"Kernel Name"', '"FBSP.TriageCompute.dramc__read_throughput.avg.pct_of_peak_sustained_elapsed"',
             '"TPC.TriageCompute.sm__cycles_active.avg"', '"launch__occupancy_per_block_size"']
    units = ['""', '""', '"%"', '"cycle"', '""']
    values = ['"0"', '"void megakernel<1>(Params)"', f'"{cell(dram)}"', f'"{active.sum():,.2f} {cell(active)}"',
              '"73 (1; 1; 2)"']
    path.write_text("\n".join(",".join(r) for r in (names, units, values)) + "\n")


def test_the_layers_fold_at_their_dips(tmp_path):
    dram, active = step_series()
    write_raw(tmp_path / "raw.csv", dram, active)
    series = pm.read_series(tmp_path / "raw.csv")
    assert set(series) == {"dramc__read_throughput.avg.pct_of_peak_sustained_elapsed", "sm__cycles_active.avg"}
    values = series["dramc__read_throughput.avg.pct_of_peak_sustained_elapsed"]
    values = values[pm.active_window(series, values)]
    assert len(values) == 3 + PERIOD * LAYERS + 3 + HEAD
    at = pm.dips(values, 10.0)
    assert at == [3 + PERIOD * k for k in range(LAYERS + 1)]
    period, mean = pm.fold(values, at)
    assert period == PERIOD
    assert mean.tolist() == pytest.approx([90.0, 90.0, 40.0, 1.0, 40.0] + [90.0] * 5)
    text = pm.report(values, "dram", 10.0, step_us=2.0 * len(values))
    assert "layer period 10 samples (20.0 us)" in text
    assert "after the last dip (the LM head) 95.0" in text
    assert "     0 (   0.0)   1.00" in text


def test_a_bytes_series_without_the_active_cycles_is_its_own_window_and_prints_as_tbps(tmp_path, capsys):
    dram, _ = step_series()
    per_sample = dram * 1e5  # bytes a sample: the peak 95 -> 9.5 MB, 4.75 TB/s at 2 us a sample
    path = tmp_path / "raw.csv"
    path.write_text('"ID","pmsampling:dram__bytes_read.sum"\n"","byte"\n'
                    f'"0","{per_sample.sum():,.0f} {cell(per_sample)}"\n')
    series = pm.read_series(path)
    assert list(series) == ["pmsampling:dram__bytes_read.sum"]
    values = series["pmsampling:dram__bytes_read.sum"]
    values = values[pm.active_window(series, values)]
    assert len(values) == 3 + PERIOD * LAYERS + 3 + HEAD
    text = pm.report(values, "pmsampling:dram__bytes_read.sum", 0.1 * values.max(), step_us=2.0 * len(values))
    assert "(TB/s)" in text and "after the last dip (the LM head) 4.75" in text
    # the command line picks the bytes series when the file has no PmSampling section
    assert pm.main([str(path), "--step-us", str(2.0 * len(values))]) == 0
    assert "pmsampling:dram__bytes_read.sum (TB/s)" in capsys.readouterr().out


def test_bad_options_get_a_one_line_error(tmp_path, capsys):
    for bad in (["--step-us", "0"], ["--step-us", "-5"], ["--dip", "0"], ["--dip", "1.5"]):
        with pytest.raises(SystemExit) as e:
            pm.main([str(tmp_path / "raw.csv"), *bad])
        assert e.value.code == 2
        assert capsys.readouterr().err.strip().endswith("error: want --step-us > 0 and --dip in (0, 1)")


def test_unsampled_input_and_unknown_metrics_are_refused(tmp_path):
    path = tmp_path / "raw.csv"
    path.write_text('"ID","Kernel Name","dram__bytes_read.sum"\n"","","byte"\n"0","k","7,130,000,000"\n')
    with pytest.raises(ValueError, match="--print-metric-instances values"):
        pm.read_series(path)
    dram, active = step_series()
    write_raw(path, dram, active)
    with pytest.raises(ValueError, match="matches 0 sampled metrics"):
        pm.pick(pm.read_series(path), "lts__")
    assert pm.main([str(path), "--metric", "lts__"]) == 2


def test_too_few_dips_to_fold():
    with pytest.raises(ValueError, match="too few to fold"):
        pm.fold(np.full(50, 90.0), pm.dips(np.full(50, 90.0), 10.0))
