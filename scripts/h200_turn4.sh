#!/usr/bin/env bash
# The device runs behind this turn's H200 results, one step per device call:
#   run(command="bash scripts/h200_turn4.sh bench", carry=[".gpu/base", ".gpu/setup.sh", ".gpu/fi-cache.tgz"])
# bench: the graph-session benchmark (device-side replay metadata) three times, and where the
#        host time of one replay's metadata goes per backend (scripts/profile_replay_metadata.py).
# conf:  conformance of the sm90 backends (BACKENDS, default triton flashinfer_mla reference;
#        the FlashMLA plugin with PLUGIN=1) and the GPU tests of the runtime (TESTS), reports
#        under $OUT.
# final: every sm90 backend's conformance, the plugin's, trtllm_mla's listing and the planted
#        sparse defects, at once.
# peers: the raw-kernel peers benchmark (issue 31).
set -u
step=${1:?usage: h200_turn4.sh bench|conf|final|peers}
OUT=${OUT:-/tmp/h200-out}
mkdir -p "$OUT"
source .gpu/setup.sh
python3 -m pip install --no-deps --no-build-isolation -e . -q >"$OUT/pip.log" 2>&1 \
  || echo "editable install failed (see pip.log); using PYTHONPATH=src"
python3 -m pip install --no-deps --no-build-isolation -e plugins/attnreg-flashmla -q \
  >>"$OUT/pip.log" 2>&1 || true
export PYTHONPATH="$PWD/src:$PWD/plugins/attnreg-flashmla/src:$PWD/tests/conformance${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
start=$(date +%s)
left() { echo $(( $1 - ($(date +%s) - start) )); }
case $step in
  bench)
    for i in 1 2 3; do
      timeout $(left 420) python3 -m benchmarks --only session --out "$OUT/session$i" \
        --no-render --no-jit-cache >"$OUT/session$i.log" 2>&1
      echo "rc=$?" >>"$OUT/session$i.log"
    done
    for b in triton flashinfer_mla; do
      timeout $(left 560) python3 scripts/profile_replay_metadata.py --backend $b \
        --out "$OUT/profile-$b.txt" >"$OUT/profile-$b.log" 2>&1
      echo "rc=$?" >>"$OUT/profile-$b.log"
    done
    ;;
  conf)
    if [ -n "${TESTS:-}" ]; then
      timeout $(left 560) python3 -m pytest $TESTS -m gpu -q -rs -p no:cacheprovider \
        --timeout 300 -p no:xdist >"$OUT/gpu-tests.log" 2>&1 &
    fi
    for b in ${BACKENDS:-triton flashinfer_mla reference}; do
      timeout $(left 560) python3 -m attnreg conformance --backend $b --device cuda --progress \
        -o "$OUT/conf-$b.json" >"$OUT/conf-$b.log" 2>&1 &
    done
    if [ -n "${PLUGIN:-}" ]; then
      timeout $(left 560) python3 -m attnreg conformance --plugin attnreg_flashmla.plugin \
        --backend flashmla --device cuda --progress -o "$OUT/conf-flashmla.json" \
        >"$OUT/conf-flashmla.log" 2>&1 &
    fi
    wait
    ;;
  final)
    # every sm90 backend's conformance (dense and sparse claims), the FlashMLA plugin, the
    # Blackwell-only trtllm_mla listing, and the planted sparse defects under real graphs
    for b in triton flashinfer_mla reference trtllm_mla; do
      timeout $(left 500) python3 -m attnreg conformance --backend $b --device cuda --progress \
        -o "$OUT/conf-$b.json" >"$OUT/conf-$b.log" 2>&1 &
    done
    timeout $(left 500) python3 -m attnreg conformance --plugin attnreg_flashmla.plugin \
      --backend flashmla --device cuda --progress -o "$OUT/conf-flashmla.json" \
      >"$OUT/conf-flashmla.log" 2>&1 &
    (cd tests/conformance && timeout $(left 500) python3 -m attnreg conformance \
      --plugin planted.sparse --device cuda -k sparse --backend dsa_control \
      --backend planted_dsa_ignores_indices --backend planted_dsa_reads_invalid \
      -o "$OUT/sparse-planted-cuda.json" >"$OUT/sparse-planted-cuda.log" 2>&1; \
      echo "rc=$?" >>"$OUT/sparse-planted-cuda.log") &
    wait
    ;;
  peers)
    timeout $(left 560) python3 -m benchmarks --only ${PEERS_SECTION:-peers} --out "$OUT/peers" \
      --no-render --no-jit-cache >"$OUT/peers.log" 2>&1
    echo "rc=$?" >>"$OUT/peers.log"
    ;;
esac
# the flashinfer JIT cache, to carry as .gpu/fi-cache.tgz next time (no nvcc rebuild)
[ -d ~/.cache/flashinfer ] && [ ! -f .gpu/fi-cache.tgz ] && tar czf "$OUT/fi-cache.tgz" -C ~/.cache flashinfer
# one archive of every result (a device call brings back only a few files)
tar czf "$OUT/results-$step.tgz" -C "$OUT" --exclude='*.tgz' . 2>/dev/null
for f in "$OUT"/*.log; do
  echo "===== $(basename "$f")"; grep -E "verified|refuted|passed|failed|rc=|error|session .* (host|decode|verify)|median" "$f" | tail -8
done
echo "step $step: $(( $(date +%s) - start )) s"
