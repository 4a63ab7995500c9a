# Sourced by the e2e scripts (e2e/ag-ui/run.sh, e2e/langgraph/run.sh): starts `keel demo` ($BIN)
# on a free port, with its data in a temporary directory, waits until it answers /healthz, and
# stops it and removes the directory when the script exits. Sets DATA, LOG, PID and URL.
#
#   start_demo NAME [more `keel demo` flags…]
start_demo() {
  DATA=$(mktemp -d "${TMPDIR:-/tmp}/keel-$1.XXXXXX")
  shift
  LOG="$DATA/keel.log"
  "$BIN" demo --listen 127.0.0.1:0 --data-dir "$DATA/data" "$@" >"$LOG" 2>&1 &
  PID=$!
  trap stop_demo EXIT
  # The server prints the address it bound (port 0: any free port), then answers /healthz.
  URL=""
  local deadline=$((SECONDS + 60))
  until [ -n "$URL" ] && curl -sf "$URL/healthz" >/dev/null; do
    URL=$(grep -o 'http://127\.0\.0\.1:[0-9]*' "$LOG" | head -n 1 || true)
    kill -0 "$PID" 2>/dev/null || { echo "keel demo exited:"; cat "$LOG"; exit 1; }
    [ "$SECONDS" -lt "$deadline" ] || { echo "keel demo did not come up within 60 s:"; cat "$LOG"; exit 1; }
    sleep 0.2
  done
}

stop_demo() {
  kill "$PID" 2>/dev/null || true
  wait "$PID" 2>/dev/null || true
  rm -rf "$DATA"
}
