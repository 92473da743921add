"""First call: where a cold single point spends its time, the test MACE through the ASE calculator.

Each run is a fresh process (`python -m benchmarks.first_call DEVICES MODEL_FILE`): imports, the model file's
load (the tests' MACE, `random_mace([29, 79], max_ell=2)`, saved once with `torch.save`), the FFI library
(built or found), the calculator, then the first single point (energy, forces, stress of 108 atoms of
triclinic Cu/Au) split into the layout (`prepare`), tracing, lowering, XLA compilation and reads from the
persistent compilation cache (JAX's own compile events), and a second single point. Two processes share a
fresh cache folder: the first finds it empty (cold), the second finds the first's programs (warm). The smoke
run times the phases in this process instead (imports and compilations already warm: it checks the path).
"""

from __future__ import annotations

import time

T0 = time.perf_counter()

import collections  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import pathlib  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402

MARK = "FIRST_CALL_JSON "
EVENTS = {"/jax/core/compile/jaxpr_trace_duration": "tracing",
          "/jax/core/compile/jaxpr_to_mlir_module_duration": "lowering",
          "/jax/core/compile/backend_compile_duration": "XLA compilation",
          "/jax/compilation_cache/cache_retrieval_time_sec": "cache reads"}
ORDER = ["imports", "model file load", "FFI library (build or find)", "calculator", "first single point",
         "  layout (prepare)", "  tracing", "  lowering", "  XLA compilation", "  cache reads",
         "  rest (running, host work)", "second single point", "total since start"]


def phases(devices: int, model_file: pathlib.Path, t_start: float) -> dict[str, float]:
    """Seconds of each phase of a first and a second single point, in this process."""
    import jax
    import torch

    from nvalchemi_jaxbridge.integrations import JaxBridgeCalculator
    from nvalchemi_jaxbridge.kernels.ffi.target import load
    from nvalchemi_jaxbridge.mlip import DistributedMLIP
    from nvalchemi_jaxbridge.mlip.mace import MACEWrapper, random_mace
    from tests.mlip.cases import structure

    out = {"imports": time.perf_counter() - t_start}
    if not model_file.exists():  # the tests' MACE, saved once as a user's model file
        torch.save(random_mace([29, 79], max_ell=2), model_file)
    t = time.perf_counter()
    mace = torch.load(model_file, weights_only=False)
    if jax.default_backend() == "gpu":  # the model follows the devices JAX runs on
        mace = mace.to("cuda")
    out["model file load"] = time.perf_counter() - t
    t = time.perf_counter()
    load()
    out["FFI library (build or find)"] = time.perf_counter() - t
    t = time.perf_counter()
    calc = JaxBridgeCalculator(DistributedMLIP(MACEWrapper(mace), n_devices=devices))
    out["calculator"] = time.perf_counter() - t
    events: dict[str, float] = collections.defaultdict(float)

    def listener(event: str, duration: float, **_: object) -> None:
        if event in EVENTS:
            events[EVENTS[event]] += duration

    jax.monitoring.register_event_duration_secs_listener(listener)
    model = calc.potential
    prepare = model.prepare

    def timed_prepare(*a, **k):
        t = time.perf_counter()
        try:
            return prepare(*a, **k)
        finally:
            events["layout (prepare)"] += time.perf_counter() - t

    model.prepare = timed_prepare
    try:
        atoms = structure("small").copy()  # 108 atoms, triclinic Cu/Au
        atoms.calc = calc
        for name in ("first single point", "second single point"):
            if name.startswith("second"):
                atoms.positions += 0.01
                first = dict(events)
            t = time.perf_counter()
            atoms.get_potential_energy(), atoms.get_forces(), atoms.get_stress()
            out[name] = time.perf_counter() - t
    finally:
        model.prepare = prepare
        unregister = getattr(jax.monitoring, "unregister_event_duration_listener", None)
        if unregister is not None:
            unregister(listener)
    for k in ("layout (prepare)", "tracing", "lowering", "XLA compilation", "cache reads"):
        out[f"  {k}"] = first.get(k, 0.0)
    out["  rest (running, host work)"] = out["first single point"] - sum(first.values())
    out["total since start"] = time.perf_counter() - t_start
    return out


def _child(devices: int, model_file: pathlib.Path, cache: str, platform: str) -> dict[str, float]:
    from benchmarks import common as cm

    env = dict(os.environ, JAXBRIDGE_COMPILATION_CACHE=cache, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
               PYTHONPATH=os.pathsep.join(filter(None, [str(cm.ROOT), os.environ.get("PYTHONPATH")])))
    cmd = [sys.executable, "-m", "benchmarks.first_call", str(devices), str(model_file), platform]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith(MARK)]
    if p.returncode or not lines:
        raise RuntimeError(f"first call: the process exited {p.returncode}: " + (p.stderr or p.stdout)[-800:])
    return json.loads(lines[-1][len(MARK):])


def run(rep, opt) -> None:
    import jax

    from benchmarks import common as cm

    devices = 2 if opt.smoke else (len(jax.devices()) if opt.platform == "gpu" else 8)
    table = rep.table(f"The first single point: the test MACE through the ASE calculator, 108 atoms, {devices} "
                      "device(s), seconds", ["phase", "cold (first process, empty cache)", "warm cache (second process)"])
    with tempfile.TemporaryDirectory() as tmp:
        model_file = pathlib.Path(tmp) / "mace.pt"
        if opt.smoke:
            import torch

            from benchmarks.mlip import build_model

            rep.setting("first call", "smoke: phases timed in this process (imports done, caches as they are)")
            torch.save(build_model("float64", "e3nn", "cpu", True), model_file)  # the tests' MACE, built once
            runs = [phases(devices, model_file, time.perf_counter()), {}]
        else:
            import torch

            from nvalchemi_jaxbridge.mlip.mace import random_mace

            rep.setting("first call", f"two fresh processes sharing a fresh compilation cache folder, {devices} device(s)")
            torch.save(random_mace([29, 79], max_ell=2), model_file)  # made here, so both processes only load it
            cache = str(pathlib.Path(tmp) / "xla")
            runs = [_child(devices, model_file, cache, opt.platform) for _ in range(2)]
    for k in ORDER:
        table.add(k.strip() if not k.startswith("  ") else f"- {k.strip()}",
                  *(f"{r[k]:.2f}" if k in r else "-" for r in runs))
    if not opt.smoke:
        a, b = runs[0]["first single point"], runs[1]["first single point"]
        rep.note(f"Warm cache: the first single point {cm.ratio(a, b)} faster ({a:.1f} s -> {b:.1f} s).")


if __name__ == "__main__":
    devices, model_file, platform = int(sys.argv[1]), pathlib.Path(sys.argv[2]), sys.argv[3]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
    from benchmarks import common as cm

    cm.setup(platform, cpu_devices=devices)
    print(MARK + json.dumps(phases(devices, model_file, T0)), flush=True)
