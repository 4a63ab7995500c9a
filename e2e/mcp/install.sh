#!/usr/bin/env bash
# Installs the MCP servers Keel's MCP tests run against, from the registries, pinned:
#   - @modelcontextprotocol/server-everything (npm, package-lock.json) into e2e/mcp/node_modules,
#   - the Python SDK `mcp` (PyPI, requirements.txt) into a virtualenv for recording_server.py
#     (under /var/tmp, a cache; KEEL_MCP_VENV overrides).
# Needs node >= 20 with npm, and python3 >= 3.11. Prints the variables the tests read; .ci/run
# evaluates them:  eval "$(bash e2e/mcp/install.sh)"
set -euo pipefail
cd "$(dirname "$0")"
HERE=$PWD
VENV="${KEEL_MCP_VENV:-/var/tmp/keel-mcp-venv-$(sha256sum requirements.txt | cut -c1-12)}"

echo "== npm ci (e2e/mcp/)" >&2
npm ci --no-audit --no-fund --loglevel=error >&2

echo "== the Python MCP SDK (pip, in $VENV)" >&2
if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c "import mcp" 2>/dev/null; then
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q --disable-pip-version-check -r requirements.txt >&2
fi

echo "export KEEL_TEST_MCP_EVERYTHING=$HERE/node_modules/@modelcontextprotocol/server-everything/dist/index.js"
echo "export KEEL_TEST_MCP_PYTHON=$VENV/bin/python"
