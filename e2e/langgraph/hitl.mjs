// The human-in-the-loop flow with the real @langchain/langgraph-sdk Client (npm, pinned in
// package.json / package-lock.json) against a live `keel demo` under /langgraph: stream until the
// OpsPilot restart interrupt, read it from the thread's state, resume it with a command, stream to
// the end; the same resume again restarts nothing twice. Usage: KEEL_URL=http://127.0.0.1:PORT node hitl.mjs
import assert from "node:assert/strict";
import { Client } from "@langchain/langgraph-sdk";

const base = process.env.KEEL_URL;
assert.ok(base, "KEEL_URL is required");
const client = new Client({ apiUrl: `${base}/langgraph`, apiKey: null });

async function restartCount(id) {
  const instances = await (await fetch(`${base}/v1/demo/instances`)).json();
  return instances.find((i) => i.id === id).restartCount;
}

async function collect(stream) {
  const parts = [];
  for await (const part of stream) parts.push(part);
  assert.equal(parts[0].event, "metadata", "the metadata part comes first");
  assert.equal(parts.at(-1).event, "end", "the end part comes last");
  return parts;
}

await fetch(`${base}/v1/demo/reset`, { method: "POST" });
const [assistant] = await client.assistants.search();
assert.equal(assistant.graph_id, "opspilot");
const thread = await client.threads.create({ metadata: { client: "js" } });

const first = await collect(
  client.runs.stream(thread.thread_id, assistant.assistant_id, {
    input: { messages: [{ role: "user", content: "Restart the abnormal instance of payment-api" }] },
    streamMode: ["updates", "messages-tuple"],
  }),
);
assert.ok(first.some((p) => p.event === "messages" && p.data[0].type === "AIMessageChunk"), "token chunks");
const interrupted = first.find((p) => p.event === "updates" && p.data.__interrupt__);
assert.ok(interrupted, "the run pauses with __interrupt__");
const [interrupt] = interrupted.data.__interrupt__;
assert.equal(interrupt.value.action_requests[0].name, "restart_instance");
assert.deepEqual(interrupt.value.review_configs[0].allowed_decisions.includes("approve"), true);

const state = await client.threads.getState(thread.thread_id);
assert.deepEqual(state.next, ["approval"]);
assert.equal(state.interrupts[0].id, interrupt.id);

const command = { resume: { [interrupt.id]: { decisions: [{ type: "approve" }] } } };
const resumed = await collect(
  client.runs.stream(thread.thread_id, assistant.assistant_id, { command, streamMode: "updates" }),
);
const toolMessages = resumed
  .filter((p) => p.event === "updates")
  .flatMap((p) => Object.values(p.data).flatMap((node) => node?.messages ?? []))
  .filter((m) => m.type === "tool");
assert.ok(toolMessages.length > 0, "the approved restart ran");
assert.equal(await restartCount("pay-prod-2"), 1);

await collect(client.runs.stream(thread.thread_id, assistant.assistant_id, { command, streamMode: "updates" }));
assert.equal(await restartCount("pay-prod-2"), 1, "the same resume again restarts nothing");
const after = await client.threads.get(thread.thread_id);
assert.equal(after.status, "idle");
const runs = await client.runs.list(thread.thread_id);
assert.equal(runs.length, 1);
assert.equal(runs[0].status, "success");
console.log("@langchain/langgraph-sdk HITL flow: ok");
