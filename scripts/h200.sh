#!/usr/bin/env bash
# What the committed H200 results were run with, one step per device call:
#   run(command="bash scripts/h200.sh <step>", carry=[".gpu/base", ".gpu/setup.sh", ".gpu/fi-cache.tgz"])
# (../shared/gpu/README.md: the .gpu bundles; flash-attn-4 needs .gpu/fa4-1 and .gpu/fa4-2
# staged by two calls first, then FA4=1.)
#
# conf     conformance of the sm90 backends (BACKENDS, default triton flashinfer_mla), each in
#          two shards run at once (capture claims; the rest; ONLY_REST=1: the rest only),
#          joined per backend with `attnreg conformance --merge`.
# gpu      every `gpu` test of the project and the plugin.
# bench    the graph-session benchmark three times (three processes), then the runtime's
#          GPU tests.
# peers    the raw-kernel peers benchmark (PEERS_SECTION, default peers).
# sparse   the FlashMLA plugin: its sparse probe, its conformance (dense and sparse
#          claims), its GPU tests; the planted sparse defects under real graphs; REST_TOO:
#          other backends' non-capture claims beside; FA4=1: flash_attn_cute's conformance.
# integrity the capture planted defects of the integrity set on cuda.
# fp8q     the FlashMLA plugin's conformance (its fp8-q entry beside the others) and the
#          planted fp8-query defects (a kept q_scale, one scale per step) with their control
#          under real graphs, at once; then the plugin's GPU tests.
# kout     the FlashMLA plugin's conformance (it returns its library's own output), the
#          planted kernel-output defect and its control under real graphs, every backend's
#          multi-layer claims, at once; then the plugin's and the runtime's GPU tests.
# wide     scripts/probe_triton_wide_heads.py (Triton decode at 64-128 heads: warp
#          specialization, one program for 128 heads).
# stages   the pipeline-stage probes (the KV tile's second shared buffer): the triton
#          extend over bf16 / fp8 caches, the decode variants, the sparse decode.
# stages1  scripts/probe_triton_fp8_mma.py --page1-stages (the 16-head fp8 kernel at page 1
#          with 2, 3 and 4 pipeline stages, splits for two programs per SM and for one).
# tp32     scripts/probe_triton_fp8_mma.py --tp-shapes at 32 heads only.
# gap      scripts/probe_triton_backend_gap.py (the triton backend's captured decode beside
#          its kernel called directly, on the probes' and on the peers run's inputs).
# bisect   scripts/probe_triton_backend_gap.py --bisect (the session's own mla_decode
#          arguments called directly, one replaced by a fresh copy at a time; kernel lists).
# planted  the `gpu` tests of tests/conformance/test_planted.py (defects under real capture).
# sparsebench the sparse-vs-dense decode benchmark (the `sparse` section).
# padding  scripts/probe_padding_launch.py (the padding fill after the kernel, as a
#          programmatic dependent launch, beside it; the rows kernels write for empty
#          sequences; --verify-rows: flashinfer's rows for causal verify requests of no
#          key) and the padding fill's GPU tests.
# claims   conformance of CLAIMS_BACKENDS (default triton reference flashmla) restricted to K (a
#          -k expression, default fp8_large_q), the FlashMLA plugin loaded; in the
#          background, beside the next step (put a timing step after one that waits).
# Several steps run one after another in one call: `bash scripts/h200.sh peers sparsebench`.
# LIMIT bounds every job of a step (seconds); each step leaves one archive,
# $OUT/results-<step>.tgz (a device call brings back only a few files, the first by name).
set -u
call_start=$(date +%s)
[ $# -ge 1 ] || { echo "usage: h200.sh STEP... (conf|gpu|bench|peers|sparse|integrity|fp8q|kout|wide|stages|stages1|tp32|gap|bisect|planted|sparsebench|padding|claims)" >&2; exit 2; }
steps="$*"
OUT=${OUT:-/tmp/h200-out}
mkdir -p "$OUT"
source .gpu/setup.sh
python3 -m pip install --no-deps --no-build-isolation -e . -q >"$OUT/pip.log" 2>&1 \
  || echo "editable install failed (see pip.log); using PYTHONPATH=src"
python3 -m pip install --no-deps --no-build-isolation -e plugins/attnreg-flashmla -q \
  >>"$OUT/pip.log" 2>&1 || true
export PYTHONPATH="$PWD/src:$PWD/plugins/attnreg-flashmla/src:$PWD/tests/conformance${PYTHONPATH:+:$PYTHONPATH}"
# which plugins the run can see (a run without flashmla says so here, not by missing rows)
ep_names() { python3 -c "import importlib.metadata as m; print(' '.join(sorted(e.name for e in m.entry_points(group='attnreg.backends'))))"; }
echo "attnreg.backends entry points: $(ep_names)" | tee "$OUT/entry-points.log"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
start=$call_start
# seconds a job may run: its own limit from the start of its step, never past the call's
# BUDGET (default 560 s, under the device's 600 s per call, so the archive still gets made)
left() {
  local now own call; now=$(date +%s)
  own=$(( $1 - (now - start) )); call=$(( ${BUDGET:-560} - (now - call_start) ))
  echo $(( own < call ? own : call ))
}
limit() { echo "${LIMIT:-$1}"; }
conf() {  # conf <name> <limit> [attnreg conformance args...]: one run, its log and rc
  local name=$1 lim=$2; shift 2
  timeout $(left $lim) python3 -m attnreg conformance --device cuda --progress "$@" \
    -o "$OUT/conf-$name.json" >"$OUT/conf-$name.log" 2>&1
  echo "rc=$?" >>"$OUT/conf-$name.log"
}
gpu_tests() {  # gpu_tests <log name> <limit> <paths...>
  local name=$1 lim=$2; shift 2
  timeout $(left $lim) python3 -m pytest "$@" -m gpu -q -rs -p no:cacheprovider -p no:xdist \
    >"$OUT/$name.log" 2>&1
  echo "rc=$?" >>"$OUT/$name.log"
}
for step in $steps; do
start=$(date +%s)
case $step in
  conf)
    for b in ${BACKENDS:-triton flashinfer_mla}; do
      [ -z "${ONLY_REST:-}" ] && conf "$b-capture" $(limit 540) --backend $b -k capture &
      conf "$b-rest" $(limit 540) --backend $b -k "not capture" &
    done
    wait
    for b in ${BACKENDS:-triton flashinfer_mla}; do
      [ -n "${ONLY_REST:-}" ] && continue
      python3 -m attnreg conformance --merge "$OUT/conf-$b-capture.json" \
        --merge "$OUT/conf-$b-rest.json" -o "$OUT/conf-$b.json" >"$OUT/merge-$b.log" 2>&1
      echo "rc=$?" >>"$OUT/merge-$b.log"
    done
    ;;
  gpu)
    gpu_tests gpu-tests $(limit 560) tests plugins/attnreg-flashmla/tests
    ;;
  bench)
    for i in 1 2 3; do
      timeout $(left 420) python3 -m benchmarks --only session --out "$OUT/session$i" \
        --no-render --no-jit-cache >"$OUT/session$i.log" 2>&1
      echo "rc=$?" >>"$OUT/session$i.log"
    done
    gpu_tests gpu-tests $(limit 560) tests/runtime/test_session_gpu.py \
      tests/runtime/test_bucket_sessions_gpu.py tests/runtime/test_engine_gpu.py
    ;;
  peers)
    timeout $(left $(limit 560)) python3 -m benchmarks --only ${PEERS_SECTION:-peers} \
      --out "$OUT/peers" --no-render --no-jit-cache >"$OUT/peers.log" 2>&1
    echo "rc=$?" >>"$OUT/peers.log"
    ;;
  sparse)
    for b in ${REST_TOO:-}; do
      conf "$b-rest" $(limit 540) --backend $b -k "not capture" &
    done
    (timeout $(left $(limit 300)) python3 scripts/probe_flashmla_sparse.py >"$OUT/probe.log" 2>&1; \
      echo "rc=$?" >>"$OUT/probe.log") &
    conf flashmla $(limit 520) --plugin attnreg_flashmla.plugin --backend flashmla &
    (cd tests/conformance && conf sparse-planted $(limit 520) --plugin planted.sparse -k sparse \
      --backend dsa_control --backend planted_dsa_ignores_indices \
      --backend planted_dsa_reads_invalid --backend planted_dsa_wrong_scale_block) &
    gpu_tests plugin-gpu-tests $(limit 520) plugins/attnreg-flashmla/tests &
    if [ -n "${FA4:-}" ]; then
      conf flash_attn_cute $(limit 520) --backend flash_attn_cute &
    fi
    wait
    ;;
  integrity)
    (cd tests/conformance && conf planted-integrity $(limit 560) --plugin planted.integrity \
      --backend planted_prefix_overwrite --backend planted_nan_wide \
      --backend planted_inplace_q -k "decode and (replay/ or capture_path)")
    ;;
  fp8q)
    conf flashmla $(limit 400) --plugin attnreg_flashmla.plugin --backend flashmla &
    (cd tests/conformance && conf planted-fp8q $(limit 400) --plugin planted.fp8_q_scale \
      --backend planted_fp8_q_scale_kept --backend planted_fp8_q_scale_per_step \
      --backend planted_fp8_q_scale_correct \
      -k "fp8_e4m3-fp8_e4m3 and capture and h16 and not capture_memory") &
    wait
    gpu_tests plugin-gpu-tests $(limit 540) plugins/attnreg-flashmla/tests
    ;;
  kout)
    conf flashmla $(limit 400) --plugin attnreg_flashmla.plugin --backend flashmla &
    (cd tests/conformance && conf planted-kout $(limit 400) --plugin planted.kernel_output \
      --backend planted_kernel_output_shared --backend planted_kernel_output_correct \
      -k "decode and h16 and p16 and (multi_layer or no_sync_alloc or padded_rows or capture_path or replay/)") &
    conf multi-layer $(limit 400) --backend triton --backend flashinfer_mla -k multi_layer &
    wait
    gpu_tests plugin-gpu-tests $(limit 540) plugins/attnreg-flashmla/tests tests/runtime \
      tests/kernels tests/backends
    ;;
  wide)
    timeout $(left $(limit 540)) python3 scripts/probe_triton_wide_heads.py \
      --out "$OUT/wide-heads.json" >"$OUT/wide.log" 2>&1
    echo "rc=$?" >>"$OUT/wide.log"
    ;;
  stages)
    for probe in triton_extend_stages triton_fp8_mma triton_sparse_stages; do
      timeout $(left $(limit 540)) python3 "scripts/probe_$probe.py" --out "$OUT/$probe.json" \
        >"$OUT/$probe.log" 2>&1
      echo "rc=$?" >>"$OUT/$probe.log"
    done
    ;;
  stages1|tp32)
    [ $step = stages1 ] && flags="--page1-stages" || flags="--tp-shapes --min-heads 32 --max-heads 32"
    timeout $(left $(limit 400)) python3 scripts/probe_triton_fp8_mma.py $flags \
      --out "$OUT/fp8_mma_$step.json" >"$OUT/fp8_mma_$step.log" 2>&1
    echo "rc=$?" >>"$OUT/fp8_mma_$step.log"
    ;;
  gap)
    timeout $(left $(limit 300)) python3 scripts/probe_triton_backend_gap.py \
      --out "$OUT/backend_gap.json" >"$OUT/backend_gap.log" 2>&1
    echo "rc=$?" >>"$OUT/backend_gap.log"
    ;;
  bisect)
    timeout $(left $(limit 300)) python3 scripts/probe_triton_backend_gap.py --bisect \
      --out "$OUT/backend_gap_bisect.json" >"$OUT/backend_gap_bisect.log" 2>&1
    echo "rc=$?" >>"$OUT/backend_gap_bisect.log"
    ;;
  planted)
    gpu_tests planted-gpu $(limit 400) tests/conformance/test_planted.py
    ;;
  sparsebench)
    timeout $(left $(limit 400)) python3 -m benchmarks --only sparse --out "$OUT/sparse" \
      --no-render --no-jit-cache >"$OUT/sparsebench.log" 2>&1
    echo "rc=$?" >>"$OUT/sparsebench.log"
    ;;
  padding)
    timeout $(left $(limit 240)) python3 scripts/probe_padding_launch.py \
      --out "$OUT/probe-padding.json" >"$OUT/probe-padding.log" 2>&1
    echo "rc=$?" >>"$OUT/probe-padding.log"
    timeout $(left $(limit 360)) python3 scripts/probe_padding_launch.py --verify-rows \
      --out "$OUT/probe-verify-rows.json" >"$OUT/probe-verify-rows.log" 2>&1
    echo "rc=$?" >>"$OUT/probe-verify-rows.log"
    gpu_tests pad-rows $(limit 120) tests/runtime/test_pad_rows_kernel.py
    ;;
  claims)
    args=()
    for b in ${CLAIMS_BACKENDS:-triton reference flashmla}; do args+=(--backend "$b"); done
    # in the background: a later step's `wait` (conf, sparse) or the call's end joins it
    conf "claims" $(limit 400) --plugin attnreg_flashmla.plugin -k "${K:-fp8_large_q}" "${args[@]}" &
    ;;
  *)
    echo "h200.sh: unknown step $step (conf|gpu|bench|peers|sparse|integrity|fp8q|kout|wide|stages|stages1|tp32|gap|bisect|planted|sparsebench|padding|claims)" >&2; exit 2
    ;;
esac
echo "step $step: $(( $(date +%s) - start )) s"
done
wait
step=${steps// /-}  # one plain name: a device call brings back no name with odd characters
# the flashinfer JIT cache, to carry as .gpu/fi-cache.tgz next time (no nvcc rebuild)
[ -d ~/.cache/flashinfer ] && [ ! -f .gpu/fi-cache.tgz ] && tar czf "$OUT/fi-cache.tgz" -C ~/.cache flashinfer
tar czf "/tmp/results-$step.tgz" -C "$OUT" --exclude='*.tgz' . 2>/dev/null
find "$OUT" -mindepth 1 ! -name fi-cache.tgz -delete
mv "/tmp/results-$step.tgz" "$OUT/"
ls -la "$OUT"
