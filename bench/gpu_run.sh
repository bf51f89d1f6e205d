#!/usr/bin/env bash
# Everything a lent GPU should check and measure, in one device call (a device call runs at
# most 10 minutes; budget about 9). On the device machine, from the checkout's root, with
# ../shared/gpu copied in as .gpu/ (see ../shared/gpu/README.md; the machine has no Ray and
# no package registry) and $OUT the folder whose files come back:
#
#     bash bench/gpu_run.sh            # tests, then llama-1b benchmarks, then llama-8b latency
#
# Each part has its own time limit and writes its log and JSON under $OUT as it finishes,
# so a part that runs out of time costs only itself.
cd "$(dirname "$0")/.."
. .gpu/setup.sh
export TANDEM_CACHE_DIR=${TANDEM_CACHE_DIR:-/tmp/tandem-cache}
OUT=${OUT:-/tmp/tandem-gpu-out}
mkdir -p "$OUT"
log() { echo "[$(date +%T)] $*" | tee -a "$OUT/progress.log"; }
tandem_cli() { python3 -c 'import sys; from tandem.router.cli import main; sys.exit(main())' "$@"; }
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, transformers, triton; print(torch.__version__, transformers.__version__, triton.__version__)"
} > "$OUT/env.txt" 2>&1

log "GPU tests"
timeout 240 python3 -m pytest -q -x -p no:cacheprovider tests/gpu tests/model/test_gpu_path.py tests/kernels \
  > "$OUT/tests.log" 2>&1; log "tests rc $?"
log "latency llama-1b"
timeout 150 tandem_cli bench latency --bench-model llama-1b --device cuda --repeats 3 \
  --output-json "$OUT/latency_1b.json" > "$OUT/latency_1b.log" 2>&1; log "latency rc $?"
log "offline llama-1b"
timeout 150 tandem_cli bench offline --bench-model llama-1b --device cuda --repeats 3 --no-hf-sequential \
  --output-json "$OUT/offline_1b.json" > "$OUT/offline_1b.log" 2>&1; log "offline rc $?"
log "step breakdown"
timeout 40 python3 -m tandem.bench.step_breakdown "$(ls -d "$TANDEM_CACHE_DIR"/bench-llama-1b-* | head -1)" \
  > "$OUT/breakdown.log" 2>&1; log "breakdown rc $?"
log "host step"
timeout 60 python3 -m tandem.bench.host_step "$(ls -d "$TANDEM_CACHE_DIR"/bench-llama-1b-* | head -1)" --device cuda \
  --batches 1,32,128 --repeats 2 --output-json "$OUT/host_step.json" > "$OUT/host_step.log" 2>&1; log "host step rc $?"
log "latency llama-8b"
timeout 200 tandem_cli bench latency --bench-model llama-8b --device cuda --quick --repeats 2 \
  --sweep-batches 1,32 --output-json "$OUT/latency_8b.json" > "$OUT/latency_8b.log" 2>&1; log "latency 8b rc $?"
