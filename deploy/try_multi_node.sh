#!/usr/bin/env bash
# Two Ray nodes on this machine, started as an operator starts them, serving
# deploy/serve_config.yaml with two replica groups, one per node; then a completion
# through each API. (tests/deploy/test_multi_node.py runs the same steps and more.)
#
#   bash deploy/try_multi_node.sh        # from the repository root, with tandem installed
#
# Everything lives under its own temp dir and free ports; Ctrl-C or the end stops both
# nodes by their own pids (never a machine-wide `ray stop`).
set -euo pipefail
cd "$(dirname "$0")/.."

BASE=$(mktemp -d /tmp/tandem-nodes-XXXX)
port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
GCS_PORT=$(port); DASHBOARD_PORT=$(port); HTTP_PORT=$(port); GRPC_PORT=$(port)
export RAY_AUTH_MODE=token RAY_AUTH_TOKEN=$(python3 -c 'import secrets; print(secrets.token_hex(32))')
export RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S=0 RAY_USAGE_STATS_ENABLED=0

# Each node's agents on free ports of their own: left at 0, the raylet waits ~15 s for each agent
# to write the port it took to a file and crashes on a loaded machine (deploy/README.md, "Ports").
agent_ports() {
  echo "--dashboard-agent-listen-port=$(port) --dashboard-agent-grpc-port=$(port)" \
       "--runtime-env-agent-port=$(port) --metrics-export-port=$(port)"
}

PIDS=()
stop() {
  for pid in "${PIDS[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  for pid in "${PIDS[@]}"; do wait "$pid" 2>/dev/null || true; done
  echo "stopped; logs in $BASE"
}
trap stop EXIT

wait_for() {  # wait_for SECONDS COMMAND...: poll until the command succeeds
  local deadline=$((SECONDS + $1)); shift
  until "$@" >/dev/null 2>&1; do
    if ((SECONDS > deadline)); then echo "timed out: $*" >&2; return 1; fi
    sleep 2
  done
}

echo "== head node (one engine slot; stage 0 and stage 1 of a group)"
# shellcheck disable=SC2046  # agent_ports is one flag a word
ray start --head --block --temp-dir="$BASE/head" --port="$GCS_PORT" --dashboard-port="$DASHBOARD_PORT" \
  $(agent_ports) --include-dashboard=true --num-cpus=4 --num-gpus=0 --resources='{"group_slot": 1, "stage0": 1, "stage1": 1}' \
  >"$BASE/head.log" 2>&1 &
PIDS+=($!)
wait_for 120 grep -q "Ray runtime started" "$BASE/head.log"
ADDRESS=$(grep -o "ray start --address='[^']*'" "$BASE/head.log" | head -1 | cut -d"'" -f2)

echo "== second node, joining $ADDRESS"
# shellcheck disable=SC2046
ray start --block --address="$ADDRESS" --temp-dir="$BASE/worker" $(agent_ports) --num-cpus=4 --num-gpus=0 \
  --resources='{"group_slot": 1, "stage0": 1, "stage1": 1}' >"$BASE/worker.log" 2>&1 &
PIDS=("$!" "${PIDS[@]}")
wait_for 120 grep -q "Ray runtime started" "$BASE/worker.log"

echo "== serve deploy: two PP=2 groups, at most one engine per node"
python3 - "$HTTP_PORT" "$GRPC_PORT" >"$BASE/serve_config.yaml" <<'EOF'
import sys, yaml
config = yaml.safe_load(open("deploy/serve_config.yaml"))
config["http_options"].update(host="127.0.0.1", port=int(sys.argv[1]))
config["grpc_options"]["port"] = int(sys.argv[2])
[app] = config["applications"]
app["args"].update(num_replicas=2, pipeline_parallel_size=2)
app["deployments"] = [{"name": "GroupServer", "placement_group_strategy": "PACK", "placement_group_bundles": [
    {"CPU": 1, "group_slot": 1}, {"CPU": 1, "stage0": 1}, {"CPU": 1, "stage1": 1}]}]
print(yaml.safe_dump(config, sort_keys=False))
EOF
serve deploy "$BASE/serve_config.yaml" --address "http://127.0.0.1:$DASHBOARD_PORT"
wait_for 300 sh -c "serve status --address http://127.0.0.1:$DASHBOARD_PORT | grep -q 'RUNNING: 2'"
serve status --address "http://127.0.0.1:$DASHBOARD_PORT"

echo "== OpenAI API (x-tandem-groups names the group that answered)"
for prompt in "Hello, tandem" "Once upon a time"; do
  curl -s -i "http://127.0.0.1:$HTTP_PORT/v1/completions" -H "Content-Type: application/json" \
    -d "{\"model\": \"tandem-demo\", \"prompt\": \"$prompt\", \"max_tokens\": 16, \"temperature\": 0}" \
    | grep -i -e "^x-tandem-groups" -e '"text"' | cut -c1-160
done

echo "== gRPC"
python3 - "127.0.0.1:$GRPC_PORT" <<'EOF'
import sys, grpc
from tandem.router import tandem_pb2 as pb, tandem_pb2_grpc as pb_grpc
stub = pb_grpc.TandemStub(grpc.insecure_channel(sys.argv[1]))
reply = stub.Generate(pb.GenerateRequest(text="Hello, tandem", sampling=pb.SamplingParams(max_tokens=16)), timeout=60)
print(reply.choices[0].text)
EOF
