"""The layout layer loads without jax or torch."""

import subprocess
import sys


def test_layout_imports_neither_jax_nor_torch():
    code = (
        "import sys, nvalchemi_jaxbridge.layout as l; "
        "l.HaloPlan, l.ShardPlan, l.choose_grid; "
        "print(sorted(m for m in ('jax', 'torch') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
