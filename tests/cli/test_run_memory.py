"""The main job's host memory stays flat (issue 29: its RSS grew ~0.24 MB per step on the torch FFI path, 8 CPU
devices; benchmarks/run_soak.py measures the whole job, RESULTS.md). The mechanisms are checked here: malloc maps
large blocks and gives freed pages back, and the job's record holds no device value per step once pulled."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import types
import weakref

import numpy as np
import pytest

from nvalchemi_jaxbridge.app import cli, outputs, simulate
from nvalchemi_jaxbridge.kernels import host_memory

_GLIBC = sys.platform.startswith("linux") and os.confstr("CS_GNU_LIBC_VERSION") is not None

_THP = "/sys/kernel/mm/transparent_hugepage/enabled"
_huge = os.path.exists(_THP) and "[never]" not in open(_THP).read()  # huge pages where asked for (madvise)

_PROBE = """
import ctypes, importlib.util, sys
spec = importlib.util.spec_from_file_location("host_memory", sys.argv[1])
hm = importlib.util.module_from_spec(spec)
spec.loader.exec_module(hm)
class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL(None)
libc.mallinfo2.restype = Info
libc.malloc.restype, libc.malloc.argtypes, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_size_t], [ctypes.c_void_p]
if sys.argv[2] == "map" and not hm.map_large_blocks():
    sys.exit("mallopt refused")
libc.free(libc.malloc(16 << 20))  # left alone, glibc raises its mmap threshold to 16 MiB here
before = libc.mallinfo2().hblkhd
block = libc.malloc(8 << 20)
print(libc.mallinfo2().hblkhd - before >= 8 << 20)  # the 8 MiB block is a mapping of its own (freed = unmapped)
libc.free(block)
if sys.argv[2] == "map" and sys.argv[3] == "huge":  # torch's large blocks in huge pages: far fewer page faults
    import resource, torch
    start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(8):
        torch.ones(4 << 20).sum()  # 16 MiB, freed at once: 4096 pages of 4 KiB, each a fault when mapped afresh
    print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - start) / 8 < 1024)
"""


@pytest.mark.skipif(not _GLIBC, reason="glibc's malloc settings (mallopt, mallinfo2)")
def test_after_map_large_blocks_a_large_block_is_mapped_even_after_a_larger_one_was_freed():
    """Without the setting glibc raises its threshold on a free and serves the next large block from an arena,
    where its pages stay once freed (the control); with it, the block is mapped (a fresh process each)."""

    def probe(how: str) -> list[str]:
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("MALLOC_", "GLIBC_TUNABLES", "THP_MEM_ALLOC_ENABLE"))}
        out = subprocess.run([sys.executable, "-c", _PROBE, host_memory.__file__, how, "huge" if _huge else "-"],
                             capture_output=True, text=True, timeout=120, env=env)
        assert out.returncode == 0, out.stderr
        return out.stdout.split()

    assert probe("default") == ["False"]
    assert probe("map") == (["True", "True"] if _huge else ["True"])


def test_the_cli_job_maps_large_blocks_first_and_gives_freed_host_memory_back_at_each_host_check(
        monkeypatch, tmp_path, capsys):
    calls: list[str] = []
    monkeypatch.setattr(host_memory, "release_freed_host_memory", lambda: calls.append("trim") or True)
    monkeypatch.setattr(host_memory, "map_large_blocks", lambda: calls.append("map") or True)
    steps = []
    run = simulate.run
    monkeypatch.setattr(simulate, "run", lambda config, **kw: steps.append(calls.copy()) or run(config, **kw))
    report = tmp_path / "report.json"
    code = cli.main(["run", "--kernel", "torch", "--cells", "2", "--devices", "2", "--steps", "25", "--quiet",
                     "--json-report", str(report)])
    assert code == 0, capsys.readouterr()
    got = json.loads(report.read_text())
    assert got["call_path"] == "ffi"
    assert steps == [["map"]]  # once, before the job starts
    assert calls.count("trim") == got["host_checks"] >= 3  # steps 10, 20 and the last


def test_release_reports_what_glibc_did():
    """True or False from malloc_trim, never an error; False where the C library has no malloc_trim."""
    got = host_memory.release_freed_host_memory()
    assert isinstance(got, bool)
    assert got is False or host_memory._trim() is not None


def test_the_record_holds_no_step_value_once_pulled_and_replays_like_a_plain_list():
    """Each step's device value is dropped at the pull (a kept one grew the job by one array per step); the
    host rows, across a truncate and the steps run again, are those of a plain list of every step."""
    import jax.numpy as jnp

    cfg = types.SimpleNamespace(steps=9, trajectory=None, thermo=None)
    rec = outputs.Recorder(cfg, types.SimpleNamespace(n_atoms=4), 1.0)
    plain: list[list[float]] = []

    def step(i: int, value: float) -> weakref.ref:
        v = jnp.array([value, 2.0 * value, 0.0])
        rec.step(i, None, None, v)
        del plain[i - 1:]
        plain.append([value, 2.0 * value, 0.0])
        return weakref.ref(v)

    refs = [step(i, float(i)) for i in range(1, 6)]
    np.testing.assert_array_equal(rec.pull(), plain)
    refs += [step(i, 10.0 * i) for i in (6, 7)]
    rec.truncate(4)  # steps 5-7 are run again (5 was pulled, 6 and 7 not yet)
    del plain[4:]
    refs += [step(i, 100.0 * i) for i in (5, 6, 7, 8, 9)]
    np.testing.assert_array_equal(rec.pull(), plain)
    gc.collect()
    assert [r() for r in refs] == [None] * len(refs)
