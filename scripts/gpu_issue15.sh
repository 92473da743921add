#!/usr/bin/env bash
# Issue 15 on one GPU in one command (about 6-8 minutes on an H200): the GPU checks of both call paths, then the
# benchmark suite's kernel, md and mlip questions (python -m benchmarks run; see benchmarks/RESULTS.md).
#
#   PYTHONPATH=.:/tmp/site scripts/gpu_issue15.sh OUTDIR
#
# MACE needs the wheels of benchmarks/RESULTS.md in /tmp/site (cuequivariance: its four packages as well). Environment: PYTHON (default python3),
# PLATFORM (default gpu; cpu runs the same steps as a dry run), LJ_SIZES, MD_SIZES, MACE_SIZES (atoms, comma lists).
# Logs and tables go to OUTDIR; a step that fails or times out is reported and the next one runs.
set -u
OUT=${1:?usage: scripts/gpu_issue15.sh OUTDIR}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
PLATFORM=${PLATFORM:-gpu}
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
log() { echo "[$(date +%H:%M:%S)] $*"; }
step() {  # step NAME TIMEOUT_S COMMAND...: run, keep the log, report the exit code
  local name=$1 limit=$2
  shift 2
  log "$name"
  timeout -k 10 "$limit" "$@" > "$OUT/$name.log" 2>&1
  log "$name: exit $?"
}
if [ "$PLATFORM" = gpu ]; then
  step gpu_kernels_check 240 "$PY" scripts/gpu_kernels_check.py
  grep -E "^(PASS|FAIL)" "$OUT/gpu_kernels_check.log" | tail -3
  step pytest_gpu 240 env JAX_PLATFORMS=cuda,cpu TRITON_INTERPRET=0 "$PY" -m pytest tests/kernels/test_ffi_path.py \
    tests/kernels/test_call_path.py -k gpu -q -p no:cacheprovider
  tail -2 "$OUT/pytest_gpu.log"
fi
# the benchmarks of issue 15: the autograd-force op (kernel), the MD step and driver (md), MACE (mlip; with
# cuequivariance kernels too where cuequivariance_torch imports), one process per question, tables in OUTDIR
step suite 1200 "$PY" -m benchmarks run kernel md mlip --device "$PLATFORM" --out "$OUT" \
  --sizes "kernel=${LJ_SIZES:-1000,10000,100000}" --sizes "md=${MD_SIZES:-10976,42592,171500}" \
  --sizes "mlip=${MACE_SIZES:-108,1372,10976}"
grep -E "^\| " "$OUT/ALL.md" | head -20
