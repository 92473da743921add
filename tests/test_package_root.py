"""The package root: spec names eagerly, runtime names lazily, nothing heavy at import."""

import subprocess
import sys

import pytest

import nvalchemi_jaxbridge as jb


@pytest.mark.parametrize(
    ("name", "module"),
    [
        ("compile", "nvalchemi_jaxbridge.kernels"),
        ("make_mesh", "nvalchemi_jaxbridge.lower"),
        ("CompiledSpec", "nvalchemi_jaxbridge.lower"),
        ("HaloPlan", "nvalchemi_jaxbridge.layout"),
        ("ShardPlan", "nvalchemi_jaxbridge.layout"),
        ("HaloOverflowError", "nvalchemi_jaxbridge.layout"),
        ("ShardTensor", "nvalchemi_jaxbridge.torch"),
    ],
)
def test_lazy_names_are_the_layers_objects(name, module):
    import importlib

    assert getattr(jb, name) is getattr(importlib.import_module(module), name)
    assert name in dir(jb)


def test_unknown_attribute_names_the_package():
    with pytest.raises(AttributeError, match=r"nvalchemi_jaxbridge.*'no_such_name'"):
        jb.no_such_name  # noqa: B018


def test_root_import_loads_no_runtime_layer():
    code = (
        "import sys, nvalchemi_jaxbridge as jb; jb.OpAdapter; "
        "bad = [m for m in ('jax', 'torch', 'numpy', 'nvalchemi_jaxbridge.lower') if m in sys.modules]; "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
