#!/usr/bin/env bash
# LangGraph Server API compatibility in CI (docs/langgraph.md), against a real `keel demo` on a
# free port, under its /langgraph prefix:
#   1. the real langgraph-sdk (PyPI, pinned) through the issue's flows: flows.py,
#   2. the real @langchain/langgraph-sdk (npm, pinned, package-lock.json) through the
#      human-in-the-loop flow: hitl.mjs.
# Needs python3 >= 3.11, node >= 20 and npm. The SDK goes into a virtualenv under /var/tmp (a cache;
# KEEL_LANGGRAPH_VENV overrides), the npm package into e2e/langgraph/node_modules (gitignored).
set -euo pipefail
cd "$(dirname "$0")/../.."
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-/var/tmp/keel-target}"
SDK_VERSION=0.4.14
# The SDK and its dependencies, pinned in requirements.txt; the venv is named by its hash.
VENV="${KEEL_LANGGRAPH_VENV:-/var/tmp/keel-langgraph-venv-$(sha256sum e2e/langgraph/requirements.txt | cut -c1-12)}"

echo "== langgraph-sdk $SDK_VERSION (pip, in $VENV)"
if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c 'import langgraph_sdk' 2>/dev/null; then
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q --disable-pip-version-check -r e2e/langgraph/requirements.txt
fi

echo "== npm ci (e2e/langgraph/)"
(cd e2e/langgraph && npm ci --no-audit --no-fund --loglevel=error)

echo "== cargo build -p keel"
cargo build -q -p keel --locked
BIN="$CARGO_TARGET_DIR/debug/keel"

# shellcheck source=e2e/demo.sh
source e2e/demo.sh
start_demo langgraph --demo-delay-ms 5

status=0
echo "== langgraph-sdk (Python): assistants, threads, streams, interrupt and resume, join, multitask, wait, cancel, delete"
timeout 300 "$VENV/bin/python" e2e/langgraph/flows.py "$URL" || status=1
echo "== @langchain/langgraph-sdk (node): the human-in-the-loop flow"
(cd e2e/langgraph && KEEL_URL="$URL" timeout 120 node hitl.mjs) || status=1
if [ "$status" != 0 ]; then
  echo "== the server's log (last 80 lines)"
  tail -n 80 "$LOG"
fi
exit "$status"
