"""The AG-UI conformance validator (ag-ui-validate, PyPI) on a frontend tool: the client declares
`ask_user`, the run ends after the call is announced, and the next run carries the client's result
as a `tool` message. Each run must have zero errors and zero warnings. Started by frontend-tool.mjs
against its own `keel serve`. Usage: python validate_frontend_tool.py http://127.0.0.1:PORT/v1/ag-ui/front
"""

import asyncio
import json
import sys
import uuid

from validate_hitl import run

TOOLS = [
    {
        "name": "ask_user",
        "description": "Ask the user a question",
        "parameters": {"type": "object", "properties": {"question": {"type": "string"}}, "required": ["question"]},
    }
]


async def main(url):
    thread = f"thread-{uuid.uuid4()}"
    question = {"id": f"user-{uuid.uuid4()}", "role": "user", "content": "Where should I deploy?"}
    first = {
        "threadId": thread,
        "runId": str(uuid.uuid4()),
        "state": {},
        "messages": [question],
        "tools": TOOLS,
        "context": [],
        "forwardedProps": {},
    }
    events, s1 = await run(url, first, "frontend tool called")
    starts = [e for e in events if e["type"] == "TOOL_CALL_START" and e["toolCallName"] == "ask_user"]
    if not starts or events[-1].get("type") != "RUN_FINISHED":
        print(f"the first run did not call ask_user and finish: {[e['type'] for e in events]}")
        return 1
    snapshots = [e for e in events if e["type"] == "MESSAGES_SNAPSHOT"]
    answer = {
        "id": f"tool-{uuid.uuid4()}",
        "role": "tool",
        "toolCallId": starts[0]["toolCallId"],
        "content": json.dumps({"answer": "eu-west"}),
    }
    second = dict(first, runId=str(uuid.uuid4()), messages=snapshots[-1]["messages"] + [answer])
    events, s2 = await run(url, second, "frontend tool answered")
    kinds = [e["type"] for e in events]
    if "TOOL_CALL_RESULT" not in kinds or events[-1].get("outcome", {}).get("type") != "success":
        print(f"the answered run did not report the result and succeed: {kinds}")
        return 1
    bad = s1.errors + s1.warnings + s2.errors + s2.warnings
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main(sys.argv[1])))
