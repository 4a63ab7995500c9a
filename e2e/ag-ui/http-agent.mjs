// The real @ag-ui/client HttpAgent against Keel's /v1/ag-ui: the OpsPilot restart flow. The first
// runAgent ends with the interrupt outcome, the second answers it with `resume` and completes, and
// the fleet shows exactly one restart — also after the same resume is sent once more.
// Usage: KEEL_URL=http://127.0.0.1:PORT node http-agent.mjs
import assert from "node:assert/strict";
import { randomUUID } from "node:crypto";
import { HttpAgent } from "@ag-ui/client";

// The client warns when it strips a field it does not know or drops an event: none may occur.
const warnings = [];
for (const level of ["warn", "error"]) {
  const original = console[level];
  console[level] = (...args) => { warnings.push(args.map(String).join(" ")); original(...args); };
}

const base = process.env.KEEL_URL;
assert.ok(base, "KEEL_URL is required");

// The validator's flow restarted pay-prod-2 already: start from the seeded fleet.
assert.equal((await fetch(`${base}/v1/demo/reset`, { method: "POST" })).status, 200);
const fleet = async () => (await (await fetch(`${base}/v1/demo/instances`)).json());
const before = (await fleet()).find((i) => i.id === "pay-prod-2");
assert.equal(before.status, "abnormal", "pay-prod-2 starts abnormal");

const agent = new HttpAgent({ url: `${base}/v1/ag-ui/opspilot`, threadId: `thread-${randomUUID()}` });
agent.addMessage({ id: randomUUID(), role: "user", content: "Restart the abnormal instance of payment-api" });

const outcomes = [];
const results = [];
const subscriber = {
  onRunFinishedEvent: ({ outcome, interrupts }) => { outcomes.push({ outcome, interrupts }); },
  onToolCallResultEvent: ({ event }) => { results.push(event.toolCallId); },
};

await agent.runAgent({}, subscriber);
assert.equal(outcomes.length, 1);
assert.equal(outcomes[0].outcome, "interrupt", "the first run pauses for approval");
const [interrupt] = agent.pendingInterrupts;
assert.ok(interrupt, "the agent holds the pending interrupt");
assert.equal(interrupt.reason, "tool_call");
assert.ok(interrupt.toolCallId, "the interrupt names the call it waits for");
assert.ok(new Date(interrupt.expiresAt) > new Date(), "expiresAt is in the future");
assert.equal(agent.state.facts.service, "payment-api", "STATE_SNAPSHOT carries the facts");
const call = agent.messages.flatMap((m) => m.toolCalls ?? []).find((c) => c.id === interrupt.toolCallId);
assert.equal(call.function.name, "restart_instance");
assert.deepEqual(JSON.parse(call.function.arguments), { instanceId: "pay-prod-2" });
assert.equal((await fleet()).find((i) => i.id === "pay-prod-2").restartCount, 0, "nothing ran before the approval");

const resume = [{ interruptId: interrupt.id, status: "resolved", payload: { approved: true } }];
await agent.runAgent({ resume }, subscriber);
assert.equal(outcomes.length, 2);
assert.equal(outcomes[1].outcome, "success", "the resumed run completes");
assert.deepEqual(agent.pendingInterrupts, []);
assert.ok(results.includes(interrupt.toolCallId), "TOOL_CALL_RESULT for the original toolCallId");
const answer = agent.messages.filter((m) => m.role === "assistant" && typeof m.content === "string").at(-1);
assert.match(answer.content, /Restarted pay-prod-2/);

// The same resume again (a retry) is safe: Keel's idempotent resume answers it, nothing runs twice.
const again = await fetch(`${base}/v1/ag-ui`, {
  method: "POST",
  headers: { "Content-Type": "application/json", Accept: "text/event-stream" },
  body: JSON.stringify({ threadId: agent.threadId, runId: randomUUID(), messages: agent.messages, state: agent.state, tools: [], context: [], resume }),
});
assert.equal(again.status, 200);
assert.match(await again.text(), /"outcome":\{"type":"success"\}/);

const after = (await fleet()).find((i) => i.id === "pay-prod-2");
assert.equal(after.status, "healthy");
assert.equal(after.restartCount, 1, "the fleet shows one restart");
assert.deepEqual(warnings, [], "the client warned about nothing");
console.log(`@ag-ui/client HttpAgent: interrupt, resume, success; pay-prod-2 restarted once (${agent.messages.length} messages)`);
