"""`run --plot`'s picture: time in ps on every time axis, labelled plan-rebuild marks at their time, a temperature
panel (with the bath under Langevin), energy per atom, and the demo run's series taken from its report."""

from __future__ import annotations

import numpy as np
import pytest

from nvalchemi_jaxbridge.app import plots, run_config, simulate


def _series(**kw):
    t = np.arange(6) * 0.002
    base = dict(time_ps=t, potential=-1.0 + 0.01 * t, total=-0.9 + 1e-6 * t, temperature=300 - t,
                rebuilds_ps=(0.004, 0.008), owned_per_device=(16, 16), title="mpnn: 32 atoms on 2 devices, NVE")
    return plots.MDSeries(**{**base, **kw})


def test_the_figure_has_time_in_ps_labelled_rebuilds_temperature_and_energy_per_atom():
    import matplotlib.pyplot as plt

    fig = plots.figure(_series(bath_K=310.0))
    try:
        by_title = {ax.get_title(): ax for ax in fig.axes}
        temp = by_title["temperature"]
        energy = by_title["energy per atom"]
        drift = next(ax for t, ax in by_title.items() if t.startswith("total energy change"))
        for ax in (temp, energy, drift):
            assert ax.get_xlabel() == "time  [ps]"
            handles, labels = ax.get_legend_handles_labels()
            assert labels.count("plan rebuilt") == 1  # one legend entry for the marks
            marks = sorted(line.get_xdata()[0] for line in ax.get_lines() if line.get_linestyle() == "--")
            assert marks == [0.004, 0.008]
        assert "eV/atom" in energy.get_ylabel() and "K" in temp.get_ylabel()
        assert "bath 310 K" in temp.get_legend_handles_labels()[1] and "not a drift" in drift.get_title()
        np.testing.assert_allclose(temp.get_lines()[0].get_ydata(), 300 - np.arange(6) * 0.002)
        np.testing.assert_allclose(drift.get_lines()[0].get_ydata(), 1e-3 * np.arange(6) * 0.002)  # meV/atom
    finally:
        plt.close(fig)


def test_series_of_different_lengths_are_refused():
    with pytest.raises(ValueError, match="one value per time, got sizes"):
        _series(temperature=[300.0])


def test_the_demo_runs_series_is_its_report_per_step_in_ps():
    from nvalchemi_jaxbridge.demo.units import KB_EV

    r = simulate.run(run_config.RunConfig(kernel="jax", cells=2, devices=2, steps=4, check_every=2,
                                          temperature=60.0, langevin=0.01))
    s = r.series()
    np.testing.assert_allclose(s.time_ps, np.arange(5) * r.dt_fs * 1e-3)
    np.testing.assert_allclose(s.total, r.energy_per_atom_eV)
    assert s.temperature[0] == pytest.approx(r.initial_temperature_K, rel=1e-9)
    assert s.temperature[-1] == pytest.approx(r.final_temperature_K, rel=1e-9)
    e_kin = (s.total - s.potential) * r.n_atoms  # E_tot - E_pot is the kinetic energy, which T measures
    np.testing.assert_allclose(s.temperature, 2 * e_kin / ((3 * r.n_atoms - 3) * KB_EV), rtol=1e-9)
    assert s.bath_K == 60.0 and s.rebuilds_ps == tuple(k * r.dt_fs * 1e-3 for k in r.rebuilds)
    # the text report of the same run: figures labelled as the final plan's; a one-step time says it compiled
    import dataclasses
    import re

    from nvalchemi_jaxbridge.app.report import format_run

    text = format_run(r)
    assert "halo         final plan: " in text and "balance      final plan: " in text
    one = format_run(dataclasses.replace(r, steps_done=1))
    assert "ms/step (one step: compilation included;" in one and not re.search(r"\bnan\b", one, re.I)
