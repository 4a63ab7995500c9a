"""The AG-UI conformance validator (ag-ui-validate, PyPI) on Keel's live /v1/ag-ui endpoint, for the
human-in-the-loop flow: a run that ends with an interrupt, then the run that resumes it with the
client's whole history (as an AG-UI client sends it). Each run must have zero errors and zero
warnings. Usage: python validate_hitl.py http://127.0.0.1:PORT/v1/ag-ui
"""

import asyncio
import json
import sys
import uuid

from ag_ui_validate.report import format_diagnostic_line
from ag_ui_validate.transport import TransportOptions, validate_endpoint


async def run(url, payload, label):
    events = []
    options = TransportOptions(input=payload, timeout_ms=60_000)
    options.on_event = lambda raw, _diagnostics: events.append(json.loads(raw))
    result = await validate_endpoint(url, options)
    report = result.report
    for d in report.diagnostics:
        print(f"  {label}: {format_diagnostic_line(d, False)}")
    summary = report.summary
    print(f"{label}: {result.event_count} events, {summary.errors} errors, {summary.warnings} warnings, {summary.info} info")
    return events, summary


async def main(url):
    thread = f"thread-{uuid.uuid4()}"
    question = {"id": f"user-{uuid.uuid4()}", "role": "user", "content": "Restart the abnormal instance of payment-api"}
    first = {
        "threadId": thread,
        "runId": str(uuid.uuid4()),
        "state": {},
        "messages": [question],
        "tools": [],
        "context": [],
        "forwardedProps": {},
    }
    events, s1 = await run(url, first, "interrupt")
    finished = events[-1] if events else {}
    outcome = finished.get("outcome", {})
    if finished.get("type") != "RUN_FINISHED" or outcome.get("type") != "interrupt":
        print(f"the first run did not end with an interrupt: {finished}")
        return 1
    snapshots = [e for e in events if e["type"] == "MESSAGES_SNAPSHOT"]
    states = [e for e in events if e["type"] == "STATE_SNAPSHOT"]
    resume = {
        "threadId": thread,
        "runId": str(uuid.uuid4()),
        "state": states[-1]["snapshot"] if states else {},
        "messages": snapshots[-1]["messages"],
        "tools": [],
        "context": [],
        "forwardedProps": {},
        "resume": [
            {"interruptId": i["id"], "status": "resolved", "payload": {"approved": True}}
            for i in outcome["interrupts"]
        ],
    }
    events, s2 = await run(url, resume, "resume")
    kinds = [e["type"] for e in events]
    if "TOOL_CALL_RESULT" not in kinds or events[-1].get("outcome", {}).get("type") != "success":
        print(f"the resumed run did not report the result and succeed: {kinds}")
        return 1
    bad = s1.errors + s1.warnings + s2.errors + s2.warnings
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main(sys.argv[1])))
