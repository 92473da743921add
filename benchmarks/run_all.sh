#!/usr/bin/env bash
# Run the four benchmarks in sequence, each under a timeout, and collect their markdown in OUTDIR
# (--smoke, the CPU dry run: all four in one Python process under one timeout, see below).
#
#   benchmarks/run_all.sh OUTDIR [--smoke]
#
# GPU run (2 GPUs): about 8 minutes at most; the wrap-torch2jax extension is compiled in the
# background (nice, MAX_JOBS=8) while the first three benchmarks run. Environment:
# PYTHON (default python3). Writes OUTDIR/<benchmark>.md, OUTDIR/<benchmark>.log and
# OUTDIR/ALL.md (all tables, ready to paste into benchmarks/RESULTS.md).
# SCALING=1 adds benchmarks/scaling.py (strong + weak MD scaling over all devices, and halo exchanges
# on slab / 2-D / 3-D grids) after the four; SCALING_ARGS passes it extra arguments. On GPUs at the
# default 10^6 atoms it can take ~10 minutes: run it alone there (see benchmarks/RESULTS.md).
set -u
OUT=${1:?usage: benchmarks/run_all.sh OUTDIR [--smoke]}
shift
SMOKE=""
if [ "${1:-}" = "--smoke" ]; then SMOKE="--smoke"; fi
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-python3}
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
cd "$ROOT"
log() { echo "[$(date +%H:%M:%S)] run_all: $*"; }
STATUS=()

run() {  # run NAME TIMEOUT_S ARGS...
  local name=$1 limit=$2
  shift 2
  log "$name: start (timeout ${limit} s)"
  local t0=$SECONDS
  timeout -k 10 "$limit" "$PY" "benchmarks/$name.py" --out "$OUT" $SMOKE "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  tail -n 60 "$OUT/$name.log"
  [ $rc -eq 124 ] && log "$name: TIMED OUT after ${limit} s (partial table kept)"
  log "$name: exit $rc after $((SECONDS - t0)) s"
  STATUS+=("$name=$rc")
}

PRE_PID=""
if [ -z "$SMOKE" ]; then
  log "wrap-torch2jax: building its extension in the background"
  JAX_PLATFORMS=cpu MAX_JOBS=8 nice -n 19 timeout 420 "$PY" benchmarks/kernel_overhead.py --prebuild-torch2jax --platform cpu \
    > "$OUT/torch2jax_build.log" 2>&1 &
  PRE_PID=$!
fi

if [ -n "$SMOKE" ]; then
  # The four run in turn in ONE Python process, each as its script's __main__ with these arguments
  # (front_door still starts its two ranks): processes of their own would each import jax, torch and
  # triton again, 5-10 CPU-s apiece, as much as a smoke run's own work. JAX starts with halo_exchange's
  # 8 CPU devices (kernel_overhead, alone, asks for 1; it uses the first). Each writes OUT/NAME.log; one
  # that fails does not stop the others. XLA skips its LLVM optimisation (level 0): a smoke run times
  # nothing, and compiling its ~80 programs is a large part of its CPU time.
  SMOKE_RUNS=("halo_exchange" "front_door --timeout-s 100" "md_step --budget-s 200" "kernel_overhead --torch2jax cached")
  export XLA_FLAGS="${XLA_FLAGS:+$XLA_FLAGS }--xla_backend_optimization_level=0"
  log "smoke: ${SMOKE_RUNS[*]%% *} in one process (timeout 360 s)"
  t0=$SECONDS
  timeout -k 10 360 "$PY" - "$OUT" "${SMOKE_RUNS[@]}" > "$OUT/smoke.log" 2>&1 <<'EOF'
import contextlib, os, resource, runpy, sys, time, traceback

sys.path.insert(0, os.path.abspath("benchmarks"))  # the scripts import _common from their folder
out = sys.argv[1]


def cpu_s():  # user + system seconds of this process and of its children that ended (front_door's ranks)
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


for name, *args in (run.split() for run in sys.argv[2:]):
    t0, c0, rc = time.perf_counter(), cpu_s(), 0
    sys.argv = [f"benchmarks/{name}.py", "--out", out, "--smoke", *args]
    with open(f"{out}/{name}.log", "w") as f, contextlib.redirect_stdout(f), contextlib.redirect_stderr(f):
        try:
            runpy.run_path(sys.argv[0], run_name="__main__")
        except SystemExit as e:  # sys.exit(main()), or a message such as md_step's for an unknown kernel
            rc = e.code if isinstance(e.code, int) else int(e.code is not None)
            if rc and not isinstance(e.code, int):
                print(e.code, file=sys.stderr)
        except Exception:
            traceback.print_exc()
            rc = 1
    print(f"status {name}={rc} after {time.perf_counter() - t0:.0f} s, {cpu_s() - c0:.1f} CPU-s", flush=True)
EOF
  rc=$?
  [ $rc -eq 124 ] && log "smoke: TIMED OUT after 360 s (partial tables kept)"
  for run in "${SMOKE_RUNS[@]}"; do
    name=${run%% *}
    tail -n 60 "$OUT/$name.log" 2>/dev/null
    s=$(sed -n "s/^status $name=\([0-9]*\) .*/\1/p" "$OUT/smoke.log")
    STATUS+=("$name=${s:-$rc}")
  done
  cat "$OUT/smoke.log"  # the status lines (the first run's CPU-s include the imports all four share)
  log "smoke: exit $rc after $((SECONDS - t0)) s"
else
  run halo_exchange 75
  run front_door 75 --timeout-s 65
  run md_step 240 --budget-s 150
  if [ -n "$PRE_PID" ]; then
    for _ in $(seq 60); do kill -0 "$PRE_PID" 2>/dev/null || break; sleep 1; done
    if kill -0 "$PRE_PID" 2>/dev/null; then
      log "wrap-torch2jax: build still running; kernel_overhead records it as not built"
      kill "$PRE_PID" 2>/dev/null
    else
      wait "$PRE_PID"; log "wrap-torch2jax: build exit $? (log: $OUT/torch2jax_build.log)"
    fi
  fi
  run kernel_overhead 110 --torch2jax cached
fi

if [ "${SCALING:-0}" = "1" ]; then
  if [ -n "$SMOKE" ]; then
    run scaling 300 --halo ${SCALING_ARGS:-}
  else
    run scaling "${SCALING_TIMEOUT:-900}" --halo ${SCALING_ARGS:-}
  fi
fi

{
  echo "# Benchmark run $(date -u '+%Y-%m-%d %H:%M UTC') ${SMOKE:+(smoke)}"
  echo
  echo "Exit status: ${STATUS[*]}"
  for n in halo_exchange kernel_overhead front_door md_step scaling; do
    [ -f "$OUT/$n.md" ] && { echo; cat "$OUT/$n.md"; }
  done
} > "$OUT/ALL.md"
log "done: ${STATUS[*]}; tables in $OUT/ALL.md"
for s in "${STATUS[@]}"; do [ "${s#*=}" = "0" ] || exit 1; done
exit 0
