"""A compiled XLA FFI call path for torch ops (issue 7): one C++ handler calls the op through
torch's dispatcher on XLA's buffers, with no Python on the bridge's side of the call; the
same handler runs the backward (the op under autograd, then `torch::autograd::grad`).

`torch_call.cc` is the handler, `build.py` compiles it (cached), `target.py` loads and
registers it, `plans.py` encodes a call's static arguments. `TorchOpKernel(...,
call_path=...)` is the way in; nothing here is needed directly.
"""
