#!/usr/bin/env bash
# Two gateways + Redis + a simulated 4-replica fleet on one machine (no Docker needed).
#   deploy/local/run.sh            start everything, print the URLs, Ctrl-C stops it all
# Gateways: http://127.0.0.1:8080 and :8081, sharing the prefix index and sessions in Redis.
set -euo pipefail
cd "$(dirname "$0")/../.."
BIN=${BIN:-.venv/bin}
pids=()
cleanup() { for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT INT TERM

if ! redis-cli -h 127.0.0.1 -p 6379 ping >/dev/null 2>&1; then
  redis-server --daemonize no --bind 127.0.0.1 --port 6379 --save "" --appendonly no >/dev/null & pids+=($!)
  for _ in $(seq 1 50); do redis-cli ping >/dev/null 2>&1 && break; sleep 0.1; done
fi
"$BIN/llm-gateway" sim --replicas 4 --base-port 8001 --kv-blocks 1024 & pids+=($!)
endpoints=()
for port in 8001 8002 8003 8004; do
  for _ in $(seq 1 100); do curl -sf "http://127.0.0.1:$port/health" >/dev/null && break; sleep 0.1; done
  endpoints+=(--endpoint "http://127.0.0.1:$port")
done
for port in 8080 8081; do
  "$BIN/llm-gateway" serve --config deploy/local/shared.yaml --port "$port" "${endpoints[@]}" & pids+=($!)
done
for port in 8080 8081; do
  for _ in $(seq 1 100); do curl -sf "http://127.0.0.1:$port/ready" >/dev/null && break; sleep 0.1; done
done
echo "gateways: http://127.0.0.1:8080 http://127.0.0.1:8081 (shared Redis index); fleet: :8001-:8004"
wait
