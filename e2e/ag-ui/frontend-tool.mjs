// A frontend tool with the real @ag-ui/client HttpAgent: `keel serve` with an agent whose
// `ask_user` is a client tool (kind = "client"), and a scripted OpenAI-compatible model that calls
// it. The client declares the tool; the first runAgent ends after TOOL_CALL_END (no result, outcome
// success); the client appends its result as a `tool` message and runs again; the run continues to
// the model's answer, once — the same input sent again asks the model nothing more. Then the
// validator (validate_frontend_tool.py, its path in AGUI_PYTHON) checks both runs of another thread.
// Usage: KEEL_BIN=… AGUI_PYTHON=…/bin/python node frontend-tool.mjs
import assert from "node:assert/strict";
import { spawn } from "node:child_process";
import { randomUUID } from "node:crypto";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";
import { HttpAgent } from "@ag-ui/client";
import { startKeel, startScriptedModel } from "../tests/servers.js";

const warnings = [];
for (const level of ["warn", "error"]) {
  const original = console[level];
  console[level] = (...args) => { warnings.push(args.map(String).join(" ")); original(...args); };
}

const model = await startScriptedModel((last) =>
  last?.role === "tool"
    ? { text: `The user answered ${last.content}` }
    : { text: "Let me ask. ", call: { name: "ask_user", args: { question: "Which region?" } } });
const toml = `
[[agents]]
id = "front"
name = "Front"
system_prompt = "Ask the user when you must."
[agents.model]
kind = "openai"
base_url = "${model.url}"
name = "mock"
max_retries = 0

[[agents.tools]]
kind = "client"
name = "ask_user"
description = "Ask the user a question"
args_schema = { type = "object", properties = { question = { type = "string" } }, required = ["question"] }
result_schema = { type = "object", properties = { answer = { type = "string" } }, required = ["answer"] }
`;
const keel = await startKeel(["serve"], { toml });
let status = 0;
try {
  const tools = [{ name: "ask_user", description: "Ask the user a question",
    parameters: { type: "object", properties: { question: { type: "string" } }, required: ["question"] } }];
  const agent = new HttpAgent({ url: `${keel.base}/v1/ag-ui/front`, threadId: `thread-${randomUUID()}` });
  agent.addMessage({ id: randomUUID(), role: "user", content: "Where should I deploy?" });
  const finished = [];
  const results = [];
  const subscriber = {
    onRunFinishedEvent: ({ outcome }) => { finished.push(outcome); },
    onToolCallResultEvent: ({ event }) => { results.push(event.toolCallId); },
  };

  await agent.runAgent({ tools }, subscriber);
  assert.equal(finished.length, 1);
  assert.notEqual(finished[0], "interrupt", "a frontend tool's call ends the run, as AG-UI has it");
  assert.deepEqual(agent.pendingInterrupts ?? [], []);
  const call = agent.messages.flatMap((m) => m.toolCalls ?? []).at(-1);
  assert.equal(call.function.name, "ask_user");
  assert.deepEqual(JSON.parse(call.function.arguments), { question: "Which region?" });
  assert.deepEqual(results, [], "no result before the client's");

  agent.addMessage({ id: randomUUID(), role: "tool", toolCallId: call.id, content: JSON.stringify({ answer: "eu-west" }) });
  const input = agent.messages.slice();
  await agent.runAgent({ tools }, subscriber);
  assert.equal(finished.length, 2);
  assert.equal(finished[1], "success");
  assert.ok(results.includes(call.id), "TOOL_CALL_RESULT for the frontend tool's call");
  const answer = agent.messages.filter((m) => m.role === "assistant" && typeof m.content === "string").at(-1);
  assert.match(answer.content, /The user answered \{"answer":"eu-west"\}/);
  const asked = model.requests.length;

  // The same input again (a retry): the first answer; the model is not asked again.
  const again = await fetch(`${keel.base}/v1/ag-ui/front`, {
    method: "POST",
    headers: { "Content-Type": "application/json", Accept: "text/event-stream" },
    body: JSON.stringify({ threadId: agent.threadId, runId: randomUUID(), messages: input, state: {}, tools, context: [] }),
  });
  assert.equal(again.status, 200);
  assert.match(await again.text(), /"outcome":\{"type":"success"\}/);
  assert.equal(model.requests.length, asked, "nothing continued twice");
  assert.deepEqual(warnings, [], "the client warned about nothing");
  console.log(`@ag-ui/client HttpAgent: frontend tool called, answered with a tool message, run completed once`);

  const python = process.env.AGUI_PYTHON;
  if (python) {
    const script = join(dirname(fileURLToPath(import.meta.url)), "validate_frontend_tool.py");
    // Not spawnSync: the scripted model answers from this process's event loop.
    const validator = spawn(python, [script, `${keel.base}/v1/ag-ui/front`], { stdio: "inherit" });
    const code = await new Promise((resolve) => validator.once("exit", resolve));
    if (code !== 0) status = 1;
  } else {
    console.log("AGUI_PYTHON not set: the validator's frontend-tool check was skipped");
  }
} catch (e) {
  console.error(e);
  console.error(keel.log());
  status = 1;
} finally {
  await keel.stop();
  await model.close();
}
process.exit(status);
