"""Third-party adapters (install/restore on real module attributes), AdapterRegistry, installed()."""

from __future__ import annotations

import json
import sys
import types

import pytest
from hypothesis import given

import nvalchemi_jaxbridge as nb
from nvalchemi_jaxbridge.spec import third_party

from ._helpers import HELPERS, canon


@pytest.fixture
def target_module():
    """A throwaway importable module `spec_target_mod` with a function and a class."""
    mod = types.ModuleType("spec_target_mod")

    def mol_sum(x):
        return sum(x)

    class Block:
        def forward(self, x):
            return x + 1

    class Child(Block):
        pass

    mod.mol_sum, mod.Block, mod.Child = mol_sum, Block, Child
    mol_sum.__module__ = Block.__module__ = Child.__module__ = "spec_target_mod"
    Block.__qualname__, Child.__qualname__ = "Block", "Child"
    sys.modules["spec_target_mod"] = mod
    yield mod
    del sys.modules["spec_target_mod"]


def owned_sum(x):
    """A module-level replacement (importable as tests.spec.test_third_party_registry:owned_sum)."""
    return -sum(x)


def times_ten(original, self, x):
    """A MethodAdapter wrapper: calls the original method and scales its result."""
    return 10 * original(self, x)


REPLACEMENT_NAME = f"{__name__}:owned_sum"


@pytest.mark.parametrize("replacement", [owned_sum, REPLACEMENT_NAME])
def test_python_adapter_swaps_and_restores(target_module, replacement):
    original = target_module.mol_sum
    a = nb.PythonAdapter("spec_target_mod", "mol_sum", replacement)
    memento = a.install()
    assert memento["module"] is target_module and memento["original"] is original
    assert target_module.mol_sum([1, 2]) == -3
    a.restore(memento)
    assert target_module.mol_sum is original


def test_declaration_only_adapters_install_nothing(target_module):
    original = target_module.mol_sum
    for a in (nb.PythonAdapter("spec_target_mod", "mol_sum"), nb.JitAdapter("spec_target_mod", "mol_sum"),
              nb.MethodAdapter("spec_target_mod", "Block", "forward"),
              nb.ModuleForwardAdapter(None, label="tp", declared_target="x.Y.forward")):
        assert a.install() == {"deferred": True}
        a.restore({"deferred": True})
    assert target_module.mol_sum is original


def test_jit_adapter_eager_and_marshal(target_module, monkeypatch):
    original = target_module.mol_sum
    a = nb.JitAdapter("spec_target_mod", "mol_sum", owned_sum, "eager")
    m = a.install()
    assert target_module.mol_sum is owned_sum
    a.restore(m)
    seen = []
    monkeypatch.setattr(third_party, "_marshaller", lambda: lambda fn: (seen.append(fn), lambda *a: ("marshalled", fn(*a)))[1])
    b = nb.JitAdapter("spec_target_mod", "mol_sum", mode="marshal")
    m = b.install()
    assert seen == [original] and target_module.mol_sum([1, 2]) == ("marshalled", 3)
    b.restore(m)
    assert target_module.mol_sum is original


def test_method_adapter_forms_and_wrap(target_module):
    Block = target_module.Block
    forms = [
        nb.MethodAdapter(Block, "forward", times_ten),
        nb.MethodAdapter("spec_target_mod", "Block", "forward", times_ten),
        nb.MethodAdapter(module_path="spec_target_mod", class_name="Block", method_name="forward",
                         replacement=f"{__name__}:times_ten"),
    ]
    assert forms[0] == forms[1] == forms[2] and len(set(forms)) == 1
    original = Block.forward
    m = forms[2].install()
    assert Block().forward(4) == 50  # (4 + 1) * 10
    forms[2].restore(m)
    assert Block.forward is original and Block().forward(4) == 5


def test_method_adapter_on_an_inherited_method_restores_inheritance(target_module):
    Child, Block = target_module.Child, target_module.Block
    a = nb.MethodAdapter(Child, "forward", times_ten)
    m = a.install()
    assert Child().forward(1) == 20 and Block().forward(1) == 2
    a.restore(m)
    assert "forward" not in vars(Child) and Child().forward(1) == 2


def test_module_forward_adapter_swaps_instance_forward(target_module):
    block = target_module.Block()
    a = nb.ModuleForwardAdapter(block, lambda x: "swapped", label="tp")
    assert a.describe().kind == "method" and a.describe().target == "spec_target_mod.Block.forward"
    m = a.install()
    assert block.forward(1) == "swapped"
    a.restore(m)
    assert "forward" not in vars(block) and block.forward(1) == 2
    d = a.to_dict()
    assert d == {"kind": "module_forward", "target": "spec_target_mod.Block.forward", "label": "tp"}
    declared = nb.ModuleForwardAdapter.from_dict(d)
    assert declared.module is None and declared.to_dict() == d  # the target survives the round trip


def test_function_adapter(target_module):
    a = nb.FunctionAdapter(target_module.mol_sum, owned_sum)
    assert type(a) is nb.PythonAdapter and (a.module_path, a.attr_name) == ("spec_target_mod", "mol_sum")
    alias = target_module.mol_sum
    target_module.other = alias
    del target_module.mol_sum
    with pytest.raises(nb.SpecError, match=r"spec_target_mod\.mol_sum is not the object passed.*PythonAdapter\(module_path=\.\.\., attr_name=\.\.\.\)"):
        nb.FunctionAdapter(alias)
    with pytest.raises(TypeError, match=r"module-level function with __module__ and __name__"):
        nb.FunctionAdapter(3)  # type: ignore[arg-type]


def test_describe_kinds_and_targets():
    assert nb.PythonAdapter("a.b", "f").describe().kind == "python"
    assert nb.JitAdapter("a.b", "f").describe().target == "a.b.f"
    m = nb.MethodAdapter("a.b", "C", "m", install_site="s:1")
    assert m.describe() == nb.AdapterStatus("method", "a.b.C.m", "pending", "s:1")


@given(HELPERS)
def test_helper_round_trip(h):
    d = h.to_dict()
    back = third_party.adapter_from_dict(json.loads(json.dumps(d)))
    assert back == h and hash(back) == hash(h) and canon(back.to_dict()) == canon(d)


def test_callable_and_named_replacements_are_equal():
    assert nb.PythonAdapter("a", "f", owned_sum) == nb.PythonAdapter("a", "f", REPLACEMENT_NAME)
    assert nb.PythonAdapter("a", "f", lambda: 1) != nb.PythonAdapter("a", "f", lambda: 1)


@pytest.mark.parametrize(
    ("build", "exc", "match"),
    [
        (lambda: nb.PythonAdapter("a b", "f"), nb.SpecError, r"module_path must be a dotted module path"),
        (lambda: nb.PythonAdapter("a", "f", "no_colon"), nb.SpecError, r"replacement 'no_colon' is not of the form 'module\.path:qualname'"),
        (lambda: nb.PythonAdapter("a", "f", 3), TypeError, r"replacement must be a callable"),
        (lambda: nb.JitAdapter("a", "f", mode="marshall"), nb.SpecError, r"unknown mode 'marshall'; did you mean 'marshal'\?"),
        (lambda: nb.MethodAdapter("a", "C", "m", mode="wrapp"), nb.SpecError, r"unknown mode 'wrapp'; did you mean 'wrap'\?"),
        (lambda: nb.MethodAdapter(), TypeError, r"MethodAdapter needs a class and a method"),
        (lambda: nb.ModuleForwardAdapter(None), nb.SpecError, r"needs declared_target"),
        (lambda: nb.ModuleForwardAdapter(object(), None), TypeError, r"replacement must be the callable"),
    ],
)
def test_helper_construction_errors(build, exc, match):
    with pytest.raises(exc, match=match):
        build()


@pytest.mark.parametrize(
    ("d", "match"),
    [
        ({"kind": "pyton", "module_path": "a", "attr_name": "f"}, r"\$\.h\.kind: unknown adapter kind 'pyton'; did you mean 'python'\?"),
        ({"module_path": "a", "attr_name": "f"}, r"\$\.h: adapter has no \"kind\""),
        ({"op": "a::b"}, r"op adapters go in custom_ops"),
        ({"kind": "python", "module_path": "a"}, r"missing 'attr_name'"),
        ({"kind": "python", "module_path": "a", "attr_name": "f", "mode": "eager"}, r"\$\.h\.mode: unknown key for a 'python' adapter: 'mode'"),
        ({"kind": "method", "module_path": "a", "class_name": "C", "method_name": "m", "mode": "x"}, r"\$\.h\.mode: unknown mode 'x'"),
    ],
)
def test_helper_decoding_errors(d, match):
    with pytest.raises(nb.SpecError, match=match):
        third_party.adapter_from_dict(d, where="$.h")


def test_install_errors_name_module_and_fix(target_module):
    with pytest.raises(ModuleNotFoundError, match=r"cannot import module 'no_such_mod_q'.*install the package"):
        nb.PythonAdapter("no_such_mod_q", "f", owned_sum).install()
    with pytest.raises(AttributeError, match=r"module 'spec_target_mod' has no attribute 'nope'"):
        nb.PythonAdapter("spec_target_mod", "nope", owned_sum).install()
    with pytest.raises(nb.SpecError, match=r"local function or lambda and cannot be imported"):
        nb.PythonAdapter("spec_target_mod", "mol_sum", "m:f.<locals>.g").install()
    with pytest.raises(nb.SpecError, match=r"has no attribute 'nope'"):
        nb.PythonAdapter("spec_target_mod", "mol_sum", f"{__name__}:nope").install()


@pytest.fixture
def adapter_registry():
    saved = dict(third_party._ADAPTER_KINDS)
    yield
    third_party._ADAPTER_KINDS.clear()
    third_party._ADAPTER_KINDS.update(saved)


class Tagged(nb.PythonAdapter):
    """A custom kind: a PythonAdapter written as "tagged"."""

    kind = "tagged"

    @classmethod
    def from_dict(cls, d):
        return cls(d["module_path"], d["attr_name"], d.get("replacement"))


def test_register_adapter_kind(adapter_registry):
    d = {"kind": "tagged", "module_path": "a", "attr_name": "f", "replacement": None}
    with pytest.raises(nb.SpecError, match=r"unknown adapter kind 'tagged'.*register_adapter_kind"):
        third_party.adapter_from_dict(d)
    nb.register_adapter_kind("tagged", Tagged)
    h = third_party.adapter_from_dict(d)
    assert type(h) is Tagged and h.to_dict() == d
    assert nb.load_spec({"policy": {"kind": "local"}, "third_party_helpers": [d]}).to_dict()["third_party_helpers"] == [d]
    with pytest.raises(nb.SpecError, match=r"'python' is a built-in adapter kind"):
        nb.register_adapter_kind("python", Tagged)
    with pytest.raises(TypeError, match=r"missing \['from_dict', 'to_dict', 'install', 'restore', 'describe'\]"):
        nb.register_adapter_kind("x", int)


# ------------------------------------------------------------------------- registry


class Recorder:
    """A minimal adapter that logs install/restore calls and can be told to fail."""

    def __init__(self, name, log, fail_install=False, fail_restore=False):
        self.name, self.log, self.fail_install, self.fail_restore = name, log, fail_install, fail_restore

    def install(self):
        if self.fail_install:
            raise ModuleNotFoundError(f"no module for {self.name}")
        self.log.append(("install", self.name))
        return self.name

    def restore(self, memento):
        if self.fail_restore:
            raise RuntimeError("cannot restore")
        self.log.append(("restore", memento))

    def describe(self, state="pending", error=None):
        return nb.AdapterStatus("python", self.name, state, "", error)

    def to_dict(self):
        return {}


def test_registry_installs_in_order_and_restores_in_reverse_idempotently():
    log = []
    reg = nb.AdapterRegistry()
    reg.install([Recorder("a", log), Recorder("b", log)])
    assert [s.state for s in reg.list_active()] == ["installed", "installed"]
    reg.restore()
    reg.restore()
    assert log == [("install", "a"), ("install", "b"), ("restore", "b"), ("restore", "a")]
    assert [(s.target, s.state, s.error) for s in reg.list_active()] == [("a", "restored", None), ("b", "restored", None)]


def test_registry_rolls_back_everything_on_failure_and_reraises():
    log = []
    reg = nb.AdapterRegistry()
    reg.install([Recorder("early", log)])
    with pytest.raises(ModuleNotFoundError, match="no module for bad"):
        reg.install([Recorder("a", log), Recorder("bad", log, fail_install=True), Recorder("never", log)])
    assert log == [("install", "early"), ("install", "a"), ("restore", "a"), ("restore", "early")]
    states = [(s.target, s.state) for s in reg.list_active()]
    assert states == [("early", "restored"), ("a", "restored"), ("bad", "failed")]
    assert "no module for bad" in reg.list_active()[2].error


def test_registry_restore_records_errors_and_continues():
    log = []
    reg = nb.AdapterRegistry()
    reg.install([Recorder("a", log), Recorder("b", log, fail_restore=True)])
    reg.restore()
    status = {s.target: s for s in reg.list_active()}
    assert status["a"].state == "restored" and status["b"].state == "installed"
    assert "cannot restore" in status["b"].error


def test_installed_context_restores_even_when_the_body_raises(target_module):
    original = target_module.mol_sum
    spec = nb.DistributionSpec(nb.HaloStoragePolicy(), adapters=(nb.PythonAdapter("spec_target_mod", "mol_sum", owned_sum),))
    with pytest.raises(KeyError):
        with spec.installed() as reg:
            assert target_module.mol_sum is owned_sum
            assert [s.state for s in reg.list_active()] == ["installed"]
            raise KeyError("body failed")
    assert target_module.mol_sum is original
    assert [s.state for s in reg.list_active()] == ["restored"]


def test_installed_context_rolls_back_when_an_install_fails(target_module):
    original = target_module.mol_sum
    spec = nb.DistributionSpec(
        None,
        third_party_helpers=(nb.PythonAdapter("spec_target_mod", "mol_sum", owned_sum), nb.PythonAdapter("no_such_mod_q", "f", owned_sum)),
    )
    with pytest.raises(ModuleNotFoundError):
        with spec.installed():
            pytest.fail("the body must not run")
    assert target_module.mol_sum is original


def test_op_adapter_with_a_missing_op_fails_the_whole_install(target_module):
    original = target_module.mol_sum
    spec = nb.DistributionSpec(None, (nb.OpAdapter("nosuchns_q::op"),), (nb.PythonAdapter("spec_target_mod", "mol_sum", owned_sum),))
    pytest.importorskip("torch")
    with pytest.raises(RuntimeError, match=r"no op is registered in namespace 'nosuchns_q'"):
        with spec.installed():
            pass
    assert target_module.mol_sum is original
