"""Model level: message-passing MLIPs distributed with per-layer halo exchange (see docs/guide.md).

A `MessagePassingWrapper` cuts a torch model into stages; `DistributedMLIP` runs
them on the domain decomposition (JAX front door, one process) and returns
energy, forces, stress and atomic energies in global order.
"""

from .edges import EdgePlan as EdgePlan
from .jax_model import DistributedMLIP as DistributedMLIP
from .jax_model import ModelState as ModelState
from .mpnn import MPNN as MPNN
from .mpnn import MPNNWrapper as MPNNWrapper
from .protocol import BlockGraph as BlockGraph
from .protocol import MessagePassingWrapper as MessagePassingWrapper
from .protocol import shared_edge_features as shared_edge_features
from .specs import RunSettings as RunSettings
from .torch_model import TorchDistributedMLIP as TorchDistributedMLIP
from .specs import default_spec as default_spec
from .model_files import load_model as load_model
from .check import WrapperCheck as WrapperCheck
from .check import WrapperCheckError as WrapperCheckError
from .check import check_wrapper as check_wrapper
