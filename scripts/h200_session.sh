#!/usr/bin/env bash
# The device runs behind docs/conformance/h200.json, the GPU test records in the
# closing notes and benchmarks/results/h200.json, one step per device call.
#
#   run(command="bash scripts/h200_session.sh STEP", carry=[...])
#
# Steps (in this order, back to back: the device goes back after 30 s idle and
# what was installed under /tmp goes with it; see ../shared/gpu/README.md):
#   stage   carry .gpu/fa4-1 .gpu/setup.sh .gpu/fi-cache.tgz   stage flash-attn-4 part 1
#   fa4     carry .gpu/fa4-2 .gpu/setup.sh                     install flash-attn-4 (it runs
#                                                              only once base is in too: it
#                                                              needs tvm_ffi from there)
#   gpu     carry .gpu/base .gpu/setup.sh                      install flashinfer; every
#                                                              `gpu` test and the conformance
#                                                              of the other backends, in parallel
#   bench   carry .gpu/base .gpu/setup.sh                      python -m benchmarks, all GPU
#                                                              sections
#   retest  carry .gpu/base .gpu/setup.sh .gpu/fi-cache.tgz    after stage + fa4: P3, then GPU
#                                                              kernel/backend tests and the
#                                                              conformance of $BACKENDS
#   warm    carry .gpu/base .gpu/setup.sh .gpu/fi-cache.tgz    does the carried flashinfer
#                                                              JIT cache hold? (seconds if so)
#   repeat  carry .gpu/base .gpu/setup.sh .gpu/fi-cache.tgz    P4 and P6 three times over
#                                                              (host-bound: their spread)
#   port    carry .gpu/base .gpu/setup.sh .gpu/fi-cache.tgz    issue 15: every GPU section once
#                                                              (P1, P3, P4 through GraphRunner:
#                                                              the new results/h200.json), then
#                                                              P4 and P6 three times (repeats)
#   cost    carry .gpu/base .gpu/setup.sh                      calibrate flashinfer_mla, then
#                                                              benchmarks/cost_gate.py per profile
#   multi   kind nvidia-h200-x2, carry .gpu/base .gpu/setup.sh  benchmarks/multi_gpu.py over
#                                                              2 GPUs (NCCL), full per-rank
#                                                              conformance at 64 heads
#
# Add .gpu/fi-cache.tgz (flashinfer's JIT cache, written by the bench step as
# bench/fi-cache.tgz) to a carry when it fits: 64 MiB per call in all.
# pytest-timeout (on the device) bounds each GPU test at 300 s, so one stuck
# test cannot use up a call.
#
# Everything a step writes goes into one archive, $OUT/STEP.tgz (the device
# returns at most 8 files), and its summary is printed last.
set -u
step=${1:?usage: h200_session.sh stage|fa4|gpu|bench|retest|warm|repeat|port|cost|multi}
OUT=${OUT:-/tmp/h200-out}
work=/tmp/h200-$step
mkdir -p "$OUT" "$work"

source .gpu/setup.sh
# An editable install registers the pytest11 and attnreg.backends entry points;
# PYTHONPATH keeps the tree importable if it fails (no package index there).
python3 -m pip install --no-deps --no-build-isolation -e . -q >"$work/pip.log" 2>&1 \
  || echo "editable install failed (see pip.log); using PYTHONPATH=src"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 - <<'EOF'
import importlib
for m in ("torch", "triton", "flashinfer", "flash_attn.cute"):
    try:
        mod = importlib.import_module(m)
        print(f"{m}: {getattr(mod, '__version__', 'importable')}")
    except Exception as exc:  # noqa: BLE001
        print(f"{m}: not importable ({type(exc).__name__}: {str(exc)[:120]})")
EOF

conformance() {  # conformance BACKEND LIMIT_S
  # --progress: a line per claim (i of N, elapsed, time left, JIT notices) in the log,
  # so a run cut by the timeout still says how far it got
  timeout "$2" python3 -m attnreg conformance --backend "$1" --device cuda --progress \
    -o "$work/conf-$1.json" >"$work/conf-$1.log" 2>&1
  echo "rc=$?" >>"$work/conf-$1.log"
}

warm_flashinfer() {  # compile (or find in the carried cache) every flashinfer variant
  # Why ninja would rebuild each carried module (nothing is built: -n).
  for d in ~/.cache/flashinfer/*/*/cached_ops/*/; do
    [ -f "$d/build.ninja" ] || continue
    echo "== $(basename "$d")"
    (cd "$d" && ninja -d explain -n -f build.ninja 2>&1 | head -4)
  done >"$work/cache-explain.log" 2>&1
  timeout 200 python3 -c "
import json, time, torch
from attnreg.backends.flashinfer_mla import warm_jit_cache
t = time.perf_counter(); r = warm_jit_cache(90)
print(json.dumps(r, indent=1)); print(f'warm_jit_cache: {time.perf_counter() - t:.1f} s')
" >"$work/prebuild.log" 2>&1
  echo "rc=$?" >>"$work/prebuild.log"; tail -2 "$work/prebuild.log"
}

finish() {
  tar czf "$OUT/$step.tgz" -C "$work" .
  for f in "$work"/*.log; do
    echo "===== $(basename "$f")"
    grep -E "^\[ *[0-9.]+s\] [0-9]+ of [0-9]+: claim " "$f" | tail -1  # the last claim reached
    grep -E "^(OK|REFUTED|NOTHING)|verified,|rc=|passed|failed|error" "$f" | tail -8
  done
}

case $step in
  stage)
    ;;
  fa4)
    ;;
  gpu)
    start=$(date +%s)
    # Every flashinfer variant first, in parallel on all cores: the test process and the
    # conformance process would otherwise compile the same ones at the same time.
    warm_flashinfer
    timeout $(( 560 - ($(date +%s) - start) )) python3 -m pytest tests -m gpu -v -rs \
      --durations=40 -p no:cacheprovider --timeout 300 \
      >"$work/gpu-tests.log" 2>&1 &
    tests_pid=$!
    for b in reference triton flashinfer_mla trtllm_mla flash_attn_cute; do
      conformance "$b" $(( 560 - ($(date +%s) - start) )) &
    done
    wait $tests_pid; echo "rc=$?" >>"$work/gpu-tests.log"
    wait
    echo "gpu step: $(( $(date +%s) - start )) s"
    ;;
  bench)
    warm_flashinfer
    python3 -m benchmarks --out "$work/bench" --no-render --time-budget-s 420 \
      >"$work/bench.log" 2>&1
    echo "rc=$?" >>"$work/bench.log"
    tail -30 "$work/bench.log"
    ;;
  retest)
    # After a Triton kernel change: P3 alone (timings), then the GPU kernel and backend
    # tests and the conformance of $BACKENDS in parallel.
    warm_flashinfer
    python3 -m benchmarks --only P3 --out "$work/p3" --no-render --no-jit-cache \
      >"$work/p3.log" 2>&1
    echo "rc=$?" >>"$work/p3.log"
    grep -E "^\[.*P3 " "$work/p3.log" | tail -24
    timeout 420 python3 -m pytest tests/kernels tests/backends -m gpu -v -rs \
      -p no:cacheprovider --timeout 300 >"$work/gpu-tests.log" 2>&1 &
    tests_pid=$!
    for b in ${BACKENDS:-triton flashinfer_mla flash_attn_cute}; do conformance "$b" 420 & done
    wait $tests_pid; echo "rc=$?" >>"$work/gpu-tests.log"
    wait
    ;;
  warm)
    # Does the carried JIT cache hold?  cache-explain.log says why ninja would rebuild.
    warm_flashinfer
    grep -c "no work to do" "$work/cache-explain.log"
    ;;
  repeat)
    # P4 (eager side) and P6 are host-bound: how much do they move from run to run?
    warm_flashinfer
    for i in 1 2 3; do
      python3 -m benchmarks --only P4,P6 --out "$work/run$i" --no-render --no-jit-cache \
        >"$work/repeat$i.log" 2>&1
      echo "rc=$?" >>"$work/repeat$i.log"
      grep -E "^\[.*(P4|P6) " "$work/repeat$i.log"
    done
    ;;
  port)
    # Everything measured since the port onto attnreg.runtime.GraphRunner (issue 15): one
    # run of every GPU section, then P4 and P6 three more times (host-bound: the page
    # states their median over the runs).  Results go under the repository's bench-out/,
    # so the commands the JSON records name no machine path; they are archived with the logs.
    warm_flashinfer
    rm -rf bench-out/h200-port
    python3 -m benchmarks --out bench-out/h200-port/bench --no-render --time-budget-s 240 \
      >"$work/bench.log" 2>&1
    echo "rc=$?" >>"$work/bench.log"
    grep -E "^\[.*(P1|P3|P4) " "$work/bench.log" | tail -40
    for i in 1 2 3; do
      python3 -m benchmarks --only P4,P6 --out "bench-out/h200-port/run$i" --no-render \
        --no-jit-cache >"$work/repeat$i.log" 2>&1
      echo "rc=$?" >>"$work/repeat$i.log"
      grep -E "^\[.*P4 .* B=1:" "$work/repeat$i.log"
    done
    cp -r bench-out/h200-port/. "$work"/
    ;;
  cost)
    timeout 150 python3 -m attnreg calibrate --backend flashinfer_mla \
      --out "$work/h200-flashinfer_mla.json" --time-budget-s 100 >"$work/calibrate.log" 2>&1
    echo "rc=$?" >>"$work/calibrate.log"
    for p in src/attnreg/data/profiles/h200-triton.json "$work/h200-flashinfer_mla.json"; do
      [ -f "$p" ] || continue
      name=$(basename "$p" .json)
      timeout 200 python3 benchmarks/cost_gate.py --profile "$p" --out "$work/cg-$name.json" \
        --time-budget-s 150 >"$work/cg-$name.log" 2>&1
      echo "rc=$?" >>"$work/cg-$name.log"
      tail -4 "$work/cg-$name.log"
    done
    ;;
  multi)
    timeout 560 python3 benchmarks/multi_gpu.py --nprocs 2 --backend nccl --trials 1000 \
      --out "$work/multi" --timeout 150 --conformance-timeout 380 >"$work/multi.log" 2>&1
    echo "rc=$?" >>"$work/multi.log"
    tail -30 "$work/multi.log"
    ;;
  *)
    echo "unknown step $step" >&2; exit 2 ;;
esac
finish
