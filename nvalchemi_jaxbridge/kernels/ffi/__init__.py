"""A compiled XLA FFI call path for torch ops (issue 7): one C++ handler calls the op through
torch's dispatcher on XLA's buffers, with no Python on the bridge's side of the call; the
same handler runs a differentiated call (the op once under autograd, its graph kept for the
backward, `graphs.cc`) and the backward (`torch::autograd::grad` on that graph).

`torch_call.cc` is the handler (with, in one translation unit, `buffers.cc`: XLA's buffers as
tensors and results written back; `autograd_calls.cc`: a differentiated call's forward and
backward; `plan.cc`, the plan decoder; `graphs.cc`, the kept graphs), `build.py` compiles it
(cached), `target.py` loads and registers it,
`plans.py` encodes a call's static arguments. `TorchOpKernel(...,
call_path=...)` is the way in; nothing here is needed directly.
"""
