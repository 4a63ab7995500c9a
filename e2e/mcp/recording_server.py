"""An MCP server over stdio for Keel's tests (crates/keel/tests/mcp.rs, crates/keel-tools/tests/mcp.rs), with the Python SDK (`mcp`,
pinned in requirements.txt). It appends one JSON line per event to the file named by MCP_RECORD:

  {"event": "started", "pid": ...}                 when the process starts
  {"event": "call", "tool", "args", "key", "pid"}  when a call arrives (key: the call's
                                                   keel.dev/idempotencyKey from _meta)
  {"event": "done", "tool", "key"}                 when a call answers
  {"event": "cancelled", "tool", "key"}            when a call is cancelled (notifications/cancelled)

Tools (each sleeps `delay_ms` before it answers, so a test can act while a call is in flight; a
call whose key the record already has answers at once, as a retry after a crash should):
  write   - a side effect, not idempotent (no hints but readOnlyHint=false)
  put     - a side effect, idempotentHint=true
  read    - readOnlyHint=true
  fail    - answers isError=true with its message
  grow    - adds a read-only tool named `item` (which answers "<item> ok") and sends
            notifications/tools/list_changed
"""

import asyncio
import json
import os
import sys

from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp.types import ToolAnnotations

RECORD = os.environ.get("MCP_RECORD")
server = MCPServer("keel-test-recorder")


def record(**event):
    if RECORD:
        with open(RECORD, "a", encoding="utf-8") as f:
            f.write(json.dumps(event) + "\n")
            f.flush()


def key_of(ctx: Context) -> str | None:
    meta = ctx.request_context.meta
    if meta is None:
        return None
    if isinstance(meta, dict):
        return meta.get("keel.dev/idempotencyKey")
    extra = getattr(meta, "model_extra", None) or {}
    return extra.get("keel.dev/idempotencyKey") or getattr(meta, "keel.dev/idempotencyKey", None)


def seen(key: str | None) -> bool:
    if not RECORD or key is None or not os.path.exists(RECORD):
        return False
    with open(RECORD, encoding="utf-8") as f:
        return any(json.loads(line).get("key") == key for line in f if line.strip())


async def run(tool: str, ctx: Context, args: dict, delay_ms: int) -> str:
    key = key_of(ctx)
    if seen(key):
        delay_ms = 0
    record(event="call", tool=tool, args=args, key=key, pid=os.getpid())
    try:
        await asyncio.sleep(delay_ms / 1000)
    except asyncio.CancelledError:
        record(event="cancelled", tool=tool, key=key)
        raise
    record(event="done", tool=tool, key=key)
    return f"{tool} {args.get('item')} ok"


@server.tool(annotations=ToolAnnotations(readOnlyHint=False, destructiveHint=True, idempotentHint=False))
async def write(item: str, ctx: Context, delay_ms: int = 0) -> str:
    """Writes an item (a side effect, not idempotent)."""
    return await run("write", ctx, {"item": item, "delay_ms": delay_ms}, delay_ms)


@server.tool(annotations=ToolAnnotations(readOnlyHint=False, destructiveHint=False, idempotentHint=True))
async def put(item: str, ctx: Context, delay_ms: int = 0) -> str:
    """Puts an item (a side effect, idempotent)."""
    return await run("put", ctx, {"item": item, "delay_ms": delay_ms}, delay_ms)


@server.tool(annotations=ToolAnnotations(readOnlyHint=True))
async def read(item: str, ctx: Context, delay_ms: int = 0) -> str:
    """Reads an item."""
    return await run("read", ctx, {"item": item, "delay_ms": delay_ms}, delay_ms)


@server.tool(annotations=ToolAnnotations(readOnlyHint=True))
async def fail(message: str) -> str:
    """Always fails with the message."""
    # ToolError: an anticipated failure, whose message the client gets (isError=true).
    raise ToolError(message)


@server.tool(annotations=ToolAnnotations(readOnlyHint=False, destructiveHint=False, idempotentHint=True))
async def grow(item: str, ctx: Context) -> str:
    """Adds a tool named after the item and tells the client the tool list changed."""

    async def added(note: str = "") -> str:
        record(event="call", tool=item, args={"note": note}, key=None, pid=os.getpid())
        return f"{item} ok"

    server.add_tool(added, name=item, description=f"Added at run time: {item}.",
                    annotations=ToolAnnotations(readOnlyHint=True))
    record(event="grown", tool=item)
    await ctx.request_context.session.send_tool_list_changed()
    return f"grow {item} ok"


if __name__ == "__main__":
    record(event="started", pid=os.getpid())
    print("recording_server.py started", file=sys.stderr)
    try:
        server.run()
    except BaseException as e:  # noqa: BLE001 - stdin closed under it (Keel was killed): exit quietly
        print(f"recording_server.py stopped: {type(e).__name__}", file=sys.stderr)
