"""The persistent compilation cache (lower/cache.py), each case in a fresh process: JAX's configuration is global."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]

_CHILD = r"""
import json, sys, jax
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)  # cache even this small program
if sys.argv[1] == "user":
    jax.config.update("jax_compilation_cache_dir", sys.argv[2])
from nvalchemi_jaxbridge.lower.cache import enable_compilation_cache
where = enable_compilation_cache()
events = []
jax.monitoring.register_event_duration_secs_listener(lambda e, d, **_: events.append(e))
x = jax.jit(lambda a: (a @ a.T).sum() * 3.0)(jax.numpy.ones((7, 5)))
print(json.dumps({"where": None if where is None else str(where), "config": jax.config.jax_compilation_cache_dir,
                  "compiled": events.count("/jax/core/compile/backend_compile_duration"),
                  "read": events.count("/jax/compilation_cache/cache_retrieval_time_sec")}))
"""


def _child(env_value: str | None, mode: str = "env", user_dir: str = "") -> dict:
    env = {k: v for k, v in os.environ.items() if k != "JAXBRIDGE_COMPILATION_CACHE"}
    env["PYTHONPATH"] = str(ROOT)
    if env_value is not None:
        env["JAXBRIDGE_COMPILATION_CACHE"] = env_value
    out = subprocess.run([sys.executable, "-c", _CHILD, mode, user_dir], env=env, capture_output=True, text=True,
                         timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_second_process_reads_the_first_ones_programs(tmp_path):
    first = _child(str(tmp_path / "xla"))
    assert first["where"] == first["config"] == str(tmp_path / "xla")
    assert first["compiled"] >= 1 and first["read"] == 0 and any((tmp_path / "xla").iterdir())
    second = _child(str(tmp_path / "xla"))
    # JAX's compile event spans the cache read too: every program of the second process came from the disk
    assert second["read"] == second["compiled"] == first["compiled"]


def test_opt_out_and_the_users_own_cache_are_left_alone(tmp_path):
    off = _child("0")
    assert off["where"] is None and off["config"] is None and off["read"] == 0
    mine = _child(str(tmp_path / "ours"), mode="user", user_dir=str(tmp_path / "mine"))
    assert mine["where"] == mine["config"] == str(tmp_path / "mine") and not (tmp_path / "ours").exists()
