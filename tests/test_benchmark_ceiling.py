"""benchmarks/cpu_adam.py's bandwidth ceiling: a ceiling that cannot be one (stalled, not measured, or beaten by a
candidate of the same rounds) is reported as invalid, never as "228.9% of 0.0 GB/s"."""

import importlib.util
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location(
    "bench_cpu_adam", Path(__file__).resolve().parents[1] / "benchmarks" / "cpu_adam.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)

WHERE = dict(path="fp32", elements=10**6, threads=2)
BYTES = {"zero_offload": 28, "torch AdamW fused": 28}


def rows(seconds_ours, seconds_torch, ceiling_rounds):
    times = {"zero_offload": [seconds_ours] * 3, "torch AdamW fused": [seconds_torch] * 3}
    return bench.point_rows("median", WHERE, times, BYTES, ceiling_rounds)


def test_a_valid_ceiling_gives_fractions():
    out = rows(2e-3, 4e-3, [20.0, 21.0, 19.0])  # ours 14 GB/s, torch 7 GB/s, ceiling 20 GB/s
    assert [r["ceiling_problem"] for r in out] == [None, None]
    assert out[0]["fraction_of_ceiling"] == pytest.approx(0.7)
    assert out[1]["fraction_of_ceiling"] == pytest.approx(0.35)


@pytest.mark.parametrize("ceiling_rounds, why", [
    ([0.0, 0.0, 0.0], "not measured"),
    ([0.01, 0.02, 0.03], "implausibly low"),
    ([5.0, 5.0, 5.0], "zero_offload ran at 2.8x it"),  # ours 14 GB/s against a 5 GB/s "ceiling"
])
def test_an_invalid_ceiling_is_reported_as_such(ceiling_rounds, why, capsys):
    out = rows(2e-3, 4e-3, ceiling_rounds)
    assert all(why in r["ceiling_problem"] for r in out), out[0]["ceiling_problem"]
    assert all(r["fraction_of_ceiling"] is None and r["ceiling_gb_per_s"] is None for r in out)
    bench.print_rows(out)
    text = capsys.readouterr().out
    assert "(ceiling invalid)" in text and "bandwidth ceiling invalid here" in text and "% of" not in text
    md = bench.markdown(out, dict(cpu="cpu", cores=2, features="", torch="t", kernel_path="avx2"))
    assert "n/a (ceiling invalid)" in md and why in md
