"""The verdict on one call of a torch op with a row-layout ShardTensor, and the wording of the reasons."""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class Verdict:
    """What to do with one call (see `meaning.py`).

    `action`: "run", "owned_sum", "owned_mean", "owned_all_any", "index_sum" or
    "refuse". For "run", `args` /
    `kwargs` (when not None) replace the call's (the layout's meaning of the op),
    and a result that leaves the row layout is refused after the call unless
    `plain_ok`. `why`, `hint`, `aten` and `family` word the refusal.
    """

    action: str
    why: str = ""
    hint: str = ""  # the family's own fix, said before the general ones
    plain_ok: bool = False
    aten: str = ""  # the aten op when the Python name does not say it (x[None] is aten::unsqueeze)
    family: str = ""
    args: tuple | None = None
    kwargs: dict[str, Any] | None = None


RUN = Verdict("run")
PLAIN = Verdict("run", plain_ok=True)


def refused(why: str, hint: str = "", *, aten: str = "") -> Verdict:
    """A refusal with its reason and the family's own fix."""
    return Verdict("refuse", why, hint, aten=aten)


WHY_REDUCE = "reduces over the atom dimension (dim 0)"
WHY_CONTRACT = "contracts or pairs the atom dimension (dim 0)"
WHY_ALONG = "mixes rows along the atom dimension (dim 0)"
WHY_MOVE = "moves the atom dimension away from dim 0"
WHY_PAIRS = "pairs every atom row with every other row (an all-pairs result over this rank's block only)"
WHY_SCATTER_IN = ("accumulates into this rank's atom rows by index; whether partials on ghost rows must "
                  "be folded into their owners is not known")
WHY_SCATTER_OUT = "scatters atom rows by index into another row space, where ghost rows would count again"
WHY_GATHER = ("gathers rows with an index tensor; the result leaves the row layout, so its ghost rows "
              "can no longer be told apart from owned rows")
WHY_HOST = "reads this rank's block as a Python or host value: a per-rank partial, not the global value"
WHY_CUSTOM = "is a custom op with no OpAdapter installed, so how its rows cross ranks is not declared"
WHY_UNKNOWN = ("is not in the catalogue of ops known to keep atom rows apart (default deny: "
               "nvalchemi_jaxbridge/torch/op_catalogue.py)")
WHY_VMAP = ("runs under torch.vmap, which maps over rows of the block: the atom dimension is hidden in the "
            "batch dimension, so rows meet rows of this rank's block only")
HINT_SUM = "for a sum over atoms use x.sum(0) or x.system_sum(); "
HINT_SYSTEMS = "for a per-system sum use x.system_sum(batch, n_systems=...); "
HINT_HOST = "x.full_tensor() gives the global array (a collective), x.to_local() this rank's block; "
HINT_GATHER = "take the owned rows with x[:x.n_owned]; "
HINT_PAIRS = ("a pair model is a kernel that reads its neighbours' rows: declare it with "
              "OpAdapter(op, gather_inputs=[...]) (a halo of one cutoff) or run it on x.full_tensor(); ")
HINT_CUSTOM = "install its OpAdapter (adapter.install() or `with installed(adapter):`); "
