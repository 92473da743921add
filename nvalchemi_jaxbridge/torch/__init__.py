"""PyTorch front door: `ShardTensor`, the dispatch registry, install/restore, multi-process.

One process per device (as in torchrun jobs): `initialize()` brings up
`jax.distributed`, `ShardTensor` holds this process's local block, and an
installed `OpAdapter` hands the blocks to the lowered JAX programs when the
model calls the adapted op. Importing this package imports torch and jax.
"""

from .context import installed as installed
from .dispatch import HandlerInfo as HandlerInfo
from .dispatch import Memento as Memento
from .dispatch import install_adapter as install_adapter
from .dispatch import list_handlers as list_handlers
from .dispatch import restore_adapter as restore_adapter
from .distributed import ProcessInfo as ProcessInfo
from .distributed import initialize as initialize
from .distributed import process_info as process_info
from .distributed import shutdown as shutdown
from .layer_exchange import fold_halo as fold_halo
from .layer_exchange import refresh_halo as refresh_halo
from .interop import from_nvalchemi as from_nvalchemi
from .meaning import ShardTensorMeaningError as ShardTensorMeaningError
from .shard_tensor import ShardTensor as ShardTensor
