"""Exchange under XLA / NCCL settings: does any bring collective-permute to the copy ceiling? (2 devices)

XLA_FLAGS and NCCL_* are read when the backend starts, so each variant runs in a process of its own
(`python -m benchmarks.exchange_settings VARIANT ...`, one JSON line back). Each measures, on the
synthetic tables of `exchange.py`, the GPU 0 -> GPU 1 copy (the ceiling), a bare ppermute, GatherInputs and
ScatterOutputs per dispatch and inside one program, and a checksum of their results, which must equal the
default's: a setting may change the speed, never the rows. The smoke run measures the default alone, in
this process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np

from benchmarks import common as cm  # noqa: E402

VARIANTS: dict[str, dict[str, str]] = {
    "default": {},
    "memcpy-p2p": {"XLA_FLAGS": "--xla_gpu_use_memcpy_local_p2p=true"},  # collective-permute as a peer memcpy
    "nccl-p2p-channels": {"NCCL_MIN_P2P_NCHANNELS": "32", "NCCL_P2P_NVL_CHUNKSIZE": "2097152"},
    "nccl-simple": {"NCCL_PROTO": "Simple"},
    "nccl-ce-memcpy": {"NCCL_P2P_USE_CUDA_MEMCPY": "1"},  # point-to-point on the copy engines
}
SIZES = [64 * cm.KIB, cm.MIB, 16 * cm.MIB, 256 * cm.MIB]
MARK = "EXCHANGE_SETTINGS_JSON "


def measure(variant: str, sizes: list[int], iters: int, loop: int, platform: str) -> dict:
    """The variant's times and checksums in this process (its environment already set)."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from benchmarks.exchange import FEATURES, loop_count, programs, synthetic_tables, torch_copy
    from nvalchemi_jaxbridge.lower import make_mesh

    mesh = make_mesh(2)
    out: dict = {"variant": variant, "rows": []}
    for s in sizes:
        tables = synthetic_tables(mesh, s // (4 * FEATURES))
        n_loop = loop_count(s, loop)
        one, many = programs(mesh, tables, n_loop)
        sh, rng = NamedSharding(mesh, P("atoms")), np.random.default_rng(s)
        xo = jax.device_put(rng.normal(size=(2 * tables.owned_capacity, FEATURES)).astype(np.float32), sh)
        xh = jax.device_put(rng.normal(size=(2 * tables.halo_rows, FEATURES)).astype(np.float32), sh)
        args = {"ppermute": (xo,), "GatherInputs": (tables, xo), "ScatterOutputs": (tables, xh)}
        row: dict = {"bytes": s, "copy": torch_copy(s, platform, 3, iters)[0]}
        row.update(cm.medians({k: (lambda f=one[k], a=a: f(*a), cm.jax_sync) for k, a in args.items()},
                              warmup=3, iters=iters))
        row.update({k + " looped": v / n_loop for k, v in cm.medians(
            {k: (lambda f=many[k], a=a: f(*a), cm.jax_sync) for k, a in args.items()},
            warmup=1, iters=max(3, iters // 3)).items()})
        g = np.asarray(one["GatherInputs"](*args["GatherInputs"]), np.float64)
        s2 = np.asarray(one["ScatterOutputs"](*args["ScatterOutputs"]), np.float64)
        row["checksum"] = f"{g.sum():.10e}/{np.abs(g).sum():.10e}/{s2.sum():.10e}"
        out["rows"].append(row)
    return out


def _child(name: str, sizes: list[int], iters: int, loop: int, platform: str, timeout_s: float) -> tuple[dict | None, str]:
    env = dict(os.environ, **VARIANTS[name],
               PYTHONPATH=os.pathsep.join(filter(None, [str(cm.ROOT), os.environ.get("PYTHONPATH")])))
    if "XLA_FLAGS" in VARIANTS[name] and os.environ.get("XLA_FLAGS"):
        env["XLA_FLAGS"] = os.environ["XLA_FLAGS"] + " " + VARIANTS[name]["XLA_FLAGS"]
    cmd = [sys.executable, "-m", "benchmarks.exchange_settings", name, ",".join(map(str, sizes)), str(iters),
           str(loop), platform]
    try:
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return None, f"timed out after {timeout_s:.0f} s"
    for line in p.stdout.splitlines():
        if line.startswith(MARK):
            return json.loads(line[len(MARK):]), ""
    return None, f"exit {p.returncode}: " + (p.stderr or p.stdout)[-600:].replace("\n", " | ")


def run(rep: cm.Report, opt) -> None:
    import jax

    if len(jax.devices()) < 2:
        rep.note("Exchange settings: not run, they need 2 devices.")
        return
    sizes = opt.sizes_for("exchange", [64 * cm.KIB] if opt.smoke else SIZES)
    iters, loop = opt.repeats_or(20, 3), 5 if opt.smoke else 50
    names = ["default"] if opt.smoke else list(VARIANTS)
    rep.setting("settings variants", "; ".join(f"{n}: {VARIANTS[n] or 'no change'}" for n in names)
                + ("" if not opt.smoke else " (smoke: the default alone, in this process)"))
    table = rep.table("Exchanges under XLA / NCCL settings, each variant in its own process (2 devices)",
                      ["bytes/dir", "variant", "copy ceiling (us)", "ppermute (us)", "GatherInputs (us)",
                       "ScatterOutputs (us)", "GatherInputs vs default", "looped GatherInputs / ceiling",
                       "looped ppermute / ceiling", "same rows as default"])
    base: dict[int, dict] = {}
    for n in names:
        if rep.time_left() < 0:
            rep.note(f"Exchange settings: {n} and later variants not run (budget spent).")
            break
        if opt.smoke:
            res, why = measure(n, sizes, iters, loop, opt.platform), ""
        else:
            res, why = _child(n, sizes, iters, loop, opt.platform, timeout_s=240)
        if res is None:
            rep.fail(f"settings variant {n}: {why}")
            continue
        for r in res["rows"]:
            s = r["bytes"]
            b = base.setdefault(s, r)
            ceil = s / r["copy"]
            same = r["checksum"] == b["checksum"]
            table.add(cm.human_bytes(s), n, cm.us(r["copy"]), cm.us(r["ppermute"]), cm.us(r["GatherInputs"]),
                      cm.us(r["ScatterOutputs"]), cm.ratio(b["GatherInputs"], r["GatherInputs"]),
                      f"{s / r['GatherInputs looped'] / ceil:.2f}", f"{s / r['ppermute looped'] / ceil:.2f}",
                      "yes" if same else "NO")
            if not same:
                rep.fail(f"settings variant {n}: rows differ from the default's at {cm.human_bytes(s)}")


if __name__ == "__main__":
    variant, sizes, iters, loop, platform = sys.argv[1:6]
    platform = cm.setup(platform)
    res = measure(variant, [int(s) for s in sizes.split(",")], int(iters), int(loop), platform)
    print(MARK + json.dumps(res), flush=True)
