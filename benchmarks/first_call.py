"""Where a cold single point spends its time: the test MACE through the ASE calculator, in a fresh process.

    python benchmarks/first_call.py [--devices 8] [--no-cache]

Prints one line per phase (seconds): imports, the model file's load, the FFI library (built or found),
the calculator, then the first single point split into the layout (`prepare`), tracing, lowering, XLA
compilation and reads from the persistent compilation cache (JAX's own compile events), and a second
single point. Run it twice: the second process finds the first one's programs in the cache
(`~/.cache/nvalchemi_jaxbridge/xla`, or `$JAXBRIDGE_COMPILATION_CACHE`; `--no-cache` sets it to 0).
"""

from __future__ import annotations

import time

T0 = time.perf_counter()

import argparse  # noqa: E402
import collections  # noqa: E402
import os  # noqa: E402
import pathlib  # noqa: E402
import sys  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--devices", type=int, default=8)
    p.add_argument("--no-cache", action="store_true", help="JAXBRIDGE_COMPILATION_CACHE=0")
    p.add_argument("--model-file", type=pathlib.Path, default=pathlib.Path("/tmp/jaxbridge_test_mace.pt"))
    args = p.parse_args()
    if args.no_cache:
        os.environ["JAXBRIDGE_COMPILATION_CACHE"] = "0"
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import jax

    jax.config.update("jax_num_cpu_devices", args.devices)
    jax.config.update("jax_enable_x64", True)
    import torch

    from nvalchemi_jaxbridge.integrations import JaxBridgeCalculator
    from nvalchemi_jaxbridge.mlip import DistributedMLIP
    from nvalchemi_jaxbridge.mlip.mace import MACEWrapper
    from tests.mlip.cases import structure

    phases: dict[str, float] = {"imports": time.perf_counter() - T0}
    if not args.model_file.exists():  # the tests' MACE (tests/mlip/cases.py), saved once as a user's model file
        from nvalchemi_jaxbridge.mlip.mace import random_mace

        torch.save(random_mace([29, 79], max_ell=2), args.model_file)
    t = time.perf_counter()
    mace = torch.load(args.model_file, weights_only=False)
    phases["model file load"] = time.perf_counter() - t
    t = time.perf_counter()
    from nvalchemi_jaxbridge.kernels.ffi.target import load

    load()
    phases["FFI library (build or find)"] = time.perf_counter() - t
    t = time.perf_counter()
    calc = JaxBridgeCalculator(DistributedMLIP(MACEWrapper(mace), n_devices=args.devices))
    phases["calculator"] = time.perf_counter() - t

    events: dict[str, float] = collections.defaultdict(float)
    names = {"/jax/core/compile/jaxpr_trace_duration": "tracing",
             "/jax/core/compile/jaxpr_to_mlir_module_duration": "lowering",
             "/jax/core/compile/backend_compile_duration": "XLA compilation",
             "/jax/compilation_cache/cache_retrieval_time_sec": "cache reads"}

    def listener(event: str, duration: float, **_: object) -> None:
        if event in names:
            events[names[event]] += duration

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
    atoms = structure("small").copy()  # 108 atoms, triclinic Cu/Au
    atoms.calc = calc
    t = time.perf_counter()
    atoms.get_potential_energy(), atoms.get_forces(), atoms.get_stress()
    first = time.perf_counter() - t
    atoms.positions += 0.01
    t = time.perf_counter()
    atoms.get_potential_energy(), atoms.get_forces(), atoms.get_stress()
    second = time.perf_counter() - t
    print(f"jax {jax.__version__}, torch {torch.__version__}, {args.devices} CPU devices, cache "
          f"{jax.config.jax_compilation_cache_dir or 'off'}")
    for k, v in phases.items():
        print(f"{k:32s} {v:7.2f} s")
    print(f"{'first single point':32s} {first:7.2f} s")
    for k, v in events.items():
        print(f"  {k:30s} {v:7.2f} s")
    print(f"  {'rest (running, host work)':30s} {first - sum(events.values()):7.2f} s")
    print(f"{'second single point':32s} {second:7.2f} s")
    print(f"{'total since start':32s} {time.perf_counter() - T0:7.2f} s")


if __name__ == "__main__":
    main()
