"""Test world: JAX on the CPU with 8 virtual devices, float64 on, strict promotion."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TRITON_INTERPRET", "1")
# One intra-op thread per process: the suite runs 2 workers (and multi-process tests several ranks) on 2
# cores, where torch's default of a thread per core makes each op wait for a busy core (the MPNN's
# energy + forces measured 10x slower under load). Ranks, notebooks and CLI children inherit it.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# XLA:CPU's intra-op Eigen threads likewise: with 8 virtual devices per process on 2 cores they only contend
# (measured: -22 % wall and -17 % CPU time on the lowering and model-level tests).
if "xla_cpu_multi_thread_eigen" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_cpu_multi_thread_eigen=false").strip()

# The package turns on JAX's persistent compilation cache (~/.cache/nvalchemi_jaxbridge/xla, lower/cache.py); the
# suite leaves the user's cache alone unless told where (JAXBRIDGE_COMPILATION_CACHE=/some/dir shares one across
# workers and children; tests/compile_events.py counts a program read from it as a compilation, so no test weakens).
os.environ.setdefault("JAXBRIDGE_COMPILATION_CACHE", "0")

import hypothesis
import jax
import pytest

jax.config.update("jax_num_cpu_devices", 8)  # before any backend use
jax.config.update("jax_enable_x64", True)
jax.config.update("jax_numpy_rank_promotion", "raise")

hypothesis.settings.register_profile(
    "deterministic", max_examples=30, deadline=None, derandomize=True, print_blob=True
)
hypothesis.settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "deterministic"))

RTOL = {"float32": 1e-5, "float64": 1e-10}


@pytest.fixture
def keys():
    return iter(jax.random.split(jax.random.key(0), 64))


def pytest_collection_modifyitems(config, items):
    """Files holding slow or multi-process tests run first, so parallel workers start the long ones early.

    A stable sort on a per-file key: each file's tests stay together and in order (`--dist loadfile` sends
    a whole file, and its module fixtures, to one worker).
    """
    heavy = {item.path for item in items
             if item.get_closest_marker("slow") or item.get_closest_marker("multiprocess")}
    items.sort(key=lambda item: item.path not in heavy)
