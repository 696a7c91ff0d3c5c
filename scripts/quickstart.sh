#!/usr/bin/env bash
# Sets up (scripts/setup.sh), starts mooncaked on the bundled SmolLM2-135M-Instruct
# model, asks it one chat question through the OpenAI-compatible API, prints the
# answer, and stops the server. PORT=... to choose the port (default 8000).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
PORT=${PORT:-8000}
LOG=$(mktemp -t mooncaked-quickstart.XXXXXX.log)
.venv/bin/mooncaked serve --role all --port "$PORT" >"$LOG" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null; wait $SERVER 2>/dev/null || true' EXIT
echo "quickstart: starting mooncaked on 127.0.0.1:$PORT (log: $LOG)"
for _ in $(seq 1 240); do
    if curl -sf "http://127.0.0.1:$PORT/health" >/dev/null; then break; fi
    if ! kill -0 $SERVER 2>/dev/null; then echo "quickstart: server exited:"; cat "$LOG"; exit 1; fi
    sleep 0.5
done
curl -sf "http://127.0.0.1:$PORT/health" >/dev/null || { echo "quickstart: server not ready"; cat "$LOG"; exit 1; }
echo "quickstart: POST /v1/chat/completions: What is the capital of France?"
curl -sS "http://127.0.0.1:$PORT/v1/chat/completions" -H 'Content-Type: application/json' \
    -d '{"messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 64, "temperature": 0}' \
    | .venv/bin/python -c 'import json, sys; r = json.load(sys.stdin); print("answer:", r["choices"][0]["message"]["content"]); print("usage:", r["usage"])'
