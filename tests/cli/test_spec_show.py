"""`nvalchemi-jaxbridge spec show` and the collectives table: derived counts and rows against the compiled
program and against the plan's ownership."""

from __future__ import annotations

import re

import numpy as np

from nvalchemi_jaxbridge.app import report
from nvalchemi_jaxbridge.app.cli import main
from nvalchemi_jaxbridge.demo import params, systems
from nvalchemi_jaxbridge.kernels import compile as kcompile
from nvalchemi_jaxbridge.layout import HaloPlan
from nvalchemi_jaxbridge.lower import make_mesh
from nvalchemi_jaxbridge.spec import load_spec


def test_spec_show_counts_agree_with_the_compiled_program(capsys):
    assert main(["spec", "show", "nvalchemi_jaxbridge/app/specs/dsf_rocksalt.json", "--devices", "4"]) == 0
    out = capsys.readouterr().out
    assert "mesh: 4 x cpu devices, axis 'atoms'" in out
    assert re.search(r"0 positions\s+\(\d+, 3\) float64  P\('atoms',\)  GatherInputs", out)
    assert re.search(r"2 owned_mask\s+\(\d+,\) bool  P\('atoms',\)  no transform", out)
    assert "0 P()  AllReduceSum" in out and "1 P('atoms',)  ScatterOutputs" in out
    derived = {"ppermute": 0, "psum": 0, "all_gather": 0}
    for n, op in re.findall(r"(\d+) x (ppermute|psum|all_gather)", out):
        derived[op] += int(n)
    compiled = dict((op, int(n)) for n, op in re.findall(r"(\d+) (ppermute|psum|all_gather)", out.split("compiled program:")[1]))
    assert derived == compiled and derived["ppermute"] > 0 and derived["psum"] == 1


def test_collective_rows_are_the_ghosts_held_from_other_devices():
    from nvalchemi_jaxbridge.demo import torch_ops  # noqa: F401

    s = systems.argon_fcc(3)
    s = s.replace(positions=s.positions + np.random.default_rng(1).normal(scale=0.1, size=s.positions.shape))
    p = params.LJParams()
    plan = HaloPlan.build(s.positions, s.cell, cutoff=p.cutoff, n_devices=8)
    spec = load_spec("nvalchemi_jaxbridge/app/specs/lj_argon.json").distribution
    adapter = spec.custom_ops[0]
    cs = kcompile(spec, make_mesh(8), plan, positions={adapter: [0]})
    coll = report.collectives(cs, adapter, cs.owned(s.positions, positions=True), cs.halo_owned_mask(), *p.args())
    # independent count: ghost rows of device d whose atom is owned by another device
    owner = plan.owner
    from_others = sum(int(np.sum((plan.halo_global[d, plan.n_owned[d]:plan.n_padded[d]] >= 0)
                                 & (owner[plan.halo_global[d, plan.n_owned[d]:plan.n_padded[d]]] != d)))
                      for d in range(8))
    by_slot = {c.slot: c for c in coll}
    assert by_slot["argument 0"].rows == from_others and by_slot["argument 0"].row_bytes == 24
    assert by_slot["output 1"].rows == 2 * from_others
    assert by_slot["output 0"].op == "psum" and by_slot["output 0"].bytes == 8 * 8
    assert by_slot["argument 0"].padded_rows >= by_slot["argument 0"].rows


def test_spec_show_exits_1_and_says_why_when_an_op_cannot_be_resolved(tmp_path, capsys):
    import json

    spec = json.loads(open("nvalchemi_jaxbridge/app/specs/lj_argon.json").read())
    spec["custom_ops"][0]["op"] = "nobody_registered::this_op"
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(spec))
    assert main(["spec", "show", str(path), "--devices", "2"]) == 1
    captured = capsys.readouterr()
    assert "adapter nobody_registered::this_op: cannot resolve its op" in captured.out
    assert re.search(r"error: spec show: adapter nobody_registered::this_op: cannot resolve its op \(.*\); pass "
                     r"--op module:attr", captured.err), captured.err
