#!/usr/bin/env bash
# Issue 15 on one GPU in one command (about 9-11 minutes on an H200): the GPU checks of both call paths, then the
# autograd-force op, the MD step, the MD driver (nve) and MACE against native, with the bridge's extra work by
# kernel and op name; MACE with cuequivariance kernels too where they are installed.
#
#   PYTHONPATH=.:/tmp/site scripts/gpu_issue15.sh OUTDIR
#
# MACE needs the wheels of benchmarks/RESULTS.md in /tmp/site (cuequivariance: its four packages as well). Environment: PYTHON (default python3),
# PLATFORM (default gpu; cpu runs the same steps as a dry run), LJ_SIZES, MD_CELLS, NVE_SIZES, MACE_SIZES, MACE_ROUNDS.
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
step grad_through_op 240 "$PY" benchmarks/grad_through_op.py --platform "$PLATFORM" --sizes "${LJ_SIZES:-1000,10000,100000}" \
  --iters 100 --paths ffi,callback --out "$OUT"
grep -E "^\| " "$OUT/grad_through_op.md" | head -14
step md_interleaved 240 "$PY" benchmarks/md_interleaved.py --platform "$PLATFORM" --kernels torch-cells \
  --cells "${MD_CELLS:-14,22,35}" --rounds 15 --steps 10 --out "$OUT"
grep -E "^\| " "$OUT/md_interleaved.md" | head -6
step nve_steps 240 "$PY" benchmarks/nve_steps.py --platform "$PLATFORM" --sizes "${NVE_SIZES:-7,14}" --out "$OUT"
grep -E "^\| " "$OUT/nve_steps.md" | head -4
step mace_interleaved 420 "$PY" benchmarks/mace_interleaved.py --platform "$PLATFORM" --sizes "${MACE_SIZES:-7,14}" \
  --rounds "${MACE_ROUNDS:-30}" --profile --out "$OUT"
grep -E "^\| " "$OUT/mace_interleaved.md" | head -80
if "$PY" -c "import cuequivariance_torch" > /dev/null 2>&1; then
  step mace_cueq 420 "$PY" benchmarks/mace_interleaved.py --platform "$PLATFORM" --cueq --sizes "${MACE_SIZES:-7,14}" \
    --rounds "${MACE_ROUNDS:-30}" --out "$OUT/cueq"
  grep -E "^\| " "$OUT/cueq/mace_interleaved.md" | head -6
else
  log "mace_cueq: skipped (cuequivariance_torch is not importable; carry its wheels as benchmarks/RESULTS.md says)"
fi
