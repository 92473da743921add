"""lower layer: meshes, transforms as XLA collectives, compile(spec, mesh, plan) (see docs/design.md)."""

from .compile import CompiledSpec as CompiledSpec
from .compile import compile as compile
from .entries import jax_kernel as jax_kernel
from .exchange import check_exchanges as check_exchanges
from .exchange import exchanges_of as exchanges_of
from .mesh import field_shardings as field_shardings
from .mesh import auto_mesh as auto_mesh
from .mesh import make_mesh as make_mesh
from .tables import HaloTables as HaloTables
from .tables import ShardTables as ShardTables
from .tables import device_tables as device_tables
