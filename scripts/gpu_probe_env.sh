#!/usr/bin/env bash
# Print what a GPU machine offers for building the FFI extension and which NCCL transports XLA/torch use.
set -u
echo "== compilers"; (g++ --version | head -1; which nvcc; nvcc --version 2>/dev/null | tail -1) 2>&1
python3 - <<'PY'
import glob, os, site, torch, jax
import torch.utils.cpp_extension as c
print("torch", torch.__version__, "cuda", torch.version.cuda, "abi", torch._C._GLIBCXX_USE_CXX11_ABI)
print("CUDA_HOME", c.CUDA_HOME, "jax", jax.__version__, "ffi include", jax.ffi.include_dir())
print("torch include", c.include_paths()[:2])
for sp in site.getsitepackages():
    hits = glob.glob(os.path.join(sp, "nvidia", "*", "include", "cuda_runtime_api.h")) + \
           glob.glob(os.path.join(sp, "nvidia", "*", "*", "include", "cuda_runtime_api.h"))
    print("pip CUDA headers", hits)
PY
echo "== NCCL transport of a jitted ppermute (2 GPUs, one process)"
NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,P2P XLA_PYTHON_CLIENT_PREALLOCATE=false python3 - 2>&1 <<'PY' | grep -E "via|P2P|SHM|NVLS|Channel 00|nccl" | sort | uniq -c | sort -rn | head -15
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
m = Mesh(np.array(jax.devices()[:2]), ("a",))
f = jax.jit(jax.shard_map(lambda x: jax.lax.ppermute(x, "a", [(0, 1), (1, 0)]), mesh=m, in_specs=P("a"), out_specs=P("a")))
x = jax.device_put(jnp.ones((2 << 20,)), NamedSharding(m, P("a")))
print(float(f(x).sum()))
PY
