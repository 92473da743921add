"""The main job gives malloc's freed pages back at each host check (issue 29: its RSS grew ~0.24 MB per step
on the torch FFI path, 8 CPU devices; benchmarks/run_soak.py measures the whole job, RESULTS.md)."""

from __future__ import annotations

from nvalchemi_jaxbridge.app import run_config, simulate
from nvalchemi_jaxbridge.kernels import host_memory


def test_the_job_gives_freed_host_memory_back_at_each_host_check(monkeypatch):
    calls: list[int] = []
    monkeypatch.setattr(host_memory, "release_freed_host_memory", lambda: calls.append(1) or True)
    report = simulate.run(run_config.RunConfig(kernel="torch", cells=2, devices=2, steps=25, check_every=10))
    assert report.ok and report.call_path == "ffi"
    assert len(calls) == report.host_checks >= 3  # steps 10, 20 and the last


def test_release_reports_what_glibc_did():
    """True or False from malloc_trim, never an error; False where the C library has no malloc_trim."""
    got = host_memory.release_freed_host_memory()
    assert isinstance(got, bool)
    assert got is False or host_memory._trim() is not None
