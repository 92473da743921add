"""Kernel call, differentiated: energy + forces of an autograd-force torch function, bridge against native autograd.

The function is what a message-passing model's energy looks like to autograd: a Lennard-Jones energy summed
over a fixed edge list (48 random near neighbours per atom; positions (N, 3) and edges (E, 2) in, a scalar
out), with no backward formula of its own. Native: `torch.autograd.grad` of it; bridge:
`jax.jit(jax.value_and_grad(...))` of the same function as a torch op (`torch_function`), on the FFI and the
callback paths. Each call synchronised, and in blocks of calls issued back to back with one synchronisation
(pipelined: an MD or optimiser loop), the sides in turns. The table counts the function's forward runs per
E+F (native: 1) and the backward's token reads, and checks the forces against native's. On a GPU the same
calls are also profiled (device busy time per call: the device does the same work on both sides, so what
is left is host time).
"""

from __future__ import annotations

import numpy as np

from benchmarks import common as cm

NEIGHBOURS = 48  # edges per atom: a MACE-like graph at r_max 5 A in a metal
SIGMA, EPSILON = 1.0, 0.01
BLOCK = 10  # calls per pipelined block (2 in a smoke run)


def edge_list(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Positions of `n` atoms at unit density (a rattled simple cubic lattice) and `NEIGHBOURS` near pairs each."""
    rng = np.random.default_rng(seed)
    side = int(np.ceil(n ** (1 / 3)))
    grid = np.stack(np.meshgrid(*[np.arange(side)] * 3, indexing="ij"), -1).reshape(-1, 3)[:n]
    pos = 1.2 * grid + 0.05 * rng.normal(size=(n, 3))
    offsets = rng.integers(-2 * side * side - 2 * side - 2, 2 * side * side + 2 * side + 3, size=(n, NEIGHBOURS))
    offsets[offsets == 0] = 1  # atoms within +-2 lattice sites; indices wrap at the ends
    recv = np.repeat(np.arange(n), NEIGHBOURS)
    return pos, np.stack([(recv + offsets.reshape(-1)) % n, recv], 1).astype(np.int64)


def make_energy(counter: list[int]):
    """The torch energy function; `counter[0]` counts its forward runs."""

    def energy(x, edges):
        counter[0] += 1
        d = x[edges[:, 0]] - x[edges[:, 1]]
        sr6 = (SIGMA * SIGMA / (d * d).sum(1)) ** 3
        return (4.0 * EPSILON * (sr6 * sr6 - sr6)).sum().reshape(1)

    return energy


def run(rep: cm.Report, opt) -> None:
    import jax
    import jax.numpy as jnp
    import torch

    from nvalchemi_jaxbridge.kernels.torch_fn import torch_function

    gpu = opt.platform == "gpu"
    sizes = opt.sizes_for("kernel", [200] if opt.smoke else [1000, 10000, 100000])
    dtype = opt.dtypes_or(["float32"])[0]
    iters, warmup = opt.repeats_or(100, 2), 1 if opt.smoke else 5
    block = 2 if opt.smoke else BLOCK
    dev = torch.device("cuda", 0) if gpu else torch.device("cpu")
    rep.setting("autograd-force op", f"LJ over {NEIGHBOURS} edges per atom, {dtype}; median of {iters} calls in turns "
                f"after {warmup} warm-up; pipelined: blocks of {block} calls, one synchronisation, the sides' blocks in turns")
    table = rep.table("Energy + forces of an autograd-force torch function", [
        "atoms", "run", "forwards per E+F", "E+F ms", "bridge/native", "pipelined E+F ms",
        "bridge/native (pipelined)", "token reads per E+F", "max |dF| / max |F|", "device busy ms (profiler)"])
    worst = {}
    for n in sizes:
        if rep.time_left() < 0:
            rep.note(f"autograd-force op: {n} atoms and larger not run (budget spent).")
            break
        with rep.section(f"autograd-force op, {n} atoms"):
            pos, edges = edge_list(n)
            counter = [0]
            fn = make_energy(counter)
            x_t = torch.tensor(pos, dtype=getattr(torch, dtype), device=dev)
            e_t = torch.tensor(edges, device=dev)

            def native():
                x = x_t.detach().requires_grad_(True)
                e = fn(x, e_t).sum()
                (g,) = torch.autograd.grad(e, x)
                return e, g

            runs = {"native": (native, cm.torch_sync(dev))}
            x_j, e_j = jnp.asarray(pos, dtype=dtype), jnp.asarray(edges.astype(np.int32))
            kernels = {}
            for path in ("ffi", "callback"):
                k = torch_function(fn, 2, 1, label=f"bench_lj_edges_{path}", call_path=path)
                vg = jax.jit(jax.value_and_grad(lambda x, ed, k=k: k(x, ed)[0]))
                kernels[f"bridge ({path})"] = (k, vg)
                runs[f"bridge ({path})"] = (lambda vg=vg: vg(x_j, e_j), cm.jax_sync)
            times = cm.medians(runs, warmup=warmup, iters=iters)
            piped = {k: v / block for k, v in cm.medians({k: cm.pipelined(f, s, block) for k, (f, s) in runs.items()},
                                                         warmup=1, iters=max(2, iters // block)).items()}
            busy = {k: cm.profile(f, s, 30)["busy_total"] for k, (f, s) in runs.items()} if gpu else {}
            counter[0] = 0
            _, g_ref = native()
            f_ref = -g_ref.detach().double().cpu().numpy()
            table.add(n, "native", counter[0], cm.ms(times["native"]), "1", cm.ms(piped["native"]), "1", "-", "-",
                      cm.ms(busy.get("native", float("nan"))))
            for name, (k, vg) in kernels.items():
                counter[0] = 0
                reads = k.token_reads()
                _, g = jax.block_until_ready(vg(x_j, e_j))
                reads = k.token_reads() - reads
                err = float(np.abs(-np.asarray(g, np.float64) - f_ref).max() / max(np.abs(f_ref).max(), 1e-30))
                table.add(n, name, counter[0], cm.ms(times[name]), cm.ratio(times["native"], times[name]),
                          cm.ms(piped[name]), cm.ratio(piped["native"], piped[name]), reads, f"{err:.1e}",
                          cm.ms(busy.get(name, float("nan"))))
                if counter[0] != 1 or err > (1e-5 if dtype == "float32" else 1e-12):
                    rep.fail(f"autograd-force op, {n} atoms, {name}: {counter[0]} forwards per E+F (want 1), "
                             f"forces off by {err:.1e} of max |F|")
            worst[n] = times["native"] / times["bridge (ffi)"]
    if worst:
        rep.target("autograd-force op E+F >= 0.95x native (FFI path, synchronised; issue 15)",
                   ", ".join(f"{v:.2f}x at {n} atoms" for n, v in worst.items()), min(worst.values()) >= 0.95)
