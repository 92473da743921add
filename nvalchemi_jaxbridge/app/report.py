"""What a compiled adapter moves between devices, and the text / plot of a run report.

`collectives(cs, target, *args)` derives, from the plan's tables and the
argument and output shapes, every collective an adapter call issues (the
transform semantics of docs/design.md): GatherInputs is one forward exchange
(one `ppermute` per non-zero rank offset), ScatterOutputs a reverse and a
forward exchange, AllReduceSum one `psum`, GatherInputsFull one `all_gather`;
the slicing transforms are local. `hlo_collectives` counts the same ops in the
compiled program, so the two can be checked against each other.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

import numpy as np


@dataclasses.dataclass(frozen=True)
class Collective:
    """One transform's communication in one adapter call.

    Attributes:
        adapter: the adapter's target name.
        slot: "argument i" or "output i".
        transform: the transform's class name.
        op: "ppermute", "psum", "all_gather" or "local".
        count: collective ops issued (e.g. one ppermute per rank offset).
        rows: true rows moved between devices, all devices together.
        padded_rows: rows moved with the static message capacities.
        row_bytes: bytes of one row (for psum: of one device's whole value).
    """

    adapter: str
    slot: str
    transform: str
    op: str
    count: int
    rows: int
    padded_rows: int
    row_bytes: int

    @property
    def bytes(self) -> int:
        """True bytes moved."""
        return self.rows * self.row_bytes

    @property
    def padded_bytes(self) -> int:
        """Bytes moved including capacity padding (what the program actually sends)."""
        return self.padded_rows * self.row_bytes

    def to_dict(self) -> dict[str, Any]:
        """Fields plus bytes, for JSON."""
        return {**dataclasses.asdict(self), "bytes": self.bytes, "padded_bytes": self.padded_bytes}


def _row_bytes(shape: tuple[int, ...], dtype: Any) -> int:
    """Bytes of one row of an array of `shape` (the whole array when it is a scalar)."""
    return int(math.prod(shape[1:]) if len(shape) else 1) * np.dtype(dtype).itemsize


def _halo_messages(plan: Any) -> tuple[int, int, int]:
    """(ppermutes, true rows, padded rows) of one forward exchange; offset 0 stays on the device."""
    count = rows = padded = 0
    for k, send, cap in zip(plan.offsets, plan.send_idx, plan.pair_capacities):
        if k % plan.n_devices == 0:
            continue
        count += 1
        rows += int((np.asarray(send) < plan.owned_capacity).sum())
        padded += plan.n_devices * int(cap)
    return count, rows, padded


def collectives(cs: Any, target: Any, *args: Any, **scalars: Any) -> list[Collective]:
    """Every collective of one `cs.call(target, *args, **scalars)`, with rows and bytes.

    Args:
        cs: a `CompiledSpec`.
        target: the adapter (or its op or target name).
        *args: the call's arguments (arrays give the row sizes; Python scalars are constants).
        **scalars: scalar keyword arguments of the call (constants).

    Returns:
        One `Collective` per transform of the adapter, arguments first, in position order.
    """
    import jax

    from ..spec.transforms import AllReduceSum, GatherInputs, GatherInputsFull, ScatterOutputs

    adapter = cs.adapter(target)
    name = adapter.describe().target
    arrays = {i: a for i, a in enumerate(args) if hasattr(a, "shape") and hasattr(a, "dtype")}

    def call(cs_: Any, *arrs: Any) -> Any:
        full = list(args)
        for i, a in zip(arrays, arrs):
            full[i] = a
        return cs_.call(target, *full, **scalars)

    outs = jax.eval_shape(call, cs, *arrays.values())
    outs = outs if isinstance(outs, (tuple, list)) else (outs,)
    plan, d = cs.plan, cs.tables.n_devices
    result = []

    def add(slot: str, tr: Any, shape: tuple[int, ...], dtype: Any) -> None:
        rb = _row_bytes(shape, dtype)
        name = type(tr).__name__
        if isinstance(tr, GatherInputs) or isinstance(tr, ScatterOutputs):
            count, rows, padded = _halo_messages(plan)
            times = 2 if isinstance(tr, ScatterOutputs) else 1
            result.append(Collective(name, slot, name, "ppermute", times * count, times * rows, times * padded, rb))
        elif isinstance(tr, AllReduceSum):
            result.append(Collective(name, slot, name, "psum", 1, d, d, _row_bytes((1, *shape), dtype)))
        elif isinstance(tr, GatherInputsFull):
            n = int(np.asarray(plan.n_owned).sum())
            oc = cs.tables.owned_capacity
            result.append(Collective(name, slot, name, "all_gather", 1, (d - 1) * n, d * (d - 1) * oc, rb))
        else:
            result.append(Collective(name, slot, name, "local", 0, 0, 0, rb))

    for pos, tr in sorted(adapter.arg_transforms.items()):
        a = args[pos] if pos < len(args) else None
        if a is not None and hasattr(a, "shape"):
            add(f"argument {pos}", tr, tuple(a.shape), a.dtype)
    for pos, tr in sorted(adapter.output_transforms.items()):
        if pos < len(outs):
            add(f"output {pos}", tr, tuple(outs[pos].shape), outs[pos].dtype)
    return result


_HLO_OPS = {"ppermute": "collective-permute", "psum": "all-reduce", "all_gather": "all-gather"}


def hlo_collectives(hlo_text: str) -> dict[str, int]:
    """Count collective ops in compiled HLO text: {"ppermute": n, "psum": n, "all_gather": n}."""
    counts = {}
    for ours, hlo in _HLO_OPS.items():
        counts[ours] = len(re.findall(rf"= \S+ {hlo}(?:-start)?\(", hlo_text))
    return counts


# ------------------------------------------------------------------ text


def _fmt_bytes(n: float) -> str:
    """Bytes with a binary unit."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def format_collectives(items: list[Collective]) -> list[str]:
    """One line per collective."""
    lines = []
    for c in items:
        if c.op == "local":
            lines.append(f"    {c.slot:<10} {c.transform:<18} local (no communication)")
        else:
            lines.append(
                f"    {c.slot:<10} {c.transform:<18} {c.count} x {c.op:<10} {c.rows} rows, {_fmt_bytes(c.bytes)} "
                f"({_fmt_bytes(c.padded_bytes)} with capacity padding)")
    return lines


def describe_capacity(name: str) -> str:
    """A plan capacity's name in words: 'ghost_capacity' -> 'ghost rows per device', 'pair_capacities[2]' -> ..."""
    words = {"owned_capacity": "owned rows per device", "ghost_capacity": "ghost rows per device"}
    if name in words:
        return words[name]
    if name.startswith("pair_capacities[") and name.endswith("]"):
        k = name[16:-1]
        return f"rows per halo message from each device to the one {k} rank{'' if k == '1' else 's'} after it"
    return name


def format_run(report: Any) -> str:
    """The human report of `simulate.run`."""
    r = report
    owned = np.asarray(r.owned_per_device)
    species = ", ".join(f"{k} {v}" for k, v in r.species.items())
    params = ", ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in r.params.items())
    lines = [
        "nvalchemi-jaxbridge run: report",
        f"  system       {r.structure or f'{r.system} (generated)'}: {r.n_atoms} atoms ({species})",
        f"  potential    {r.potential} on {' + '.join(r.species)}; scalars {params or 'none'}",
        f"  spec         {r.spec}  (op {r.op}, kernel {r.kernel}"
        + (f", {r.call_path} call path" if r.call_path != "-" else "") + ")",
        f"  devices      {r.n_devices} x {r.platform}, domain grid {r.grid}, {r.dtype}",
        f"  dynamics     {r.steps} steps of {r.dt_fs:g} fs, {r.thermostat}",
        f"  time         {1e3 * r.time_per_step_s:.2f} ms/step "
        + ("(one step: compilation included; " if r.steps_done <= 1 else "(")
        + f"first step with compile: {r.compile_s:.1f} s; wall {r.wall_s:.1f} s)",
        f"  energy       E0 = {r.energy_per_atom_eV[0]:.6f} eV/atom; "
        + ("drift" if r.thermostat.startswith("NVE") else "change (a thermostat exchanges energy: not a drift)")
        + f" max|E(t)-E(0)|/N = {r.energy_change_max_eV_per_atom:.3e} eV/atom, fit slope "
        f"{r.energy_slope_eV_per_atom_ps:.3e} eV/atom/ps",
        f"  parity       step 1 vs {r.parity_reference}; tolerance {r.rtol:g} (relative to the reference's "
        "largest value):",
        f"               forces max abs {r.parity_force_max_abs_eV_per_A:.3e} eV/Å, max rel {r.parity_force_max_rel:.3e}; "
        f"energy rel {r.parity_energy_rel:.3e}  {'ok' if r.parity_ok else 'FAIL'}",
        f"  halo         final plan: {r.halo_ghost_rows} ghost rows; per step {r.halo_rows_per_step} rows / "
        f"{_fmt_bytes(r.halo_bytes_per_step)} between devices ({_fmt_bytes(r.halo_padded_bytes_per_step)} with padding)",
    ]
    for c in r.collectives:
        c = Collective(**{k: v for k, v in c.items() if k not in ("bytes", "padded_bytes")})
        lines.extend(format_collectives([c]))
    lines += [
        f"  balance      final plan: owned atoms per device {owned.tolist()}: min {owned.min()}, max {owned.max()}, "
        f"imbalance {100 * r.load_imbalance:.1f}% (max/mean - 1)",
        f"               ghosts per device {list(r.ghosts_per_device)}",
        f"  rebuilds     {len(r.rebuilds)} (at steps {list(r.rebuilds)[:10]}{' ...' if len(r.rebuilds) > 10 else ''})"
        + ("; all atoms accounted for after each" if r.rebuilds else "")
        + (f"; steps after {list(r.late_rebuilds)} run again on a plan rebuilt there (an atom passed skin/2 "
           "before the check)" if r.late_rebuilds else "")
        + (f"; capacities grown at rebuilds (so the halo and balance lines, from the final plan, differ from the "
           f"first plan's): {'; '.join(describe_capacity(g) for g in r.grown)}" if r.grown else ""),
        f"  displacement largest since its plan {r.max_displacement_A:.3f} Å over {r.steps_done} steps (skin/2 = "
        f"{r.skin_A / 2:g} Å), flagged in every step's program, read at {r.host_checks} host check(s)",
        f"  temperature  initial {r.initial_temperature_K:.1f} K, final {r.final_temperature_K:.1f} K",
    ]
    written = [f"{what} {path} ({count} {'frames' if what == 'trajectory' else 'rows'})"
               for what, (path, count) in r.outputs.items()]
    if written:
        lines.append(f"  outputs      {'; '.join(written)}")
    lines.append("  result       " + _result(r))
    return "\n".join(lines)


def _result(r: Any) -> str:
    """The report's last word: ok, the guard that stopped the run, or the parity failure."""
    if r.stop is not None:
        return f"STOPPED after {r.steps_done} of {r.steps} steps: {r.stop['message']}"
    return "ok" if r.ok else "FAILED: parity outside tolerance"


def _n(count: int, word: str) -> str:
    """'1 step', '2 steps'."""
    return f"{count} {word}{'' if count == 1 else 's'}"


def _rows_line(rows: Any) -> str:
    """Owned + ghost rows per device, and the total."""
    cells = [f"{r['owned']}+{r['ghost']}" for r in rows]
    total = sum(r["owned"] + r["ghost"] for r in rows)
    return f"{' '.join(cells)} (owned+ghost; {total} rows in all, {sum(r['edges'] for r in rows)} edges)"


def _tiles_lines(r: Any) -> list[str]:
    """Per device: tiles, the largest tile's rows and edges and its predicted peak (none without tiles)."""
    rows = [row for row in r.rows_per_device if "tiles" in row]
    if not rows:
        return []
    how = ("the model's memory measured by the probe" if r.memory_model == "measured" else
           "the budget's cost per row and edge")
    cells = " | ".join(f"{row['tiles']} x {row['tile_rows']:,} rows {row['tile_edges']:,} edges "
                       f"{_fmt_bytes(row['predicted_bytes'])}" for row in rows)
    asked = "auto: " if r.tiles == "auto" else ""
    return [f"  tiles        {asked}{cells} (tiles x largest tile per device, its predicted peak)",
            f"               predicted from {how}; budget {_fmt_bytes(r.memory_budget_bytes)} per device"]


def format_model_run(report: Any) -> str:
    """The human report of `model_run.run_model`."""
    r, p = report, report.parity
    flag = lambda key: "ok" if p[key] <= r.rtol else "FAIL"  # noqa: E731
    lines = [
        "nvalchemi-jaxbridge run --model: report",
        f"  model        {r.model}, {r.source}: cutoff {r.cutoff:g} Å, {r.n_layers} layers, {r.n_params} parameters",
        f"  system       {r.n_atoms} atoms on {r.n_devices} x {r.platform}, {r.dtype}",
        f"  exchange     {r.exchange}: halo depth {r.halo_depth:g} Å + skin {r.skin:g} Å"
        + (" (one cutoff; ghost features refreshed before every layer after the first)" if r.exchange == "per_layer"
           else f" ({r.n_layers} x cutoff; no exchange between layers)"),
        f"  rows/device  first plan: {_rows_line(r.rows_per_device)}",
        f"               {r.other_exchange} would need {_rows_line(r.other_rows_per_device)}",
        *_tiles_lines(r),
        f"  parity       vs {r.reference}; tolerance {r.rtol:g} (relative to the reference's largest value)",
        f"               energy   {r.energy:.10f} eV vs {r.energy_reference:.10f} eV: diff {p['energy_max_abs']:.3e} eV, "
        f"rel {p['energy_rel']:.3e}  {flag('energy_rel')}",
        f"               forces   max abs diff {p['forces_max_abs']:.3e} eV/Å, rel {p['forces_rel']:.3e}  "
        f"{flag('forces_rel')}",
        f"               stress   max abs diff {p['stress_max_abs']:.3e} eV/Å³, rel {p['stress_rel']:.3e}  "
        f"{flag('stress_rel')}",
        f"  compile      first evaluation {r.compile_s:.1f} s",
    ]
    if r.steps == 0:
        lines.append("  dynamics     none (--steps 0): the parity check only")
    else:
        drift, slope = r.drift
        e, temp = r.total_energy_per_atom_eV, r.temperature_K
        per_step = r.time_per_step_s
        lines += [
            f"  dynamics     {_n(r.steps, 'step')} of {r.dt:g} fs, {r.thermostat}",
            f"  energy       E_tot(0) = {e[0]:.6f} eV/atom (E_pot {r.potential_energy_eV[0] / r.n_atoms:.6f}); "
            + ("drift" if r.bath_temperature_K is None else "change (a thermostat exchanges energy: not a drift)")
            + f" max|E_tot(t)-E_tot(0)|/N = {drift:.3e} eV/atom, fit slope {slope:.3e} eV/atom/ps "
            f"(over {len(r.md_steps)} checks)",
            f"  temperature  initial {temp[0]:.1f} K, final {temp[-1]:.1f} K"
            + ("" if r.bath_temperature_K is None else f" (bath {r.bath_temperature_K:g} K)"),
            "  time         " + (
                "no step ran" if per_step is None else
                f"{1e3 * per_step:.1f} ms/step" + (
                    " (compilation included: every chunk of steps compiled its program; run more steps than "
                    "--check-every for a steady figure)" if r.time_includes_compile else
                    f" (over {_n(r.timing[0], 'step')} that compiled nothing)")),
            f"  layouts      {r.rebuilds} built"
            + (f" (rebuilt at steps {list(r.rebuild_steps)[:10]}{' ...' if len(r.rebuild_steps) > 10 else ''})"
               if r.rebuild_steps else ""),
        ]
    written = [f"{what} {path} ({count} {'frames' if what == 'trajectory' else 'rows'})"
               for what, (path, count) in r.outputs.items()]
    if written:
        lines.append(f"  outputs      {'; '.join(written)}")
    lines += [f"  wall         {r.wall_s:.1f} s", "  result       " + _result(r)]
    return "\n".join(lines)
