"""The picture of a run (`run --plot`): energy per atom, temperature and load balance against time in ps.

Both kinds of run (the demo potentials and `--model`) draw the same four panels from an `MDSeries`:
the total-energy change per atom (the drift, or the thermostat's exchange), the potential and total
energy per atom, the temperature (and the bath's, under Langevin), and the owned atoms per device. Plan
rebuilds are dashed vertical lines with a legend entry ("plan rebuilt"), at their time.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np


@dataclasses.dataclass(frozen=True)
class MDSeries:
    """What a run's picture shows.

    Attributes:
        time_ps: the sampled times (ps): every step of a demo run, every check of a model run.
        potential, total: potential and total energy per atom (eV/atom) at those times.
        temperature: temperature (K) at those times.
        rebuilds_ps: times (ps) at which the plan (layout) was rebuilt.
        owned_per_device: owned atoms per device in the plan `plan` names.
        title: what ran (atoms, devices, thermostat), for the figure's title.
        bath_K: the Langevin bath temperature (K), or None for NVE.
    """

    time_ps: np.ndarray
    potential: np.ndarray
    total: np.ndarray
    temperature: np.ndarray
    rebuilds_ps: tuple[float, ...]
    owned_per_device: tuple[int, ...]
    title: str
    bath_K: float | None = None
    plan: str = "final plan"

    def __post_init__(self):
        for name in ("time_ps", "potential", "total", "temperature"):
            object.__setattr__(self, name, np.asarray(getattr(self, name), dtype=np.float64).reshape(-1))
        sizes = {n: getattr(self, n).size for n in ("time_ps", "potential", "total", "temperature")}
        if len(set(sizes.values())) != 1:
            raise ValueError(f"MDSeries: the series must have one value per time, got sizes {sizes}.")


def figure(series: MDSeries) -> Any:
    """The run's matplotlib figure (Agg): four panels sharing the time axis (ps)."""
    try:
        import matplotlib
    except ImportError as e:
        raise ImportError("--plot needs matplotlib: pip install matplotlib") from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = series
    fig, ((drift, energy), (temp, balance)) = plt.subplots(2, 2, figsize=(11, 7))
    t = s.time_ps
    change = (s.total - s.total[0]) * 1e3 if s.total.size else s.total
    drift.plot(t, change, marker="." if t.size < 30 else None, color="C0")
    drift.set_ylabel("E_tot(t) - E_tot(0)  [meV/atom]")
    drift.set_title("total energy change" + (" (thermostat exchange, not a drift)" if s.bath_K is not None
                                              else " (NVE drift)"))
    energy.plot(t, s.potential, label="E_pot", color="C1")
    energy.plot(t, s.total, label="E_tot", color="C0")
    energy.set_ylabel("energy per atom  [eV/atom]")
    energy.set_title("energy per atom")
    temp.plot(t, s.temperature, color="C3", label="T")
    if s.bath_K is not None:
        temp.axhline(s.bath_K, color="0.4", ls=":", lw=1, label=f"bath {s.bath_K:g} K")
    temp.set_ylabel("temperature  [K]")
    temp.set_title("temperature")
    for ax in (drift, energy, temp):
        for k, r in enumerate(s.rebuilds_ps):
            ax.axvline(r, color="0.6", ls="--", lw=0.8, zorder=0, label="plan rebuilt" if k == 0 else None)
        ax.set_xlabel("time  [ps]")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(loc="best", fontsize="small")
    devices = np.arange(len(s.owned_per_device))
    owned = np.asarray(s.owned_per_device, dtype=float)
    balance.bar(devices, owned)
    balance.set_xticks(devices)
    balance.set_xlabel("device")
    balance.set_ylabel(f"owned atoms ({s.plan})")
    imbalance = 100 * (owned.max() / owned.mean() - 1) if owned.size and owned.mean() > 0 else 0.0
    balance.set_title(f"load balance (imbalance {imbalance:.1f}%)")
    fig.suptitle(s.title)
    fig.tight_layout()
    return fig


def save(series: MDSeries, path: str) -> None:
    """Draw `series` (see `figure`) into the PNG `path`."""
    import matplotlib.pyplot as plt

    fig = figure(series)
    fig.savefig(path, dpi=100)
    plt.close(fig)
