"""Exchange: the halo exchanges against the interconnect's ceiling, on two devices.

For messages of 64 KiB .. 256 MiB per direction: the ceiling (a torch `copy_` from GPU 0 to GPU 1, CUDA
events; a memcpy on the CPU), a bare jitted `ppermute` of the same bytes, and the library's exchanges
(`lower.collectives`): GatherInputs (`halo_forward`), the reverse exchange and ScatterOutputs (reverse then
forward: twice the bytes), on synthetic tables with one message per direction of exactly the size. Each is
timed per dispatch (one program per exchange: latency and host work included) and inside one program (a
`fori_loop` of exchanges, time / count: the device time of one exchange, which is what compares with the
copy). Then the same exchanges on a layout `HaloPlan` of random atoms, checked against the plan's numpy
reference. GB/s are per direction (bytes one device sends / time), 1 GB = 1e9 B.
"""

from __future__ import annotations

import types

import numpy as np

from benchmarks import common as cm

SIZES = [64 * cm.KIB, 256 * cm.KIB, cm.MIB, 4 * cm.MIB, 16 * cm.MIB, 64 * cm.MIB, 256 * cm.MIB]
FEATURES = 4  # float32 per row: 16-byte rows, so every size is a whole number of rows
AXIS = "atoms"
LOOP_BYTES = 1 << 30  # bytes per direction one looped program moves at most


def loop_count(nbytes: int, loop: int) -> int:
    """Exchanges per looped program: `loop` for small messages, fewer for large ones (at least 4)."""
    return max(4, min(loop, LOOP_BYTES // max(nbytes, 1)))


def gbps(nbytes: float, seconds: float) -> float:
    """Decimal GB/s (NaN without a time)."""
    return nbytes / seconds / 1e9 if seconds == seconds and seconds > 0 else float("nan")


def synthetic_tables(mesh, rows: int):
    """Tables for 2 devices: device d sends its `rows` owned rows to 1 - d, one message each way."""
    from nvalchemi_jaxbridge.lower.tables import device_tables

    d, oc, gc = len(mesh.devices.flat), rows, rows + 1  # one inert padding row, as in a real plan
    hr = oc + gc
    plan = types.SimpleNamespace(  # the fields of a layout HaloPlan that device_tables reads
        n_devices=d, owned_capacity=oc, ghost_capacity=gc, halo_rows=hr, offsets=(1 % d,), pair_capacities=(rows,),
        send_idx=(np.tile(np.arange(rows, dtype=np.int32), (d, 1)),),
        recv_slot=(np.tile(oc + np.arange(rows, dtype=np.int32), (d, 1)),),
        halo_offset=np.zeros((d, hr, 3), np.float32), owned_offset=np.zeros((d, oc, 3), np.float32),
        owned_mask=np.ones((d, oc), bool), halo_owned_mask=np.tile(np.arange(hr) < oc, (d, 1)),
        n_owned=np.full(d, oc, np.int32), n_ghost=np.full(d, rows, np.int32))
    return device_tables(plan, mesh, blocks=True)


_PROGRAMS: dict = {}


def programs(mesh, tables, loop: int):
    """Jitted programs (per dispatch, looped): ppermute, GatherInputs, reverse, ScatterOutputs.

    Made once per mesh, table shapes and loop count, so the exchange questions' parts share their compilations.
    """
    import jax

    leaves, tree = jax.tree.flatten(tables)
    key = (tuple(mesh.devices.flat), str(tree), tuple(getattr(x, "shape", x) for x in leaves), loop)
    if key not in _PROGRAMS:
        _PROGRAMS[key] = _programs(mesh, tables, loop)
    return _PROGRAMS[key]


def _programs(mesh, tables, loop: int):
    import jax
    from jax.sharding import PartitionSpec as P

    from nvalchemi_jaxbridge.lower import collectives as C

    oc, ts, pairs = tables.owned_capacity, tables.specs(AXIS), [(0, 1), (1, 0)]

    def sm(f, with_tables=True):
        return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(ts, P(AXIS)) if with_tables else (P(AXIS),),
                                     out_specs=P(AXIS)))

    one = {"ppermute": sm(lambda x: jax.lax.ppermute(x, AXIS, pairs), with_tables=False),
           "GatherInputs": sm(lambda t, x: C.halo_forward(x, t, AXIS)),
           "reverse": sm(lambda t, x: C.halo_reverse(x, t, AXIS)),
           "ScatterOutputs": sm(lambda t, x: C.halo_scatter(x, t, AXIS))}

    def looped(step, with_tables=True):
        if with_tables:
            return sm(lambda t, x: jax.lax.fori_loop(0, loop, lambda i, c: step(t, c), x))
        return sm(lambda x: jax.lax.fori_loop(0, loop, lambda i, c: step(None, c), x), with_tables=False)

    many = {  # each iteration sends what the previous one received, so no exchange can be dropped
        "ppermute": looped(lambda t, c: jax.lax.ppermute(c, AXIS, pairs), with_tables=False),
        "GatherInputs": looped(lambda t, c: C.halo_forward(c, t, AXIS)[oc: 2 * oc]),
        "reverse": looped(lambda t, c: C.halo_forward(C.halo_reverse(c, t, AXIS), t, AXIS) * 0.5),  # + forward
        "ScatterOutputs": looped(lambda t, c: C.halo_scatter(c, t, AXIS) * 0.5)}
    return one, many


def torch_copy(nbytes: int, platform: str, warmup: int, iters: int) -> tuple[float, str]:
    """Median seconds of one GPU 0 -> GPU 1 `copy_` of `nbytes` (a memcpy on the CPU), and how it was timed."""
    import torch

    n = nbytes // 4
    if platform == "cpu":
        src, dst = torch.ones(n), torch.empty(n)
        return cm.med(cm.time_interleaved({"": (lambda: dst.copy_(src), lambda _: None)}, warmup=warmup,
                                          iters=iters)[""]), "CPU memcpy (wall)"
    src, dst = torch.ones(n, device="cuda:0"), torch.empty(n, device="cuda:1")
    with torch.cuda.device(0):  # a peer copy runs on the source device's current stream
        ts = cm.time_events(lambda: dst.copy_(src), warmup=warmup, iters=iters, device="cuda:0")
    torch.cuda.synchronize(1)
    del src, dst
    torch.cuda.empty_cache()
    return cm.med(ts), "CUDA events"


def run(rep: cm.Report, opt) -> None:
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from nvalchemi_jaxbridge.lower import make_mesh

    if len(jax.devices()) < 2:
        rep.note(f"Halo exchanges: not run, they need 2 devices (JAX sees {len(jax.devices())}); on GPUs run this "
                 "question on a machine of 2 or more.")
        return
    sizes = opt.sizes_for("exchange", [64 * cm.KIB] if opt.smoke else SIZES)
    iters, warmup, loop = opt.repeats_or(30, 3), 1 if opt.smoke else 5, 5 if opt.smoke else 100
    rep.setting("exchange timing", f"median of {iters} calls after {warmup} warm-up (wall + block_until_ready); "
                f"inside one program: fori_loop of min({loop}, 1 GiB / size, >= 4) exchanges, time / count")
    mesh = make_mesh(2)
    ceil_t = rep.table("Ceiling: torch copy_ device 0 -> device 1", ["bytes", "time (us)", "GB/s", "timing"])
    rows = rep.table("Exchanges on 2 devices: one dispatched program per exchange, and inside one program",
                     ["bytes/dir", "exchange", "per dispatch (us)", "GB/s per dir", "/ ceiling", "/ bare ppermute",
                      "inside one program (us)", "GB/s per dir (in program)", "/ ceiling (in program)"])
    ceiling: dict[int, float] = {}
    per_call: dict[tuple[str, int], float] = {}
    looped: dict[tuple[str, int], float] = {}
    for s in sizes:
        if rep.time_left() < 0:
            rep.note(f"Exchanges: {cm.human_bytes(s)} and larger not run (budget spent).")
            break
        with rep.section(f"exchanges at {cm.human_bytes(s)}"):
            ceiling[s], how = torch_copy(s, opt.platform, warmup, iters)
            ceil_t.add(cm.human_bytes(s), cm.us(ceiling[s]), f"{gbps(s, ceiling[s]):.1f}", how)
            n_rows = s // (4 * FEATURES)
            tables = synthetic_tables(mesh, n_rows)
            n_loop = loop_count(s, loop)
            one, many = programs(mesh, tables, n_loop)
            sh = NamedSharding(mesh, P(AXIS))
            xo = jax.device_put(np.ones((2 * n_rows, FEATURES), np.float32), sh)
            xh = jax.device_put(np.ones((2 * tables.halo_rows, FEATURES), np.float32), sh)
            args = {"ppermute": (xo,), "GatherInputs": (tables, xo), "reverse": (tables, xh),
                    "ScatterOutputs": (tables, xh)}
            moved = {"ppermute": s, "GatherInputs": s, "reverse": s, "ScatterOutputs": 2 * s}
            t1 = cm.medians({k: (lambda f=f, a=args[k]: f(*a), cm.jax_sync) for k, f in one.items()},
                            warmup=warmup, iters=iters)
            tn = {k: v / n_loop for k, v in cm.medians({k: (lambda f=f, a=args[k]: f(*a), cm.jax_sync)
                                                        for k, f in many.items()},
                                                       warmup=1, iters=max(2, iters // 3)).items()}
            tn["reverse"] -= tn["GatherInputs"]  # the loop body is reverse + forward: reverse's share
            for name in one:
                per_call[name, s], looped[name, s] = t1[name], tn[name]
                g1, gn, c = gbps(moved[name], t1[name]), gbps(moved[name], tn[name]), gbps(s, ceiling[s])
                rows.add(cm.human_bytes(s), name, cm.us(t1[name]), f"{g1:.2f}", f"{g1 / c:.2f}",
                         f"{g1 / gbps(s, t1['ppermute']):.2f}", cm.us(tn[name]), f"{gn:.2f}", f"{gn / c:.2f}")
            del tables, xo, xh, one, many
    with rep.section("realistic HaloPlan"):
        _realistic(rep, mesh, 1000 if opt.smoke else 160_000, 64, warmup, iters)
    _targets(rep, sizes, ceiling, per_call, looped)


def _realistic(rep: cm.Report, mesh, n_atoms: int, features: int, warmup: int, iters: int) -> None:
    """The exchanges of a layout HaloPlan of random atoms in a periodic cube (2 devices), checked against numpy."""
    import jax

    from nvalchemi_jaxbridge.layout import HaloPlan
    from nvalchemi_jaxbridge.lower.tables import device_tables

    side = 60.0 * (n_atoms / 160_000) ** (1 / 3)  # density 0.74 / A^3, as 160k atoms in a 60 A cube
    pos = np.random.default_rng(0).uniform(0.0, side, (n_atoms, 3))
    plan = HaloPlan.build(pos, np.diag([side] * 3), cutoff=6.0, n_devices=2)
    tables = device_tables(plan, mesh)
    sh = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(AXIS))
    rng = np.random.default_rng(1)
    xo = jax.device_put(rng.normal(size=(2 * plan.owned_capacity, features)).astype(np.float32), sh)
    xh = jax.device_put(rng.normal(size=(2 * plan.halo_rows, features)).astype(np.float32), sh)
    one, _ = programs(mesh, tables, 4)
    got = np.asarray(one["GatherInputs"](tables, xo))
    ok = np.array_equal(got, plan.reference_forward(np.asarray(xo)))
    t = cm.medians({n: (lambda f=one[n], x=x: f(tables, x), cm.jax_sync) for n, x in
                    (("GatherInputs", xo), ("reverse", xh), ("ScatterOutputs", xh))}, warmup=warmup, iters=iters)
    sent = sum(plan.pair_capacities) * features * 4
    table = rep.table(f"Exchanges of a layout HaloPlan: {n_atoms} random atoms, periodic cube, cutoff 6 A, "
                      f"{features} x float32 per row, 2 devices", ["exchange", "message rows per offset",
                                                                   "sent per device", "per dispatch (us)",
                                                                   "matches numpy"])
    for name, v in t.items():
        table.add(name, str(dict(zip(plan.offsets, plan.pair_capacities))), cm.human_bytes(sent), cm.us(v),
                  ("yes" if ok else "MISMATCH") if name == "GatherInputs" else "-")
    if not ok:
        rep.fail("GatherInputs of the layout HaloPlan differs from the plan's numpy reference_forward")


def _targets(rep: cm.Report, sizes, ceiling, per_call, looped) -> None:
    big = [s for s in sizes if s >= 16 * cm.MIB and ("GatherInputs", s) in looped]
    if big:
        def worst(name: str, factor: int) -> float:
            return min(gbps(factor * s, looped[name, s]) / gbps(s, ceiling[s]) for s in big)

        g, sc, bare = worst("GatherInputs", 1), worst("ScatterOutputs", 2), worst("ppermute", 1)
        rep.target("halo exchange >= 85 % of the GPU-to-GPU copy bandwidth at >= 16 MiB (inside one program; issue 7)",
                   f"GatherInputs {g:.0%}, ScatterOutputs {sc:.0%} (bare ppermute {bare:.0%}), worst size",
                   min(g, sc) >= 0.85)
    small = [s for s in sizes if s <= 64 * cm.KIB and ("GatherInputs", s) in looped]
    if small:
        lw = max(looped[n, s] for s in small for n in ("GatherInputs", "ScatterOutputs"))
        dw = max(per_call[n, s] for s in small for n in ("GatherInputs", "ScatterOutputs"))
        rep.target("halo exchange <= 30 us at <= 64 KiB (inside one program; issue 7)",
                   f"{cm.us(lw)} us (per dispatch {cm.us(dw)} us), worst of GatherInputs / ScatterOutputs", lw <= 30e-6)
