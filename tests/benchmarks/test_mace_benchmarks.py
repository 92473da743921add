"""benchmarks/mace_interleaved.py runs end to end on the CPU, in this process (needs mace-torch: the `mlip` extra).

It checks the bridge's energy (float64 node sums) and forces against native MACE before it writes a row,
and stops on a mismatch; here both dtypes run at the smoke size and every row must carry its timings,
the parity and the JAX program's bytes (from the compiled program's memory analysis).
"""

from __future__ import annotations

import pathlib
import sys

import pytest

pytest.importorskip("mace", reason="mace-torch is in the mlip extra")
ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import mace_interleaved  # noqa: E402


def test_mace_interleaved_smoke_checks_and_times_both_dtypes(tmp_path):
    assert mace_interleaved.main(["--platform", "cpu", "--smoke", "--out", str(tmp_path)]) == 0
    rows = [r for r in (tmp_path / "mace_interleaved.md").read_text().splitlines() if r.startswith("| - |")]
    assert [r.split("|")[2].strip() for r in rows] == ["float32", "float64"]
    for row in rows:
        cells = [c.strip() for c in row.split("|")[1:-1]]
        assert float(cells[4]) > 0 and float(cells[5]) > 0 and cells[6].endswith("x")
        assert "MISMATCH" not in cells[9]
        assert float(cells[10].split("JAX program")[1].strip(" )")) > 0  # bytes of the E+F program
