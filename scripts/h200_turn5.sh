#!/usr/bin/env bash
# The device runs behind this turn's H200 results, one step per device call:
#   run(command="bash scripts/h200_turn5.sh conf", carry=[".gpu/base", ".gpu/setup.sh", ".gpu/fi-cache.tgz"])
# conf:   triton's and flashinfer_mla's conformance through the session at the declared
#         capture buckets (wide decode 256), each in two shards run at once (capture claims;
#         the rest) and joined with `attnreg conformance --merge`.
# bench:  the graph-session benchmark three times (three processes), then the runtime's GPU
#         tests.
# sparse: the FlashMLA plugin's sparse probe, its conformance (dense and sparse claims), the
#         planted sparse defects under real graphs, the plugin's GPU tests; with FA4=1 also
#         flash_attn_cute's conformance (stage .gpu/fa4-1 and .gpu/fa4-2 in two calls first).
# Every step tars its results to $OUT/results-<step>.tgz and removes the rest (a device call
# brings back only a few files, the first in name order).
set -u
step=${1:?usage: h200_turn5.sh conf|bench|sparse}
OUT=${OUT:-/tmp/h200-out}
mkdir -p "$OUT"
source .gpu/setup.sh
python3 -m pip install --no-deps --no-build-isolation -e . -q >"$OUT/pip.log" 2>&1 \
  || echo "editable install failed (see pip.log); using PYTHONPATH=src"
python3 -m pip install --no-deps --no-build-isolation -e plugins/attnreg-flashmla -q \
  >>"$OUT/pip.log" 2>&1 || true
export PYTHONPATH="$PWD/src:$PWD/plugins/attnreg-flashmla/src:$PWD/tests/conformance${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
git_rev=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
echo "commit $git_rev" >"$OUT/commit.txt"
start=$(date +%s)
left() { echo $(( $1 - ($(date +%s) - start) )); }
conf() {  # conf <name> <limit> [attnreg conformance args...]: one run, its log and rc
  local name=$1 limit=$2; shift 2
  timeout $(left $limit) python3 -m attnreg conformance --device cuda --progress "$@" \
    -o "$OUT/conf-$name.json" >"$OUT/conf-$name.log" 2>&1
  echo "rc=$?" >>"$OUT/conf-$name.log"
}
case $step in
  conf)
    for b in ${BACKENDS:-triton flashinfer_mla}; do
      [ -z "${ONLY_REST:-}" ] && conf "$b-capture" 540 --backend $b -k capture &
      conf "$b-rest" 540 --backend $b -k "not capture" &
    done
    wait
    for b in triton flashinfer_mla; do
      python3 -m attnreg conformance --merge "$OUT/conf-$b-capture.json" \
        --merge "$OUT/conf-$b-rest.json" -o "$OUT/conf-$b.json" >"$OUT/merge-$b.log" 2>&1
      echo "rc=$?" >>"$OUT/merge-$b.log"
    done
    ;;
  bench)
    for i in 1 2 3; do
      timeout $(left 420) python3 -m benchmarks --only session --out "$OUT/session$i" \
        --no-render --no-jit-cache >"$OUT/session$i.log" 2>&1
      echo "rc=$?" >>"$OUT/session$i.log"
    done
    timeout $(left 560) python3 -m pytest tests/runtime/test_session_gpu.py \
      tests/runtime/test_bucket_sessions_gpu.py tests/runtime/test_engine_gpu.py -m gpu -q -rs \
      -p no:cacheprovider -p no:xdist >"$OUT/gpu-tests.log" 2>&1
    echo "rc=$?" >>"$OUT/gpu-tests.log"
    ;;
  sparse)
    for b in ${REST_TOO:-}; do  # another backend's non-capture claims beside these
      conf "$b-rest" ${LIMIT:-540} --backend $b -k "not capture" &
    done
    (timeout $(left ${LIMIT:-300}) python3 scripts/probe_flashmla_sparse.py >"$OUT/probe.log" 2>&1; \
      echo "rc=$?" >>"$OUT/probe.log") &
    conf flashmla ${LIMIT:-520} --plugin attnreg_flashmla.plugin --backend flashmla &
    (cd tests/conformance && conf sparse-planted ${LIMIT:-520} --plugin planted.sparse -k sparse \
      --backend dsa_control --backend planted_dsa_ignores_indices \
      --backend planted_dsa_reads_invalid --backend planted_dsa_wrong_scale_block) &
    timeout $(left ${LIMIT:-520}) python3 -m pytest plugins/attnreg-flashmla/tests -m gpu -q -rs \
      -p no:cacheprovider -p no:xdist >"$OUT/plugin-gpu-tests.log" 2>&1 &
    if [ -n "${FA4:-}" ]; then  # flash-attn-4 staged by two calls before (see .gpu/setup.sh)
      conf flash_attn_cute ${LIMIT:-520} --backend flash_attn_cute &
    fi
    wait
    ;;
esac
# the flashinfer JIT cache, to carry as .gpu/fi-cache.tgz next time (no nvcc rebuild)
[ -d ~/.cache/flashinfer ] && [ ! -f .gpu/fi-cache.tgz ] && tar czf "$OUT/fi-cache.tgz" -C ~/.cache flashinfer
tar czf "/tmp/results-$step.tgz" -C "$OUT" --exclude='*.tgz' . 2>/dev/null
find "$OUT" -mindepth 1 ! -name fi-cache.tgz -delete
mv "/tmp/results-$step.tgz" "$OUT/"
ls -la "$OUT"
