"""Halo exchange under XLA / NCCL settings: which ones bring collective-permute to the copy ceiling.

    PYTHONPATH=. python3 benchmarks/collective_settings.py --out OUTDIR [--smoke] [--sizes 64K,16M]
        [--variants default,memcpy-p2p,...]

XLA_FLAGS and NCCL_* are read when the backend starts, so each variant runs in its own
process (this script re-runs itself with `--child VARIANT`). Each child measures, on 2 devices
and the synthetic tables of `halo_exchange.py`: the torch GPU0 -> GPU1 `copy_` (the ceiling),
a bare `ppermute`, GatherInputs and ScatterOutputs (one dispatched program each), and the
same exchanges inside one program (`fori_loop`, device time per exchange); and a checksum of the
GatherInputs result, which must equal the default's (a setting may change speed, never rows).
The table compares each variant with `default` in the same run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import _common as cm
import numpy as np

VARIANTS: dict[str, dict[str, str]] = {
    "default": {},
    # XLA: a collective-permute between devices of one process becomes a peer memcpy
    "memcpy-p2p": {"XLA_FLAGS": "--xla_gpu_use_memcpy_local_p2p=true"},
    # NCCL: more channels for point-to-point, larger NVLink chunks
    "nccl-p2p-channels": {"NCCL_MIN_P2P_NCHANNELS": "32", "NCCL_P2P_NVL_CHUNKSIZE": "2097152"},
    "nccl-simple": {"NCCL_PROTO": "Simple"},
    # NCCL: point-to-point through the copy engines (cudaMemcpy) instead of SM kernels
    "nccl-ce-memcpy": {"NCCL_P2P_USE_CUDA_MEMCPY": "1"},
}
SIZES = [64 * cm.KIB, cm.MIB, 16 * cm.MIB, 64 * cm.MIB, 256 * cm.MIB]
SMOKE_SIZES = [64 * cm.KIB]
MARK = "COLLECTIVE_SETTINGS_JSON "


def child(variant: str, sizes: list[int], iters: int, loop: int, platform: str) -> None:
    """Measure in this process (the variant's environment is already set); print one JSON line."""
    platform = cm.setup(platform)
    import jax
    from halo_exchange import FEATURES, loop_count, programs, synthetic_tables, torch_copy
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from nvalchemi_jaxbridge.lower import make_mesh

    mesh = make_mesh(2)
    out: dict[str, object] = {"variant": variant, "rows": []}
    for s in sizes:
        n_rows = s // (4 * FEATURES)
        tables = synthetic_tables(mesh, n_rows)
        n_loop = loop_count(s, loop)
        one, many = programs(mesh, tables, n_loop)
        sh = NamedSharding(mesh, P("atoms"))
        rng = np.random.default_rng(s)
        xo = jax.device_put(rng.normal(size=(2 * n_rows, FEATURES)).astype(np.float32), sh)
        xh = jax.device_put(rng.normal(size=(2 * tables.halo_rows, FEATURES)).astype(np.float32), sh)
        args = {"ppermute": (xo,), "GatherInputs": (tables, xo), "ScatterOutputs": (tables, xh)}
        row: dict[str, float | str] = {"bytes": s}
        row["copy"], _ = torch_copy(s, platform, 3, iters)
        for name in args:
            row[name] = cm.med(cm.time_jax(lambda: one[name](*args[name]), warmup=3, iters=iters))
            row[name + " looped"] = cm.med(cm.time_jax(lambda: many[name](*args[name]), warmup=1,
                                                       iters=max(3, iters // 3))) / n_loop
        g = np.asarray(one["GatherInputs"](*args["GatherInputs"]), np.float64)
        s2 = np.asarray(one["ScatterOutputs"](*args["ScatterOutputs"]), np.float64)
        row["checksum"] = f"{g.sum():.10e}/{np.abs(g).sum():.10e}/{s2.sum():.10e}"
        out["rows"].append(row)
        del tables, one, many, xo, xh
    print(MARK + json.dumps(out), flush=True)


def run_variant(name: str, argv: list[str], timeout_s: float) -> tuple[dict | None, str]:
    """Run one variant in a fresh process; its measurements, or None and the output tail."""
    env = dict(os.environ, **VARIANTS[name])
    if name != "default" and "XLA_FLAGS" in os.environ and "XLA_FLAGS" in VARIANTS[name]:
        env["XLA_FLAGS"] = os.environ["XLA_FLAGS"] + " " + VARIANTS[name]["XLA_FLAGS"]
    try:
        p = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", name, *argv], env=env,
                           capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as e:
        return None, f"timed out after {timeout_s:.0f} s: {str(e.stdout or '')[-500:]}"
    for line in p.stdout.splitlines():
        if line.startswith(MARK):
            return json.loads(line[len(MARK):]), ""
    return None, f"exit {p.returncode}: " + (p.stderr or p.stdout)[-800:].replace("\n", " | ")


def main(argv: list[str] | None = None) -> int:
    p = cm.base_parser(__doc__.splitlines()[0])
    p.add_argument("--sizes", default=None, help="bytes per direction, e.g. 64K,16M (default 64K..256M)")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma list of {list(VARIANTS)}")
    p.add_argument("--iters", type=int, default=None, help="timed calls per point (default 20, smoke 3)")
    p.add_argument("--loop", type=int, default=50, help="exchanges per program in the looped measurement")
    p.add_argument("--child", default=None, help="internal: run one variant in this process")
    p.add_argument("--timeout-s", type=float, default=240.0, help="limit per variant")
    a = p.parse_args(argv)
    from halo_exchange import _sizes

    sizes = _sizes(a.sizes) if a.sizes else (SMOKE_SIZES if a.smoke else SIZES)
    iters = a.iters or (3 if a.smoke else 20)
    loop = 5 if a.smoke else a.loop
    if a.child:
        child(a.child, sizes, iters, loop, a.platform)
        return 0
    unknown = [v for v in a.variants.split(",") if v not in VARIANTS]
    if unknown:
        p.error(f"unknown variant(s) {unknown}; choose from {list(VARIANTS)}")
    names = a.variants.split(",")
    if "default" not in names:
        names.insert(0, "default")
    platform = cm.setup(a.platform)
    settings = {"variants": "; ".join(f"{n}: {VARIANTS[n] or 'no change'}" for n in names),
                "timing": f"median of {iters} calls after 3 warm-up, wall + block_until_ready; looped: "
                          f"fori_loop of min({loop}, 1 GiB / size, >= 4) exchanges, time / count (device time)",
                "GB/s": "per direction, 1e9 B/s; ScatterOutputs moves 2x the bytes"}
    child_argv = ["--sizes", ",".join(str(s) for s in sizes), "--iters", str(iters), "--loop", str(loop),
                  "--platform", platform]
    rep = cm.Report("collective_settings", "Halo exchange under XLA / NCCL settings (2 devices)", a.out,
                    cm.context(platform), settings)
    rows = rep.table("Per exchange, each variant in its own process",
                     ["bytes/dir", "variant", "copy ceiling (us)", "ppermute (us)", "GatherInputs (us)",
                      "ScatterOutputs (us)", "Gather / ceiling", "Scatter / ceiling", "Gather vs default",
                      "looped Gather / ceiling",
                      "looped ppermute (us)", "looped Gather (us)", "looped Scatter (us)", "same rows"])
    results: dict[str, dict] = {}
    for n in names:
        res, why = run_variant(n, child_argv, a.timeout_s)
        if res is None:
            rep.note(f"**variant {n} FAILED** - {why}")
            rep.failures.append(f"{n}: {why[:200]}")
            continue
        results[n] = res
        base = {r["bytes"]: r for r in results.get("default", res)["rows"]}
        for r in res["rows"]:
            s, b = r["bytes"], base.get(r["bytes"], r)
            bw = lambda k, m=1: s * m / r[k] / 1e9  # noqa: E731
            ceil = s / r["copy"] / 1e9
            lp = lambda k: cm.us(r[k]) if k in r else "n/a"  # noqa: E731
            rep.row(rows, [cm.human_bytes(s), n, cm.us(r["copy"]), cm.us(r["ppermute"]), cm.us(r["GatherInputs"]),
                           cm.us(r["ScatterOutputs"]), f"{bw('GatherInputs') / ceil:.2f}",
                           f"{bw('ScatterOutputs', 2) / ceil:.2f}", f"{b['GatherInputs'] / r['GatherInputs']:.2f}x",
                           f"{s / r['GatherInputs looped'] / 1e9 / ceil:.2f}",
                           lp("ppermute looped"), lp("GatherInputs looped"), lp("ScatterOutputs looped"),
                           "yes" if r["checksum"] == b["checksum"] else f"NO ({r['checksum']} vs {b['checksum']})"])
            if r["checksum"] != b["checksum"]:
                rep.failures.append(f"{n}: rows differ from default at {cm.human_bytes(s)}")
    return rep.finish()


if __name__ == "__main__":
    sys.exit(main())
