#!/usr/bin/env bash
# The device runs behind this turn's committed H200 results (graph session, KV-integrity
# conformance), one step per device call:
#   run(command="bash scripts/h200_turn3.sh conf", carry=[".gpu/base", ".gpu/setup.sh", ".gpu/fi-cache.tgz"])
#   run(command="bash scripts/h200_turn3.sh bench", carry=[...same])
# conf: every `gpu` test and the conformance of every sm90 backend (the FlashMLA plugin
#       through --plugin) in parallel, reports under $OUT.
# bench: the graph-session benchmark (8-layer step) three times, and the capture planted
#        defects of the integrity set on cuda.
set -u
step=${1:?usage: h200_turn3.sh conf|conf2|bench}
OUT=${OUT:-/tmp/h200-out}
mkdir -p "$OUT"
source .gpu/setup.sh
python3 -m pip install --no-deps --no-build-isolation -e . -q >"$OUT/pip.log" 2>&1 \
  || echo "editable install failed (see pip.log); using PYTHONPATH=src"
export PYTHONPATH="$PWD/src:$PWD/plugins/attnreg-flashmla/src:$PWD/tests/conformance${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
start=$(date +%s)
left() { echo $(( $1 - ($(date +%s) - start) )); }
case $step in
  conf)
    timeout $(left 540) python3 -m pytest tests plugins/attnreg-flashmla/tests -m gpu -q -rs \
      -p no:cacheprovider --timeout 300 -p no:xdist >"$OUT/gpu-tests.log" 2>&1 &
    tests=$!
    for b in reference triton flashinfer_mla trtllm_mla; do
      timeout $(left 540) python3 -m attnreg conformance --backend $b --device cuda --progress \
        -o "$OUT/conf-$b.json" >"$OUT/conf-$b.log" 2>&1 &
    done
    timeout $(left 540) python3 -m attnreg conformance --plugin attnreg_flashmla.plugin \
      --backend flashmla --device cuda --progress -o "$OUT/conf-flashmla.json" \
      >"$OUT/conf-flashmla.log" 2>&1 &
    wait $tests; echo "rc=$?" >>"$OUT/gpu-tests.log"
    wait
    ;;
  conf2)
    # the two backends the first conf call could not finish beside the GPU tests
    for b in ${BACKENDS:-triton flashinfer_mla}; do
      timeout $(left 560) python3 -m attnreg conformance --backend $b --device cuda --progress \
        -o "$OUT/conf-$b.json" >"$OUT/conf-$b.log" 2>&1 &
    done
    wait
    ;;
  bench)
    for i in 1 2 3; do
      timeout $(left 400) python3 -m benchmarks --only session --out "$OUT/session$i" \
        --no-render --no-jit-cache >"$OUT/session$i.log" 2>&1
      echo "rc=$?" >>"$OUT/session$i.log"
    done
    timeout $(left 560) python3 -m attnreg conformance --plugin planted.integrity \
      --backend planted_prefix_overwrite --backend planted_nan_wide \
      --backend planted_inplace_q --device cuda -k "decode and (replay/ or capture_path)" \
      -o "$OUT/planted-cuda.json" >"$OUT/planted-cuda.log" 2>&1
    echo "rc=$?" >>"$OUT/planted-cuda.log"
    ;;
esac
for f in "$OUT"/*.log; do
  echo "===== $(basename "$f")"; grep -E "verified|refuted|passed|failed|rc=|error" "$f" | tail -5
done
echo "step $step: $(( $(date +%s) - start )) s"
