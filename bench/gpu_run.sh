#!/usr/bin/env bash
# Everything a lent GPU should check and measure, in two device calls (a device call runs at
# most 10 minutes). On the device machine, from the checkout's root, with ../shared/gpu
# copied in as .gpu/ (see ../shared/gpu/README.md; the machine has no Ray and no package
# registry) and $OUT the folder whose files come back:
#
#     bash bench/gpu_run.sh tests base         # first call: the GPU tests, llama-1b one pass a step
#     bash bench/gpu_run.sh multistep 8b       # second call: llama-1b multi-step 8, llama-8b latency
#
# (no part named: all four, which may not fit one call). Each part has its own time limit and
# writes its log and JSON under $OUT as it finishes, so a part that runs out of time costs
# only itself. The bench models are built into $TANDEM_CACHE_DIR (once per machine).
cd "$(dirname "$0")/.."
. .gpu/setup.sh
export TANDEM_CACHE_DIR=${TANDEM_CACHE_DIR:-/tmp/tandem-cache}
OUT=${OUT:-/tmp/tandem-gpu-out}
mkdir -p "$OUT"
log() { echo "[$(date +%T)] $*" | tee -a "$OUT/progress.log"; }
tandem_cli() { python3 -c 'import sys; from tandem.router.cli import main; sys.exit(main())' "$@"; }
model_1b() { ls -d "$TANDEM_CACHE_DIR"/bench-llama-1b-* | head -1; }
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, transformers, triton; print(torch.__version__, transformers.__version__, triton.__version__)"
} > "$OUT/env.txt" 2>&1

part_tests() {
  log "GPU tests"
  timeout 240 python3 -m pytest -q -x -p no:cacheprovider tests/gpu tests/model/test_gpu_path.py tests/kernels \
    > "$OUT/tests.log" 2>&1; log "tests rc $?"
}

# llama-1b, one forward pass a step: latency (batch 1, sweep to 128), the offline set, where
# a decode step's time goes, and the host's share of it.
part_base() {
  log "latency llama-1b"
  timeout 150 tandem_cli bench latency --bench-model llama-1b --device cuda --repeats 3 \
    --output-json "$OUT/latency_1b.json" > "$OUT/latency_1b.log" 2>&1; log "latency rc $?"
  log "offline llama-1b"
  timeout 150 tandem_cli bench offline --bench-model llama-1b --device cuda --repeats 3 --no-hf-sequential \
    --output-json "$OUT/offline_1b.json" > "$OUT/offline_1b.log" 2>&1; log "offline rc $?"
  log "step breakdown"
  timeout 40 python3 -m tandem.bench.step_breakdown "$(model_1b)" > "$OUT/breakdown.log" 2>&1
  log "breakdown rc $?"
  log "host step"
  timeout 60 python3 -m tandem.bench.host_step "$(model_1b)" --device cuda --batches 1,32,128 --repeats 2 \
    --output-json "$OUT/host_step.json" > "$OUT/host_step.log" 2>&1; log "host step rc $?"
}

# llama-1b with multi-step decoding (8 forward passes a step): the same figures.
part_multistep() {
  log "latency llama-1b, multi-step 8"
  timeout 150 tandem_cli bench latency --bench-model llama-1b --device cuda --repeats 3 --num-scheduler-steps 8 \
    --output-json "$OUT/latency_1b_ms8.json" > "$OUT/latency_1b_ms8.log" 2>&1; log "latency ms8 rc $?"
  log "offline llama-1b, multi-step 8"
  timeout 150 tandem_cli bench offline --bench-model llama-1b --device cuda --repeats 3 --no-hf-sequential \
    --num-scheduler-steps 8 --output-json "$OUT/offline_1b_ms8.json" > "$OUT/offline_1b_ms8.log" 2>&1
  log "offline ms8 rc $?"
  log "host step, multi-step 8"
  timeout 60 python3 -m tandem.bench.host_step "$(model_1b)" --device cuda --batches 1,32,128 --repeats 2 \
    --num-scheduler-steps 8 --output-json "$OUT/host_step_ms8.json" > "$OUT/host_step_ms8.log" 2>&1
  log "host step ms8 rc $?"
}

# Llama-3-8B's shape: MBU at batch 1 (one pass a step, then multi-step 8).
part_8b() {
  log "latency llama-8b"
  timeout 200 tandem_cli bench latency --bench-model llama-8b --device cuda --quick --repeats 2 \
    --sweep-batches 1,32 --output-json "$OUT/latency_8b.json" > "$OUT/latency_8b.log" 2>&1; log "latency 8b rc $?"
  timeout 100 tandem_cli bench latency --bench-model llama-8b --device cuda --quick --repeats 2 \
    --sweep-batches 1,32 --num-scheduler-steps 8 --output-json "$OUT/latency_8b_ms8.json" \
    > "$OUT/latency_8b_ms8.log" 2>&1; log "latency 8b ms8 rc $?"
}

parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(tests base multistep 8b)
for part in "${parts[@]}"; do
  case "$part" in
    tests | base | multistep | 8b) "part_$part" ;;
    *) echo "gpu_run.sh: unknown part $part (tests, base, multistep, 8b)" >&2; exit 2 ;;
  esac
done
