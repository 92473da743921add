#!/usr/bin/env bash
# The kernel-call part of issue 7 on a GPU machine, in one command (about 6-8 minutes):
#
#   PYTHONPATH=. scripts/gpu_kernel_batch.sh OUTDIR
#
# wrap-torch2jax's extension is compiled in the background (needs .whl/wrap_torch2jax-*.whl,
# see benchmarks/RESULTS.md) while both call paths are checked for correctness on the GPU
# (scripts/gpu_kernels_check.py, then the GPU-only tests of both paths); then the suite's kernel question
# (python -m benchmarks run kernel) measures all paths in one run. Logs and tables go to OUTDIR.
set -u
OUT=${1:?usage: scripts/gpu_kernel_batch.sh OUTDIR}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
log() { echo "[$(date +%H:%M:%S)] $*"; }
log "wrap-torch2jax: building its extension in the background"
JAX_PLATFORMS=cpu MAX_JOBS=16 timeout 420 "$PY" -c "import benchmarks.kernel_call as k; raise SystemExit(0 if k.build_torch2jax() else 1)" \
  > "$OUT/torch2jax_build.log" 2>&1 &
PRE=$!
log "gpu_kernels_check"
timeout 240 "$PY" scripts/gpu_kernels_check.py > "$OUT/gpu_kernels_check.log" 2>&1
log "gpu_kernels_check exit $?"; grep -E "^(PASS|FAIL)" "$OUT/gpu_kernels_check.log" | tail -3
log "GPU tests of the FFI path"
JAX_PLATFORMS=cuda,cpu TRITON_INTERPRET=0 timeout 240 "$PY" -m pytest tests/kernels/test_ffi_path.py tests/kernels/test_call_path.py -k gpu -q -p no:cacheprovider \
  > "$OUT/pytest_gpu.log" 2>&1
log "pytest exit $?"; tail -3 "$OUT/pytest_gpu.log"
for _ in $(seq 300); do kill -0 "$PRE" 2>/dev/null || break; sleep 1; done
if kill -0 "$PRE" 2>/dev/null; then log "wrap-torch2jax: build still running, stopped"; kill "$PRE"; else wait "$PRE"; log "wrap-torch2jax build exit $?"; fi
tail -2 "$OUT/torch2jax_build.log"
log "kernel question"
"$PY" -m benchmarks run kernel --out "$OUT" > "$OUT/suite.log" 2>&1
log "kernel question exit $?"
grep -E "^Target" "$OUT/kernel.md"
