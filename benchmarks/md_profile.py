"""MD step under the GPU profiler: where each step's device time goes, native against the bridge (GPU only).

`torch.profiler` (CUPTI sees XLA's kernels as well as torch's and Triton's) records a block of pipelined
steps of each side; per step: device busy time by source (the op's kernels, XLA's, copies and fills), the
idle time (the profiled block's wall time minus busy: the device waiting for the host), kernels launched,
and the host's synchronisations and the time spent waiting in them. The "op alone" rows call the op in
plain torch on the rows each side hands it (native: the one-device halo rows; bridge: its halo block,
padding rows included), to tell the op's own cost on that block from the cost of calling it.
"""

from __future__ import annotations

from benchmarks import common as cm



def table(rep: cm.Report, steps: int) -> cm.Table:
    return rep.table(f"MD step under the profiler, per step ({steps} steps back to back)", [
        "kernel", "atoms", "run", "wall ms", "device busy ms: op / xla / copy", "idle ms", "kernels",
        "host syncs (waiting ms)"])


def add_rows(table: cm.Table, kernel: str, case, native: cm.Run, bridge: cm.Run, native_args, info: dict, dev,
             steps: int) -> None:
    """Profile `steps` pipelined steps of each side and of the op alone on each side's rows; one row each."""
    import torch

    from benchmarks.md_step import op_for

    op = op_for(kernel)
    b_args = [torch.from_dlpack(x) for x in info["op_args"]()]
    n_args = native_args()
    tsync = cm.torch_sync(dev)
    runs = {"native": native, "bridge": bridge,
            "op alone, native rows": (lambda: op(*n_args, cutoff=case.cutoff), tsync),
            "op alone, bridge rows": (lambda: op(*b_args, cutoff=case.cutoff), tsync)}
    for name, (fn, sync) in runs.items():
        p = cm.profile(fn, sync, steps)
        b = p["busy"]
        table.add(kernel, case.n, name, cm.ms(p["wall"]), " / ".join(cm.ms(b.get(k, 0.0)) for k in ("op", "xla", "copy")),
                  cm.ms(max(p["wall"] - p["busy_total"], 0.0)), f"{sum(p['kernels'].values()):.0f}",
                  f"{p['syncs']:.1f} ({cm.ms(p['wait'])})")
