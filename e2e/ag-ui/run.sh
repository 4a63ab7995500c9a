#!/usr/bin/env bash
# AG-UI conformance in CI, against a real `keel demo` on a free port:
#   1. ag-ui-validate (PyPI, pinned) on /v1/ag-ui for a plain question (its own default input),
#   2. the same validator for the human-in-the-loop flow (interrupt, then resume): validate_hitl.py,
#   3. the real @ag-ui/client HttpAgent running the OpsPilot restart flow: http-agent.mjs,
#   4. a frontend tool (a `kind = "client"` tool the client declares and answers with a `tool`
#      message), with the HttpAgent and the validator, against a `keel serve` of its own:
#      frontend-tool.mjs (and validate_frontend_tool.py).
# Zero errors and zero warnings are required (docs/ag-ui.md explains the info-level findings).
# Needs python3 >= 3.11, node >= 20 and npm. The validator goes into a virtualenv under /var/tmp
# (a cache; KEEL_AGUI_VENV overrides), the npm packages into e2e/ag-ui/node_modules (gitignored).
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-/var/tmp/keel-target}"
VALIDATOR_VERSION=0.4.0
VENV="${KEEL_AGUI_VENV:-/var/tmp/keel-agui-venv-$VALIDATOR_VERSION}"

echo "== ag-ui-validate $VALIDATOR_VERSION (pip, in $VENV)"
if [ ! -x "$VENV/bin/ag-ui-validate" ]; then
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q --disable-pip-version-check "ag-ui-validate[transport]==$VALIDATOR_VERSION"
fi

echo "== npm ci (e2e/ag-ui/)"
(cd e2e/ag-ui && npm ci --no-audit --no-fund --loglevel=error)

echo "== cargo build -p keel"
cargo build -q -p keel --locked
BIN="$CARGO_TARGET_DIR/debug/keel"

# shellcheck source=e2e/demo.sh
source e2e/demo.sh
start_demo agui --demo-delay-ms 5

status=0
echo "== ag-ui-validate $URL/v1/ag-ui (a plain question)"
"$VENV/bin/ag-ui-validate" "$URL/v1/ag-ui" --no-color --max-warnings 0 --timeout 60 || status=1
echo "== ag-ui-validate, human in the loop: interrupt, then resume"
"$VENV/bin/python" e2e/ag-ui/validate_hitl.py "$URL/v1/ag-ui" || status=1
echo "== @ag-ui/client HttpAgent: the OpsPilot restart flow"
(cd e2e/ag-ui && KEEL_URL="$URL" node http-agent.mjs) || status=1
echo "== a frontend tool: @ag-ui/client HttpAgent and ag-ui-validate against keel serve with a client tool"
(cd e2e/ag-ui && KEEL_BIN="$BIN" AGUI_PYTHON="$VENV/bin/python" node frontend-tool.mjs) || status=1
if [ "$status" != 0 ]; then
  echo "== the server's log (last 80 lines)"
  tail -n 80 "$LOG"
fi
exit "$status"
