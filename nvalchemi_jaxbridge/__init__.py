"""nvalchemi_jaxbridge: nvalchemi-toolkit's OpAdapter / DistributionSpec, lowered to JAX collectives.

The package root only re-exports. Importing it (and loading a spec file) imports
neither jax nor torch.
"""

from importlib.metadata import PackageNotFoundError as _PackageNotFoundError
from importlib.metadata import version as _version

from .spec import AdapterRegistry as AdapterRegistry
from .spec import CompilePolicy as CompilePolicy
from .spec import ForceStrategy as ForceStrategy
from .spec import MLIPSpec as MLIPSpec
from .spec import OutputKind as OutputKind
from .spec import OutputSpec as OutputSpec
from .spec import Reduce as Reduce
from .spec import SPEC_DFTD3_HALO as SPEC_DFTD3_HALO
from .spec import SPEC_EWALD_HALO as SPEC_EWALD_HALO
from .spec import SPEC_LJ_HALO as SPEC_LJ_HALO
from .spec import SPEC_MPNN_GP as SPEC_MPNN_GP
from .spec import SPEC_MPNN_HALO as SPEC_MPNN_HALO
from .spec import SPEC_PME_HALO as SPEC_PME_HALO
from .spec import SPEC_UMA_HALO as SPEC_UMA_HALO
from .spec import AdapterStatus as AdapterStatus
from .spec import AllReduceSum as AllReduceSum
from .spec import ArgTransform as ArgTransform
from .spec import DistributionSpec as DistributionSpec
from .spec import FunctionAdapter as FunctionAdapter
from .spec import GatherInputs as GatherInputs
from .spec import GatherInputsFull as GatherInputsFull
from .spec import GraphParallelPolicy as GraphParallelPolicy
from .spec import HaloStoragePolicy as HaloStoragePolicy
from .spec import JitAdapter as JitAdapter
from .spec import MethodAdapter as MethodAdapter
from .spec import ModuleForwardAdapter as ModuleForwardAdapter
from .spec import OpAdapter as OpAdapter
from .spec import OutputTransform as OutputTransform
from .spec import PlainShard as PlainShard
from .spec import Problem as Problem
from .spec import PythonAdapter as PythonAdapter
from .spec import RefreshOnlyHaloPolicy as RefreshOnlyHaloPolicy
from .spec import ScatterOutputs as ScatterOutputs
from .spec import SliceOutputsOwned as SliceOutputsOwned
from .spec import SliceOwned as SliceOwned
from .spec import SpecError as SpecError
from .spec import SpecFile as SpecFile
from .spec import StoragePolicy as StoragePolicy
from .spec import check_spec_file as check_spec_file
from .spec import load_spec as load_spec
from .spec import policy_from_dict as policy_from_dict
from .spec import policy_to_dict as policy_to_dict
from .spec import register_adapter_kind as register_adapter_kind
from .spec import register_policy_kind as register_policy_kind
from .spec import save_spec as save_spec

# Runtime names load their layer (numpy, jax, torch) on first access only.
_LAZY = {
    "compile": "nvalchemi_jaxbridge.kernels",
    "make_mesh": "nvalchemi_jaxbridge.lower",
    "CompiledSpec": "nvalchemi_jaxbridge.lower",
    "HaloPlan": "nvalchemi_jaxbridge.layout",
    "ShardPlan": "nvalchemi_jaxbridge.layout",
    "HaloOverflowError": "nvalchemi_jaxbridge.layout",
    "ShardTensor": "nvalchemi_jaxbridge.torch",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'nvalchemi_jaxbridge' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


try:
    __version__ = _version("nvalchemi_jaxbridge")
except _PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0+unknown"
