"""compile(spec, mesh, plan): golden vectors through adapters, keywords, caching, errors."""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from nvalchemi_jaxbridge.layout import ShardPlan
from nvalchemi_jaxbridge.lower import compile, field_shardings, make_mesh
from nvalchemi_jaxbridge.lower.tables import place
from nvalchemi_jaxbridge.spec.adapter import OpAdapter
from nvalchemi_jaxbridge.spec.policies import GraphParallelPolicy, HaloStoragePolicy, PlainShard
from nvalchemi_jaxbridge.spec.transforms import AllReduceSum, GatherInputs, GatherInputsFull, ScatterOutputs

from .plans import golden_halo_plan, make_spec, shard_plan

AX = "atoms"


def double(x):
    return 2.0 * x


def keep_and_sum(x):
    return x, jnp.sum(x, axis=0)


def halo_rows(r0, r1, hr=6):
    out = np.zeros(2 * hr)
    out[: len(r0)] = r0
    out[hr: hr + len(r1)] = r1
    return out


@pytest.fixture(scope="module")
def mesh2():
    return make_mesh(2)


def sharded(mesh, x):
    return place(np.asarray(x, dtype=np.float64), NamedSharding(mesh, P(AX)))


def test_golden_gather_and_scatter_through_adapters(mesh2):
    gather = OpAdapter(double, gather_inputs=[0])
    scatter = OpAdapter(lambda y: 2.0 * y, scatter_outputs=[0])
    cs = compile(make_spec(HaloStoragePolicy(), gather, scatter), mesh2, golden_halo_plan())
    owned = sharded(mesh2, 10.0 * np.arange(6) + 1)
    np.testing.assert_array_equal(cs.call(gather, owned), 2 * halo_rows([1, 11, 21, 31], [31, 41, 51, 11, 21]))
    # by op, by target name and by keyword: the same program and result
    np.testing.assert_array_equal(cs.call(double, x=owned), cs.call(gather.describe().target, owned))
    g = jax.grad(lambda x: jnp.sum(cs.call(gather, x)))(sharded(mesh2, np.ones(6)))
    np.testing.assert_array_equal(g, [2, 4, 4, 4, 2, 2])
    ones = sharded(mesh2, halo_rows([1] * 4, [1] * 5))
    out = cs.call(scatter, ones)
    np.testing.assert_array_equal(out, halo_rows([2, 4, 4, 4], [4, 2, 2, 4, 4]))
    assert out.sharding.spec == P(AX)
    w = sharded(mesh2, halo_rows([1, 2, 3, 4], [1, 2, 3, 4, 5]))
    np.testing.assert_array_equal(jax.vjp(lambda y: cs.call(scatter, y), ones)[1](w)[0],
                                  halo_rows([2, 12, 16, 10], [10, 4, 6, 12, 16]))


@pytest.mark.parametrize("replicated", [False, True])
def test_golden_all_reduce_sum(mesh2, replicated):
    a = OpAdapter(keep_and_sum, owned_slice_inputs=[0], output_transforms={1: AllReduceSum(replicated)})
    spec = make_spec(HaloStoragePolicy(), a)
    leaf = sharded(mesh2, halo_rows([1, 2, 3, 4], [11, 12, 13, 14, 15])[:, None])
    # one logical replicated output: its single cotangent reaches each partial once
    cs = compile(spec, mesh2, golden_halo_plan())
    out0, out1 = cs.call(a, leaf)
    assert out0.shape == (6, 1) and out1.sharding.spec == P()
    np.testing.assert_array_equal(out1, [42])
    g = jax.grad(lambda x: cs.call(a, x)[1][0])(leaf)
    np.testing.assert_array_equal(g[:, 0], halo_rows([1, 1, 1, 0], [1, 1, 1, 0, 0]))
    # per-device copies, each rank's loss on its own copy: the reference's per-rank vectors
    cs = compile(spec, mesh2, golden_halo_plan(), per_device_reductions=True)
    per_dev = cs.call(a, leaf)[1]
    np.testing.assert_array_equal(per_dev, [[42], [42]])
    g = jax.grad(lambda x: jnp.sum(cs.call(a, x)[1]))(leaf)
    want = [1, 1, 1, 0] if replicated else [2, 2, 2, 0]
    np.testing.assert_array_equal(g[:, 0], halo_rows(want, want[:3] + [0, 0]))


@pytest.mark.parametrize("policy", [PlainShard(), GraphParallelPolicy()])
def test_golden_gather_full_slice_outputs_owned(mesh2, policy):
    a = OpAdapter(double, gather_inputs_full=[0], slice_outputs_owned=[0])
    plan = ShardPlan.from_assignment(np.array([0, 0, 0, 1, 1, 1]), 2)
    cs = compile(make_spec(policy, a), mesh2, plan)
    x = cs.owned(10.0 * np.arange(6) + 1)                       # (3 + 1) rows per device, pad row 0
    x = x.at[jnp.array([3, 7])].set(-1.0)
    np.testing.assert_array_equal(cs.call(a, x), [2, 22, 42, -2, 62, 82, 102, -2])
    np.testing.assert_array_equal(jax.grad(lambda x: jnp.sum(cs.call(a, x)))(x), np.full(8, 2.0))
    np.testing.assert_array_equal(cs.to_global(cs.call(a, x)), 2 * (10.0 * np.arange(6) + 1))


def test_untransformed_arguments_follow_the_placement_rule(mesh2):
    """Per-device blocks stay per device, replicated arrays and scalars reach every device whole."""

    def kernel(x, block, table, scale, *, shift=0.0):
        return (x + block * scale + jnp.sum(table) + shift,)

    a = OpAdapter(kernel, gather_inputs=[0], scatter_outputs=[0])
    cs = compile(make_spec(HaloStoragePolicy(), a), mesh2, golden_halo_plan())
    x = sharded(mesh2, np.zeros(6))
    block = sharded(mesh2, halo_rows([1, 0, 0, 0], [0, 0, 0, 0, 0]))   # 1 on r0's row 0 only
    (out,) = cs.call(a, x, block, np.array([0.25, 0.25]), 3.0, shift=0.0)
    # kernel on r0: 3 on row 0 plus 0.5 everywhere; scatter folds r0's ghost (g3) into r1's row 0
    # r0 has 4 real rows + 2 padding, r1 5 + 1; table sum 0.5 lands on every halo row
    r0 = np.array([3.5, 0.5, 0.5, 0.5, 0.5, 0.5])
    r1 = np.full(6, 0.5)
    fold = lambda r0, r1: (np.array([r0[0], r0[1] + r1[3], r0[2] + r1[4]]),   # noqa: E731
                           np.array([r1[0] + r0[3], r1[1], r1[2]]))
    o0, o1 = fold(r0, r1)
    np.testing.assert_allclose(out, halo_rows(list(o0) + [o1[0]], list(o1) + [o0[1], o0[2]]))


def test_with_plan_reuses_programs_and_new_capacities_retrace(mesh2):
    traces = []

    def kernel(x):
        traces.append(x.shape)
        return 2.0 * x

    a = OpAdapter(kernel, gather_inputs=[0])
    plan = golden_halo_plan()
    cs = compile(make_spec(HaloStoragePolicy(), a), mesh2, plan)
    x = sharded(mesh2, 10.0 * np.arange(6) + 1)
    cs.call(a, x)
    n = len(traces)
    # same capacities, different tables: r1 now sends rows 0 and 2, r0 only row 1
    swapped = golden_halo_plan()
    swapped.send_idx = (np.array([[1, 3], [0, 2]], np.int32),)
    swapped.recv_slot = (np.array([[3, 4], [3, 6]], np.int32),)
    swapped.n_ghost = np.array([2, 1])
    cs2 = cs.with_plan(swapped)
    np.testing.assert_array_equal(cs2.call(a, x), 2 * halo_rows([1, 11, 21, 31, 51], [31, 41, 51, 11]))
    assert len(traces) == n
    bigger = golden_halo_plan()
    bigger.ghost_capacity, bigger.halo_rows = 4, 7
    bigger.halo_offset = np.zeros((2, 7, 3))
    bigger.halo_owned_mask = np.pad(bigger.halo_owned_mask, ((0, 0), (0, 1)))
    bigger.recv_slot = (np.where(bigger.recv_slot[0] == 6, 7, bigger.recv_slot[0]),)
    out = cs.with_plan(bigger).call(a, x)
    assert len(traces) > n and out.shape == (14,)


def test_positions_get_image_shifts_only_where_declared(mesh2):
    plan = golden_halo_plan()
    plan.halo_offset = np.zeros((2, 6, 3))
    plan.halo_offset[0, 3] = [10.0, 0, 0]                          # r0's ghost g3 is an image
    both = OpAdapter(lambda r, v: (r, v), gather_inputs=[0, 1])
    cs = compile(make_spec(HaloStoragePolicy(), both), mesh2, plan, positions={both: ["r"]})
    x = sharded(mesh2, np.ones((6, 3)))
    r, v = cs.call(both, x, x)
    np.testing.assert_array_equal(np.asarray(r)[3], [11, 1, 1])
    np.testing.assert_array_equal(np.asarray(v)[3], [1, 1, 1])


def test_field_shardings(mesh2):
    from nvalchemi_jaxbridge.spec.distribution import DistributionSpec

    got = field_shardings(DistributionSpec(policy=HaloStoragePolicy()), mesh2, extra_fields=("halo_owned_mask",))
    assert set(got) == {"positions", "charges", "atomic_numbers", "halo_owned_mask"}
    assert set(field_shardings(types.SimpleNamespace(shard_fields=("q",)), mesh2)) == {"q"}
    assert all(s == NamedSharding(mesh2, P(AX)) for s in got.values())


# ------------------------------------------------------------------- errors


def test_transform_for_other_storage_kind_is_a_compile_error(mesh2):
    a = OpAdapter(double, gather_inputs_full=[0])
    with pytest.raises(ValueError, match=r"adapter '.*double' declares GatherInputsFull\(\) on arg_transforms\[0\].*"
                                         r"HaloStoragePolicy \(halo storage\).*\['GatherInputs', 'SliceOwned'\]"):
        compile(make_spec(HaloStoragePolicy(), a), mesh2, golden_halo_plan())
    b = OpAdapter(double, scatter_outputs=[0])
    with pytest.raises(ValueError, match=r"ScatterOutputs\(\) on output_transforms\[0\].*PlainShard.*"
                                         r"\['SliceOutputsOwned'\]"):
        compile(make_spec(PlainShard(), b), mesh2, shard_plan([0, 1], 2))


def test_plan_kind_and_policy_errors(mesh2):
    a = OpAdapter(double, gather_inputs=[0])
    with pytest.raises(ValueError, match="HaloStoragePolicy uses halo storage, which needs a HaloPlan"):
        compile(make_spec(HaloStoragePolicy(), a), mesh2, shard_plan([0, 1], 2))
    with pytest.raises(ValueError, match="policy is None, which has no distributed storage"):
        compile(make_spec(None, a), mesh2, golden_halo_plan())


def test_torch_and_lazy_ops_need_the_kernels_layer(mesh2):
    a = OpAdapter("demo::spread", gather_inputs=[0])
    with pytest.raises(TypeError, match=r"'demo::spread' is a lazy torch op reference: use nvalchemi_jaxbridge.compile"):
        compile(make_spec(HaloStoragePolicy(), a), mesh2, golden_halo_plan())
    torch = pytest.importorskip("torch")
    b = OpAdapter(torch.ops.aten.mul.Tensor, gather_inputs=[0])
    with pytest.raises(TypeError, match=r"aten.mul.Tensor is a torch op: use nvalchemi_jaxbridge.compile"):
        compile(make_spec(HaloStoragePolicy(), b), mesh2, golden_halo_plan())
    seen = []
    cs = compile(make_spec(HaloStoragePolicy(), a), mesh2, golden_halo_plan(),
                 kernel_for=lambda op: seen.append(op) or double)
    assert seen == ["demo::spread"]
    np.testing.assert_array_equal(cs.call("demo::spread", sharded(mesh2, np.ones(6)))[:4], [2, 2, 2, 2])


def test_positions_beyond_kernel_parameters_and_outputs(mesh2):
    a = OpAdapter(double, gather_inputs=[1])
    with pytest.raises(ValueError, match=r"adapter '.*double' declares GatherInputs\(\) on argument 1, but its "
                                         r"kernel takes 1 positional parameters \('x',\)"):
        compile(make_spec(HaloStoragePolicy(), a), mesh2, golden_halo_plan())
    b = OpAdapter(double, gather_inputs=[0], scatter_outputs=[2])
    cs = compile(make_spec(HaloStoragePolicy(), b), mesh2, golden_halo_plan())
    with pytest.raises(ValueError, match=r"declares ScatterOutputs\(\) on output 2, but its kernel returned 1"):
        cs.call(b, sharded(mesh2, np.ones(6)))


def test_call_errors_name_adapter_argument_and_rows(mesh2):
    a = OpAdapter(double, gather_inputs=[0])
    cs = compile(make_spec(HaloStoragePolicy(), a), mesh2, golden_halo_plan())
    with pytest.raises(ValueError, match=r"adapter '.*double' argument 0 \('x'\) \(GatherInputs\) expects owned "
                                         r"storage \(CompiledSpec.owned\) with 6 rows, got shape \(12,\)"):
        cs.call(a, sharded(mesh2, np.ones(12)))
    with pytest.raises(TypeError, match=r"passed neither positional argument 0 or keyword 'x'"):
        cs.call(a)
    with pytest.raises(KeyError, match=r"'nope' is not an adapter of this spec; known targets: \['.*double'\]"):
        cs.call("nope", np.ones(6))
    with pytest.raises(KeyError, match=r"compile\(positions=...\): 'nope' is not an adapter"):
        compile(make_spec(HaloStoragePolicy(), a), mesh2, golden_halo_plan(), positions={"nope": [0]})
    b = OpAdapter(lambda x, y: x, gather_inputs=[0], owned_slice_inputs=[1])
    with pytest.raises(ValueError, match=r"argument 1 \('y'\) is not a GatherInputs argument \(those are \[0\]\)"):
        compile(make_spec(HaloStoragePolicy(), b), mesh2, golden_halo_plan(), positions={b: [1]})


def test_scalar_outputs_need_a_reduction(mesh2):
    a = OpAdapter(lambda x: jnp.sum(x), gather_inputs=[0])
    cs = compile(make_spec(HaloStoragePolicy(), a), mesh2, golden_halo_plan())
    with pytest.raises(ValueError, match=r"output 0 is a scalar on each device; declare AllReduceSum\(\) on output 0"):
        cs.call(a, sharded(mesh2, np.ones(6)))


def test_compiled_spec_is_a_pytree_so_outer_jit_reuses_programs(mesh2):
    traces = []

    def kernel(x):
        traces.append(x.shape)
        return 2.0 * x

    a = OpAdapter(kernel, gather_inputs=[0])
    cs = compile(make_spec(HaloStoragePolicy(), a), mesh2, golden_halo_plan())
    f = jax.jit(lambda cs, x: cs.call(a, x) + 1.0)
    x = sharded(mesh2, 10.0 * np.arange(6) + 1)
    np.testing.assert_array_equal(f(cs, x), 2 * halo_rows([1, 11, 21, 31], [31, 41, 51, 11, 21]) + 1)
    n = len(traces)
    swapped = golden_halo_plan()
    swapped.send_idx = (np.array([[1, 3], [0, 2]], np.int32),)
    swapped.recv_slot = (np.array([[3, 4], [3, 6]], np.int32),)
    np.testing.assert_array_equal(f(cs.with_plan(swapped), x),
                                  2 * halo_rows([1, 11, 21, 31, 51], [31, 41, 51, 11]) + 1)
    assert len(traces) == n


def test_with_tables_swaps_arrays_inside_jit_and_refuses_another_layout(mesh2):
    import dataclasses

    pos = OpAdapter(lambda r: r, gather_inputs=[0])
    cs = compile(make_spec(HaloStoragePolicy(), pos), mesh2, golden_halo_plan(), positions={pos: [0]})
    x = sharded(mesh2, np.ones((6, 3)))
    shifted = jax.jit(lambda cs, x: cs.with_tables(dataclasses.replace(
        cs.tables, halo_offset=cs.tables.halo_offset + 5.0)).call(pos, x))(cs, x)
    np.testing.assert_array_equal(np.asarray(shifted), np.asarray(cs.call(pos, x)) + 5.0)
    with pytest.raises(ValueError, match=r"with_tables: the new tables must keep the layout"):
        cs.with_tables(dataclasses.replace(cs.tables, ghost_capacity=cs.tables.ghost_capacity + 1))


def test_make_mesh_errors():
    with pytest.raises(ValueError, match=r"asked for 9 devices but only 8 are available.*jax_num_cpu_devices"):
        make_mesh(9)
    with pytest.raises(ValueError, match="n_devices must be a positive int, got 0"):
        make_mesh(0)
    assert make_mesh(3, axis_name="x").shape == {"x": 3}


def test_storage_helpers_refuse_the_other_kind(mesh2):
    a = OpAdapter(double, gather_inputs_full=[0])
    plan = ShardPlan.from_assignment(np.array([0, 1, 1]), 2)
    cs = compile(make_spec(PlainShard(), a), mesh2, plan)
    with pytest.raises(ValueError, match=r"CompiledSpec.halo: the spec uses sharded storage \(PlainShard\)"):
        cs.halo(np.ones(3))
    with pytest.raises(ValueError, match=r"owned\(positions=True\): sharded storage has no image shifts"):
        cs.owned(np.ones((3, 3)), positions=True)
    with pytest.raises(TypeError, match="uses shard storage, so the new plan must be a ShardPlan, got SimpleNamespace"):
        cs.with_plan(golden_halo_plan())


def test_adapter_accessor_finds_by_adapter_op_and_name():
    from nvalchemi_jaxbridge import DistributionSpec

    from .plans import golden_halo_plan

    def kernel(x):
        return 2.0 * x

    a = OpAdapter(kernel, gather_inputs=[0], scatter_outputs=[0])
    cs = compile(DistributionSpec(policy=HaloStoragePolicy(), custom_ops=(a,)), make_mesh(2), golden_halo_plan())
    assert cs.adapter(a) is a and cs.adapter(kernel) is a and cs.adapter(a.describe().target) is a
    with pytest.raises(KeyError, match=r"not an adapter of this spec; known targets"):
        cs.adapter("demo::nope")


def test_a_plan_without_self_image_rows_is_refused_for_kernels(mesh2):
    """A kernel finds neighbours from the block's rows: a plan that left out images of a device's own atoms
    (self_images=False, the model level's) would make it miss them, so compile and with_plan refuse it."""
    from nvalchemi_jaxbridge.layout import HaloPlan

    pos = np.random.default_rng(0).uniform(0.0, 6.0, (24, 3))
    lean = HaloPlan.build(pos, np.eye(3) * 6.0, cutoff=2.0, n_devices=2, self_images=False)
    full = HaloPlan.build(pos, np.eye(3) * 6.0, cutoff=2.0, n_devices=2)
    assert sum(len(o) for o in lean.own_images) > 0  # the slab's y and z images are own atoms'
    spec = make_spec(HaloStoragePolicy(), OpAdapter(double, gather_inputs=[0]))
    with pytest.raises(ValueError, match=r"self_images=False .* build the plan with HaloPlan.build\(\.\.\., self_images=True\)"):
        compile(spec, mesh2, lean)
    cs = compile(spec, mesh2, full)
    with pytest.raises(ValueError, match="CompiledSpec.with_plan: the plan was built with self_images=False"):
        cs.with_plan(lean)
    compile(make_spec(HaloStoragePolicy()), mesh2, lean)  # no kernels (the model level's exchanges): fine
