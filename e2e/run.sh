#!/usr/bin/env bash
# The web page's browser tests: Debian's chromium driven by playwright-core, against `keel demo`.
#   e2e/run.sh                 run the tests
#   e2e/run.sh --screenshots   also write docs/screenshot-confirm.png and docs/screenshot-done.png
# Needs node >= 20, npm and python3 (crates/keel/tests/support/tool_service.py, the HTTP service of
# own-agent.test.js); installs chromium with apt-get when /usr/bin/chromium is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-/var/tmp/keel-target}"

if [ "${1:-}" = "--screenshots" ]; then
  export KEEL_SCREENSHOTS_DIR="$ROOT/docs"
fi

if [ ! -x /usr/bin/chromium ]; then
  echo "== installing chromium (apt-get)"
  SUDO=""
  [ "$(id -u)" = 0 ] || SUDO=sudo
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends chromium >/dev/null
fi
export CHROMIUM=/usr/bin/chromium

echo "== npm ci (e2e/)"
(cd e2e && npm ci --no-audit --no-fund --loglevel=error)

echo "== cargo build -p keel"
cargo build -p keel --locked
BIN="$CARGO_TARGET_DIR/debug/keel"

DATA=$(mktemp -d "${TMPDIR:-/tmp}/keel-e2e-data.XXXXXX")
LOG="$DATA/keel.log"
"$BIN" demo --listen 127.0.0.1:0 --data-dir "$DATA" --demo-delay-ms 20 >"$LOG" 2>&1 &
PID=$!
cleanup() {
  kill "$PID" 2>/dev/null || true
  wait "$PID" 2>/dev/null || true
  rm -rf "$DATA"
}
trap cleanup EXIT

# The server prints the address it bound (port 0: any free port), then answers /healthz.
URL=""
deadline=$((SECONDS + 60))
until [ -n "$URL" ]; do
  URL=$(grep -o 'http://127\.0\.0\.1:[0-9]*' "$LOG" | head -n 1 || true)
  if ! kill -0 "$PID" 2>/dev/null; then echo "keel demo exited:"; cat "$LOG"; exit 1; fi
  if [ "$SECONDS" -ge "$deadline" ]; then echo "keel demo printed no address within 60 s:"; cat "$LOG"; exit 1; fi
  [ -n "$URL" ] || sleep 0.2
done
until node -e 'fetch(process.argv[1]).then((r) => process.exit(r.ok ? 0 : 1), () => process.exit(1))' "$URL/healthz"; do
  if [ "$SECONDS" -ge "$deadline" ]; then echo "$URL/healthz did not answer within 60 s:"; cat "$LOG"; exit 1; fi
  sleep 0.2
done
echo "== browser tests against $URL"

export KEEL_URL="$URL" KEEL_BIN="$BIN"
status=0
node --test --test-concurrency=1 e2e/tests/ || status=$?
if [ "$status" != 0 ]; then
  echo "== the server's log (last 80 lines)"
  tail -n 80 "$LOG"
fi
exit "$status"
