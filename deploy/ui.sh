#!/usr/bin/env bash
# `make ui`: the Prefect server (UI + API, SQLite under $PREFECT_HOME, bound to 127.0.0.1) and the
# hero-run deployments served from this checkout (flows/serve.py). Ctrl-C stops both.
# Then open http://127.0.0.1:${UI_PORT:-4200} -> Deployments -> hero-run -> Run -> Quick run.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
PORT=${UI_PORT:-4200}
export PREFECT_HOME=${PREFECT_HOME:-$PWD/.prefect}
export PREFECT_API_URL=http://127.0.0.1:$PORT/api
export PREFECT_UI_API_URL=$PREFECT_API_URL   # what the browser calls (the default assumes port 4200)
export PREFECT_SERVER_ANALYTICS_ENABLED=false
mkdir -p "$PREFECT_HOME"
LOG=$PREFECT_HOME/server.log

# its own process group, so that stopping it stops every process it started
setsid "$PY" -m prefect server start --host 127.0.0.1 --port "$PORT" >"$LOG" 2>&1 &
SERVER=$!
trap 'kill -TERM -- -$SERVER 2>/dev/null || true; wait $SERVER 2>/dev/null || true' EXIT INT TERM
for _ in $(seq 180); do
  "$PY" -c "import httpx, sys; sys.exit(httpx.get('$PREFECT_API_URL/health', timeout=2).status_code != 200)" \
    2>/dev/null && break
  kill -0 "$SERVER" 2>/dev/null || { tail -n 40 "$LOG"; echo "prefect server did not start" >&2; exit 1; }
  sleep 1
done
echo "Prefect UI: http://127.0.0.1:$PORT  (database and settings: $PREFECT_HOME, server log: $LOG)"
"$PY" -m flows.serve --profile "${PROFILE:-configs/smollm2-cpu.yaml}" ${SERVE_ARGS:-}
