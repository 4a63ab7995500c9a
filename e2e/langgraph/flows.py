"""The real langgraph-sdk (PyPI, pinned in run.sh) against a live `keel demo` under /langgraph.

Each step asserts what the SDK got back; any exception or failed assertion fails CI.
Usage: python flows.py http://127.0.0.1:PORT
"""

import asyncio
import json
import sys
import urllib.request

from langgraph_sdk import get_client
from langgraph_sdk.errors import ConflictError, NotFoundError, UnprocessableEntityError
from langgraph_sdk.schema import Command

RESTART = "Restart the abnormal instance of payment-api"


def step(label):
    print(f"-- {label}", flush=True)


def http(base, method, path, body=None):
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(base + path, data=data, method=method, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req) as r:
        raw = r.read()
        return json.loads(raw) if raw else None


def restart_count(base, instance):
    return next(i for i in http(base, "GET", "/v1/demo/instances") if i["id"] == instance)["restartCount"]


async def collect(parts):
    out = []
    async for p in parts:
        out.append(p)
    return out


def check_envelope(parts):
    events = [p.event for p in parts]
    assert events[0] == "metadata", events[:3]
    assert events[-1] == "end", events[-3:]
    assert "run_id" in parts[0].data


async def main(base):
    client = get_client(url=base + "/langgraph")
    http(base, "POST", "/v1/demo/reset")

    step("assistants: search, get, graph, schemas")
    assistants = await client.assistants.search()
    assert [a["assistant_id"] for a in assistants] == ["opspilot"], assistants
    aid = assistants[0]["assistant_id"]
    assert (await client.assistants.get(aid))["graph_id"] == aid
    graph = await client.assistants.get_graph(aid)
    assert {n["id"] for n in graph["nodes"]} >= {"model", "tools", "approval"}, graph
    schemas = await client.assistants.get_schemas(aid)
    assert schemas["graph_id"] == aid and "messages" in schemas["input_schema"]["properties"]

    step("threads: create, get, search")
    thread = await client.threads.create(metadata={"team": "ops-e2e"})
    tid = thread["thread_id"]
    assert thread["status"] == "idle" and thread["metadata"]["team"] == "ops-e2e"
    assert (await client.threads.get(tid))["thread_id"] == tid
    found = await client.threads.search(metadata={"team": "ops-e2e"})
    assert [t["thread_id"] for t in found] == [tid], found

    step("stream a run in updates + messages-tuple until the restart interrupt")
    parts = await collect(
        client.runs.stream(
            tid, aid, input={"messages": [{"role": "user", "content": RESTART}]}, stream_mode=["updates", "messages-tuple"]
        )
    )
    check_envelope(parts)
    run_id = parts[0].data["run_id"]
    assert any(p.event == "messages" and p.data[0]["type"] == "AIMessageChunk" for p in parts), "no token chunks"
    interrupts = [p.data["__interrupt__"] for p in parts if p.event == "updates" and "__interrupt__" in p.data]
    assert len(interrupts) == 1, [p.event for p in parts]
    interrupt = interrupts[0][0]
    value = interrupt["value"]
    assert value["action_requests"][0]["name"] == "restart_instance", value
    assert value["action_requests"][0]["args"] == {"instanceId": "pay-prod-2"}, value
    assert "approve" in value["review_configs"][0]["allowed_decisions"], value
    assert interrupt["id"].startswith("int_")

    step("the thread's state names the interrupt")
    state = await client.threads.get_state(tid)
    assert state["next"] == ["approval"], state["next"]
    assert [i["id"] for i in state["interrupts"]] == [interrupt["id"]], state["interrupts"]
    assert state["tasks"][0]["interrupts"][0]["id"] == interrupt["id"]
    assert (await client.threads.get(tid))["status"] == "interrupted"

    step("resume with Command(resume=...) and stream to the end")
    resume = Command(resume={"decisions": [{"type": "approve"}]})
    first = await collect(client.runs.stream(tid, aid, command=resume, stream_mode="updates"))
    check_envelope(first)
    assert first[0].data["run_id"] == run_id
    tool_results = [
        m for p in first if p.event == "updates" for node in p.data.values() if isinstance(node, dict)
        for m in node.get("messages", []) if m["type"] == "tool"
    ]
    assert tool_results, [p.data for p in first]
    assert restart_count(base, "pay-prod-2") == 1

    step("the same resume again restarts nothing twice")
    again = await collect(client.runs.stream(tid, aid, command=resume, stream_mode="updates"))
    check_envelope(again)
    assert [p.data for p in again[1:]] == [p.data for p in first[1:]], "a retried resume streams the same run"
    assert restart_count(base, "pay-prod-2") == 1
    state = await client.threads.get_state(tid)
    assert state["next"] == [] and state["interrupts"] == []
    assert (await client.runs.get(tid, run_id))["status"] == "success"

    step("the thread's history: one state per run, newest first, with before, limit and checkpoint")
    second = await client.runs.wait(tid, aid, input={"messages": [{"role": "user", "content": "list the services"}]})
    assert "__error__" not in second, second
    history = await client.threads.get_history(tid)
    assert len(history) == 2, history
    for s in history:
        assert set(s) >= {"values", "next", "tasks", "checkpoint", "metadata", "created_at", "parent_checkpoint",
                          "interrupts"}, s
        assert s["checkpoint"]["thread_id"] == tid and s["checkpoint"]["checkpoint_ns"] == "", s["checkpoint"]
        assert s["metadata"]["source"] == "loop", s["metadata"]
    newest, oldest = history
    assert oldest["metadata"]["run_id"] == run_id, oldest["metadata"]
    assert newest["parent_checkpoint"] == oldest["checkpoint"] and oldest["parent_checkpoint"] is None
    humans = lambda s: [m["content"] for m in s["values"]["messages"] if m["type"] == "human"]
    assert humans(oldest) == [RESTART] and humans(newest) == [RESTART, "list the services"], history
    assert newest["checkpoint"] == (await client.threads.get_state(tid))["checkpoint"]
    assert await client.threads.get_history(tid, limit=1) == [newest]
    assert await client.threads.get_history(tid, before=newest["checkpoint"]) == [oldest]
    assert await client.threads.get_history(tid, checkpoint=oldest["checkpoint"]) == [oldest]
    assert await client.threads.get_state(tid, checkpoint=oldest["checkpoint"]) == oldest
    assert await client.threads.get_state(tid, checkpoint_id=oldest["checkpoint"]["checkpoint_id"]) == oldest
    try:
        await client.threads.get_history(tid, limit=0)
        raise AssertionError("limit=0 was accepted")
    except UnprocessableEntityError as e:
        assert "limit" in e.response.json()["error"]["message"], e

    step("join a running run after a cut with Last-Event-ID: no gap, no duplicate")
    http(base, "POST", "/v1/demo/reset")
    busy = await client.threads.create()
    btid = busy["thread_id"]
    run = await client.runs.create(btid, aid, input={"messages": [{"role": "user", "content": RESTART}]})
    assert run["status"] in ("pending", "running"), run
    head, last_id = [], None
    async for p in client.runs.join_stream(btid, run["run_id"], stream_mode=["updates", "messages-tuple"]):
        head.append(p)
        if p.id is not None:
            last_id = p.id
        if len(head) >= 6 and p.id is not None:
            break  # the cut
    assert last_id is not None, [p.event for p in head]
    tail = await collect(
        client.runs.join_stream(btid, run["run_id"], stream_mode=["updates", "messages-tuple"], last_event_id=last_id)
    )
    whole = await collect(
        client.runs.join_stream(btid, run["run_id"], stream_mode=["updates", "messages-tuple"], last_event_id="0")
    )
    strip = lambda ps: [(p.event, p.data) for p in ps if p.event != "metadata"]
    assert strip(head) + strip(tail) == strip(whole), "the joined stream has a gap or a duplicate"
    assert whole[-1].event == "end"

    step("multitask reject on a busy thread (a run waiting for approval): 409")
    ask = {"messages": [{"role": "user", "content": "list the services"}]}
    try:
        await client.runs.create(btid, aid, input=ask, multitask_strategy="reject")
        raise AssertionError("reject: a second run started")
    except ConflictError as e:
        assert e.response.json()["error"]["code"] == "RUN_ACTIVE"
    try:
        await client.runs.create(btid, aid, input=ask, multitask_strategy="eventually")
        raise AssertionError("an unknown strategy was accepted")
    except UnprocessableEntityError as e:
        assert "multitask_strategy" in e.response.json()["error"]["message"]

    step("multitask enqueue: the run waits its turn, then runs once the first is resolved")
    queued = await client.runs.create(btid, aid, input=ask, multitask_strategy="enqueue")
    assert queued["status"] == "pending" and queued["multitask_strategy"] == "enqueue", queued
    assert queued["run_id"] != run["run_id"]
    assert (await client.runs.get(btid, queued["run_id"]))["status"] == "pending"
    assert (await client.threads.get(btid))["status"] == "interrupted", "the first run still waits for a human"
    state = await client.threads.get_state(btid)
    assert [m["content"] for m in state["values"]["messages"] if m["type"] == "human"] == [RESTART], state["values"]
    first_done = await client.runs.wait(btid, aid, command=Command(resume={"decisions": [{"type": "approve"}]}))
    assert "__interrupt__" not in first_done, first_done
    assert restart_count(base, "pay-prod-2") == 1
    values = await client.runs.join(btid, queued["run_id"])
    assert values["messages"][-1]["type"] == "ai", values["messages"][-1]
    assert [m["content"] for m in values["messages"] if m["type"] == "human"] == [RESTART, "list the services"]
    assert (await client.runs.get(btid, queued["run_id"]))["status"] == "success"
    assert (await client.runs.get(btid, run["run_id"]))["status"] == "success"

    step("multitask rollback: the run it replaces is gone from the thread")
    http(base, "POST", "/v1/demo/reset")
    doomed = await client.runs.create(btid, aid, input={"messages": [{"role": "user", "content": RESTART}]})
    paused = await client.runs.join(btid, doomed["run_id"])
    assert paused["__interrupt__"], paused
    doomed_ids = {m["id"] for m in paused["messages"]} - {m["id"] for m in values["messages"]}
    assert doomed_ids, "the replaced run wrote messages"
    look = {"messages": [{"role": "user", "content": "Look at the recent errors of payment-api"}]}
    replacing = await client.runs.create(btid, aid, input=look, multitask_strategy="rollback")
    after = await client.runs.join(btid, replacing["run_id"])
    assert after["messages"][-1]["type"] == "ai", after["messages"][-1]
    humans = [m["content"] for m in after["messages"] if m["type"] == "human"]
    assert humans == [RESTART, "list the services", look["messages"][0]["content"]], humans
    assert not doomed_ids & {m["id"] for m in after["messages"]}, "the rolled-back run's messages are still there"
    try:
        await client.runs.get(btid, doomed["run_id"])
        raise AssertionError("a rolled-back run is still there")
    except NotFoundError:
        pass
    assert restart_count(base, "pay-prod-2") == 0, "the rolled-back run's restart never ran"

    step("multitask interrupt: the run it replaces stops, what it did stays")
    doomed = await client.runs.create(btid, aid, input={"messages": [{"role": "user", "content": RESTART}]})
    assert (await client.runs.join(btid, doomed["run_id"]))["__interrupt__"]
    second = await client.runs.create(btid, aid, input=ask, multitask_strategy="interrupt")
    assert second["run_id"] != doomed["run_id"]
    old = await client.runs.get(btid, doomed["run_id"])
    assert old["status"] == "interrupted" and old.get("cancel_reason"), old
    assert restart_count(base, "pay-prod-2") == 0, "the interrupted run's restart never ran"
    values = await client.runs.join(btid, second["run_id"])
    assert values["messages"][-1]["type"] == "ai", values["messages"][-1]
    runs = await client.runs.list(btid)
    expected = {run["run_id"], queued["run_id"], replacing["run_id"], doomed["run_id"], second["run_id"]}
    assert {r["run_id"] for r in runs} == expected, runs

    step("runs.wait answers with the thread's values")
    waited_thread = await client.threads.create()
    values = await client.runs.wait(
        waited_thread["thread_id"], aid, input={"messages": [{"role": "user", "content": RESTART}]}
    )
    assert values["__interrupt__"][0]["value"]["action_requests"][0]["name"] == "restart_instance", values

    step("cancel the waiting run")
    wrun = (await client.runs.list(waited_thread["thread_id"]))[0]
    await client.runs.cancel(waited_thread["thread_id"], wrun["run_id"], wait=True)
    cancelled = await client.runs.get(waited_thread["thread_id"], wrun["run_id"])
    assert cancelled["status"] == "interrupted" and cancelled["cancel_reason"], cancelled
    assert (await client.threads.get(waited_thread["thread_id"]))["status"] == "idle"

    step("runs.delete: a run not over is 409; one over is gone from this API, its messages stay")
    deleted_thread = await client.threads.create()
    dtid = deleted_thread["thread_id"]
    values = await client.runs.wait(dtid, aid, input={"messages": [{"role": "user", "content": RESTART}]})
    assert values["__interrupt__"], values
    drun = (await client.runs.list(dtid))[0]
    try:
        await client.runs.delete(dtid, drun["run_id"])
        raise AssertionError("a run waiting for approval was deleted")
    except ConflictError as e:
        assert e.response.json()["error"]["code"] == "RUN_ACTIVE", e.response.text
    await client.runs.cancel(dtid, drun["run_id"], wait=True)
    before = await client.threads.get_state(dtid)
    await client.runs.delete(dtid, drun["run_id"])
    try:
        await client.runs.get(dtid, drun["run_id"])
        raise AssertionError("a deleted run is still there")
    except NotFoundError:
        pass
    assert (await client.runs.list(dtid)) == []
    after = await client.threads.get_state(dtid)
    # as in LangGraph: the run's record goes, the thread's state (its checkpoint too) stays
    assert after == before and after["values"]["messages"], (before, after)
    try:
        await client.runs.delete(dtid, drun["run_id"])
        raise AssertionError("a run deleted twice")
    except NotFoundError:
        pass
    kept = http(base, "GET", f"/v1/runs/{drun['run_id']}")
    assert kept["status"] == "cancelled", kept

    step("cancel with action=rollback: the run and its messages are gone")
    rolled_thread = await client.threads.create()
    rtid = rolled_thread["thread_id"]
    values = await client.runs.wait(rtid, aid, input={"messages": [{"role": "user", "content": RESTART}]})
    assert values["__interrupt__"], values
    rrun = (await client.runs.list(rtid))[0]
    await client.runs.cancel(rtid, rrun["run_id"], action="rollback")
    try:
        await client.runs.get(rtid, rrun["run_id"])
        raise AssertionError("a rolled-back run is still there")
    except NotFoundError:
        pass
    assert (await client.runs.list(rtid)) == []
    state = await client.threads.get_state(rtid)
    assert state["values"]["messages"] == [] and state["next"] == [], state
    assert (await client.threads.get(rtid))["status"] == "idle"

    step("an unsupported option is a 422 that names it")
    try:
        await client.runs.create(btid, aid, input=ask, webhook="https://example.com/hook")
        raise AssertionError("webhook accepted")
    except UnprocessableEntityError as e:
        assert "webhook" in e.response.json()["error"]["message"]

    step("threads: delete")
    await client.threads.delete(waited_thread["thread_id"])
    try:
        await client.threads.get(waited_thread["thread_id"])
        raise AssertionError("a deleted thread is still there")
    except Exception as e:  # NotFoundError
        assert getattr(e, "response", None) is not None and e.response.status_code == 404

    print("langgraph-sdk flows: ok")


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
