"""Model files: a whole model saved with `torch.save` (or `pickle`), loaded as what `DistributedMLIP` takes.

    load_model("mace.model", trust=True)  ->  MACEWrapper(model)      (MACE's *.model, foundation checkpoints)
                                          ->  MPNNWrapper(model)      (the project's MPNN)
                                          ->  the saved MessagePassingWrapper itself
                                          ->  the LAMMPS ML-IAP model object itself (`is_mliap_model`)

A whole-model file is a pickle: loading it imports the classes it names and runs their
code. `load_model` therefore reads a file in two ways. Without `trust` it uses
`torch.load(weights_only=True)`, which runs no code but only ever returns tensors and
containers; a file that names other classes is refused, and the error lists them (read
from the pickle without running it). With `trust=True` it unpickles the file in full.
"""

from __future__ import annotations

import os
import pickle
import pickletools
import zipfile
from typing import Any

import torch

from .mliap import is_mliap_model as is_mliap_model  # the ML-IAP door's test, re-exported here
from .mpnn import MPNN, MPNNWrapper
from .protocol import MessagePassingWrapper

#: What to do with a file that holds weights only (a state_dict, a training checkpoint, safetensors).
_SAVE_WHOLE = ("build the model, load the weights into it (model.load_state_dict(...)), then save the whole "
               "model with torch.save(model, path); for MACE, use the *.model file that training writes")


class ModelFileError(ValueError):
    """A model file `load_model` cannot read, or that holds nothing it can run; the message says how to fix it."""


def load_model(path: str | os.PathLike[str], *, trust: bool = False) -> Any:
    """Load a model file as a model `DistributedMLIP` accepts.

    Trust: a whole model saved with `torch.save(model, path)` or `pickle` is a pickle, and
    unpickling it imports the classes it names and runs their code. With `trust=False`
    (default) the file is read with `torch.load(weights_only=True)`, which runs no code from
    it; such a load can only give tensors and containers, so a whole-model file is refused
    with a `ModelFileError` naming the classes inside (read statically, nothing run).
    Pass `trust=True` only for files whose source you trust (your own training, the model's
    publisher); the file is then unpickled in full (`torch.load(weights_only=False)`, or
    `pickle.load` for a plain pickle). Before unpickling a file that names MACE or e3nn
    classes, `mace` is imported (it must come before e3nn with torch >= 2.6; importing it sets
    `TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1` for the process, which does not change this function,
    as it always passes `weights_only` explicitly).

    Tensors are mapped to the CPU and keep the dtype they were saved in; the devices and the
    dtype of a run are `DistributedMLIP`'s business. Modules are put in `eval()` mode.

    Args:
        path: the file: MACE's `*.model` or a foundation checkpoint, a `torch.save`d `MPNN` or
            `MessagePassingWrapper`, or a LAMMPS ML-IAP model (`torch.save` or `pickle`, e.g.
            `mace_create_lammps_model MODEL --format=mliap`).
        trust: unpickle the file in full (runs code from it); see above.

    Returns:
        `MACEWrapper(model)` for a `mace.modules.MACE` / `ScaleShiftMACE`, `MPNNWrapper(model)` for an
        `MPNN`, a saved `MessagePassingWrapper` as it is, or an ML-IAP model object as it is.

    Raises:
        FileNotFoundError: no such file.
        ModelFileError: the file is not a model file (text, empty, damaged or cut short), holds
            weights only (a state_dict, a training checkpoint) or something else, is a TorchScript
            archive, or needs `trust=True`.
        ImportError: a class the file names lives in a package that is not installed.

    Example:
        >>> from nvalchemi_jaxbridge.integrations.ase_calculator import JaxBridgeCalculator
        >>> model = DistributedMLIP(load_model("mace.model", trust=True), n_devices=2)
        >>> atoms.calc = JaxBridgeCalculator(model)
    """
    p = os.fspath(path)
    if not os.path.exists(p):
        raise FileNotFoundError(
            f"load_model: no file {p!r}; give the path of a model file saved with torch.save(model, path) "
            "(e.g. MACE's *.model)."
        )
    if os.path.isdir(p):
        raise ModelFileError(f"load_model: {p} is a directory; name the model file inside it (e.g. its *.model).")
    kind = _file_kind(p)
    names = _pickled_globals(p, kind)
    if not trust:
        obj = _REFUSED if kind == "pickle" or names else _load(p, kind, weights_only=True)
        if obj is _REFUSED:
            head = names[0] if names else "Python object"
            more = f" and {len(names) - 1} other classes" if len(names) > 1 else ""
            raise ModelFileError(
                f"load_model: {p} holds a pickled {head}{more}; unpickling it runs code from the file, so "
                "load_model does that only when told the file is trusted: if you trust its source, call "
                "load_model(path, trust=True) (nvalchemi-jaxbridge run --model FILE does)."
            )
    else:
        if any(n.startswith(("mace.", "e3nn.")) for n in names):
            from .mace import _mace

            _mace()  # before e3nn: MACE's import order with torch >= 2.6
        obj = _load(p, kind, weights_only=False)
    return _as_model(obj, p)


# ------------------------------------------------------------------ reading


def _file_kind(p: str) -> str:
    """"zip" (torch.save), "legacy" (torch.save before torch 1.6) or "pickle" (pickle.dump); else refused."""
    with open(p, "rb") as f:
        head = f.read(64)
    if not head:
        raise ModelFileError(f"load_model: {p} is empty (0 bytes); save the model again with torch.save(model, path).")
    if head.startswith(b"PK\x03\x04"):
        try:
            with zipfile.ZipFile(p) as z:
                records = z.namelist()
        except zipfile.BadZipFile as e:
            raise ModelFileError(
                f"load_model: {p} is a damaged or cut-short torch file ({e}); copy or download it again, or "
                "save the model again with torch.save(model, path)."
            ) from None
        if any(r.split("/")[-1] == "constants.pkl" for r in records):
            raise ModelFileError(
                f"load_model: {p} is a TorchScript archive (torch.jit.save: e.g. MACE's *_compiled.model, or "
                "the *-lammps.pt that mace_create_lammps_model writes for pair_style mace), whose layers cannot "
                "be run one by one; use the eager model instead: the *.model file MACE training writes, or "
                "torch.save(model, path) of the Python module (an ML-IAP file from MACE: mace_create_lammps_model "
                "MODEL --format=mliap)."
            )
        return "zip"
    if head[0] == 0x80:  # pickle protocol 2 and above (torch.save uses 2)
        return "legacy" if _is_legacy(head) else "pickle"
    if p.endswith(".safetensors"):
        raise ModelFileError(f"load_model: {p} is a safetensors file, which holds weights only; {_SAVE_WHOLE}.")
    raise ModelFileError(
        f"load_model: {p} is not a torch.save or pickle file (it starts with {_show(head)}); give a model saved "
        "with torch.save(model, path), e.g. MACE's *.model."
    )


def _show(head: bytes) -> str:
    """The first bytes of a file, as text where they are text."""
    try:
        return repr(head[:24].decode())
    except UnicodeDecodeError:
        return f"the bytes {head[:8].hex(' ')}"


#: The first of the pickles in a file of torch's format before 1.6 (`torch.serialization.MAGIC_NUMBER`).
_LEGACY_MAGIC = 0x1950A86A20F9469CFC6C
#: `_load`'s answer when a weights-only load refuses the file.
_REFUSED = object()


def _is_legacy(head: bytes) -> bool:
    """The file starts with torch's legacy magic number, pickled on its own."""
    ops = []
    try:
        for op, arg, _ in pickletools.genops(head):
            ops.append((op.name, arg))
    except Exception:  # noqa: BLE001 - `head` cuts a longer pickle short
        return False
    return bool(ops) and ops[-1][0] == "STOP" and [a for n, a in ops if n not in ("PROTO", "STOP")] == [_LEGACY_MAGIC]


def _pickled_globals(p: str, kind: str) -> list[str]:
    """`module.name` of the classes and functions the file's pickle names that a weights-only load refuses,
    in order (the saved object's own class first), read without running the pickle; none for a "legacy"
    file (its weights-only load decides).
    """
    if kind == "legacy":
        return []
    try:
        if kind == "zip":
            with zipfile.ZipFile(p) as z:
                data = z.read(next(r for r in z.namelist() if r.split("/")[-1] == "data.pkl"))
        else:
            with open(p, "rb") as f:
                data = f.read()
        names = _scan(data)
    except Exception as e:  # noqa: BLE001 - a damaged pickle: say so
        raise ModelFileError(
            f"load_model: {p} cannot be read as a pickle ({type(e).__name__}: {e}); the file is damaged or cut "
            "short: copy or download it again, or save the model again with torch.save(model, path)."
        ) from None
    if kind == "zip":
        try:
            unsafe = set(torch.serialization.get_unsafe_globals_in_checkpoint(p))
        except Exception:  # noqa: BLE001 - an older torch or an odd archive: report every name
            return names
        names = [n for n in names if n in unsafe]
    return names


def _scan(data: bytes) -> list[str]:
    """The globals named by the first pickle in `data`: GLOBAL / INST arguments and the two strings under
    STACK_GLOBAL, each once, in order."""
    names: list[str] = []
    pushed: list[Any] = []  # what each op pushed: the string, or None (enough to resolve STACK_GLOBAL)
    memo: dict[int, Any] = {}
    for op, arg, _ in pickletools.genops(data):
        name = op.name
        if name in ("GLOBAL", "INST"):
            names.append(arg.replace(" ", "."))
        elif name == "STACK_GLOBAL":
            mod, attr = pushed[-2:] if len(pushed) >= 2 else (None, None)
            if isinstance(mod, str) and isinstance(attr, str):
                names.append(f"{mod}.{attr}")
            pushed.append(None)
        elif name == "MEMOIZE":
            memo[len(memo)] = pushed[-1] if pushed else None
        elif name in ("PUT", "BINPUT", "LONG_BINPUT"):
            memo[arg] = pushed[-1] if pushed else None
        elif name in ("GET", "BINGET", "LONG_BINGET"):
            pushed.append(memo.get(arg))
        elif name not in ("PROTO", "FRAME", "STOP"):
            pushed.append(arg if isinstance(arg, str) and "UNICODE" in name else None)
    return list(dict.fromkeys(names))


def _load(p: str, kind: str, *, weights_only: bool) -> Any:
    """The file's object (`torch.load`, or `pickle.load` for a plain pickle), or `_REFUSED`."""
    try:
        if kind != "pickle":
            return torch.load(p, map_location="cpu", weights_only=weights_only)
        with open(p, "rb") as f:  # a plain pickle (e.g. an ML-IAP *.pkl); load_model comes here only with trust
            return pickle.load(f)  # noqa: S301
    except ModuleNotFoundError as e:
        raise ImportError(
            f"load_model: {p} holds objects of the module {e.name!r}, which is not installed; install the package "
            "that defines the model (MACE: pip install 'nvalchemi_jaxbridge[mlip]')."
        ) from e
    except (pickle.UnpicklingError, RuntimeError, EOFError) as e:
        if weights_only and isinstance(e, pickle.UnpicklingError) and "weights only" in str(e).lower():
            return _REFUSED
        raise ModelFileError(
            f"load_model: {p} cannot be read ({type(e).__name__}: {str(e).splitlines()[0]}); if the file is "
            "damaged or cut short, copy or download it again, or save the model again with torch.save(model, path)."
        ) from e


# ------------------------------------------------------------------ what the file held


def _as_model(obj: Any, p: str) -> Any:
    """The loaded object as what `DistributedMLIP` takes, or a `ModelFileError` saying what it is."""
    if isinstance(obj, MessagePassingWrapper) or is_mliap_model(obj):
        return obj
    if isinstance(obj, MPNN):
        return MPNNWrapper(obj.eval())
    cls = f"{type(obj).__module__}.{type(obj).__qualname__}"
    if type(obj).__module__.split(".")[0] == "mace" and isinstance(obj, torch.nn.Module):
        from mace.modules import MACE

        if not isinstance(obj, MACE):
            raise ModelFileError(
                f"load_model: {p} holds a {cls}, a MACE model that is not an energy model (mace.modules.MACE or "
                "ScaleShiftMACE); load_model runs those only."
            )
        from .mace import MACEWrapper

        return MACEWrapper(obj.eval())
    if isinstance(obj, dict):
        keys = list(obj)
        if keys and all(isinstance(v, torch.Tensor) for v in obj.values()):
            raise ModelFileError(
                f"load_model: {p} holds a state_dict ({len(keys)} tensors, e.g. {keys[0]!r}): the weights without "
                f"the model; {_SAVE_WHOLE}."
            )
        raise ModelFileError(
            f"load_model: {p} holds a dict with keys {keys[:6]} (a training checkpoint?), not a model; "
            f"{_SAVE_WHOLE}."
        )
    if isinstance(obj, torch.Tensor):
        raise ModelFileError(
            f"load_model: {p} holds a tensor of shape {tuple(obj.shape)}, not a model; save the model itself "
            "with torch.save(model, path)."
        )
    if isinstance(obj, torch.nn.Module):
        raise ModelFileError(
            f"load_model: {p} holds a {cls}, a torch module load_model has no wrapper for; write a "
            "MessagePassingWrapper for it (docs/guide.md, 'Writing a wrapper for your own model') and pass "
            "DistributedMLIP(MyWrapper(model)), or torch.save the wrapper itself."
        )
    raise ModelFileError(
        f"load_model: {p} holds a {cls}, not a model; give a MACE model (*.model), an MPNN, a "
        "MessagePassingWrapper or a LAMMPS ML-IAP model saved with torch.save(model, path)."
    )
