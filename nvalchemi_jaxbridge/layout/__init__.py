"""layout layer: who owns which row (numpy only; imports neither jax nor torch). See docs/design.md."""

from .grid import choose_grid as choose_grid
from .halo_plan import HaloOverflowError as HaloOverflowError
from .halo_plan import HaloPlan as HaloPlan
from .shard_plan import ShardPlan as ShardPlan
