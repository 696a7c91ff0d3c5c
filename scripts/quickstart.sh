#!/usr/bin/env bash
# Sets up (scripts/setup.sh), starts a local mooncake cluster on the bundled
# SmolLM2-135M-Instruct model (`mooncake up`: one prefill, one decode and one cache
# node, each its own process; the cache node serves the OpenAI API), asks it one chat
# question through the prefill/decode path, prints the answer, and stops the cluster.
# PORT=... chooses the API port (default 8000).
# Its files (the cluster's work directory with the node logs, the answer) live in one
# temporary directory, removed at exit on success and kept (its path printed) on failure.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
PORT=${PORT:-8000}
URL="http://127.0.0.1:$PORT"
TMP=$(mktemp -d -t mooncake-quickstart.XXXXXX)
LOG="$TMP/up.log"
ANSWER="$TMP/answer.json"
UP=""
cleanup() {
    local rc=$?
    if [ -n "$UP" ]; then kill -TERM "$UP" 2>/dev/null || true; wait "$UP" 2>/dev/null || true; fi
    if [ "$rc" = 0 ]; then
        rm -rf "$TMP"
    else
        echo "quickstart: failed (exit $rc); logs kept in $TMP (up.log, up/*.log)" >&2
    fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM
.venv/bin/mooncake up --port "$PORT" --workdir "$TMP/up" >"$LOG" 2>&1 &
UP=$!
echo "quickstart: mooncake up --port $PORT (log: $LOG)"
ready=""
for _ in $(seq 1 600); do
    if grep -q "^ready:" "$LOG"; then ready=1; break; fi
    if ! kill -0 $UP 2>/dev/null; then echo "quickstart: mooncake up exited:"; cat "$LOG"; exit 1; fi
    sleep 0.5
done
[ -n "$ready" ] || { echo "quickstart: the cluster did not become ready"; cat "$LOG"; exit 1; }
cat "$LOG"
echo
echo "quickstart: POST $URL/v1/chat/completions: What is the capital of Japan?"
BODY='{"messages": [{"role": "user", "content": "What is the capital of Japan?"}], "max_tokens": 64, "temperature": 0}'
for _ in $(seq 1 30); do   # the conductor may need a moment to see every node
    code=$(curl -sS -o "$ANSWER" -w '%{http_code}' "$URL/v1/chat/completions" \
        -H 'Content-Type: application/json' -d "$BODY") || code=000
    [ "$code" = 200 ] && break
    sleep 1
done
[ "$code" = 200 ] || { echo "quickstart: HTTP $code"; cat "$ANSWER"; echo; exit 1; }
.venv/bin/python -c 'import json, sys; r = json.load(open(sys.argv[1])); print("answer:", r["choices"][0]["message"]["content"]); print("usage:", r["usage"])' "$ANSWER"
echo "quickstart: done; stopping the cluster (run \`.venv/bin/mooncake up\` to keep one running)"
