// An agent defined only in keel.toml, as a user runs it: `keel serve --config keel.toml` (on
// loopback without keys, its one user `demo` is an operator). Its model is a scripted
// OpenAI-compatible mock; its one tool is an HTTP tool with `policy = "ask"` on the Rust tests' tool
// service (crates/keel/tests/support/tool_service.py), a separate process that applies a restart
// once per Idempotency-Key and records every request it gets. Through the page: the confirmation
// card says what the tool's templates say; Approve sends one request, with the call's key and the
// run's id; Reject sends none; a double click on Approve sends one.
import { after, before, test } from 'node:test';
import assert from 'node:assert/strict';
import { api, launch, open, newConversation, say, turn, waitTurn, turnText, runIdOf, noPageErrors } from './helpers.js';
import { startKeel, startScriptedModel, startToolService } from './servers.js';

const skip = !process.env.KEEL_BIN && 'KEEL_BIN not set';
const quote = (s) => JSON.stringify(s); // a TOML basic string is a JSON string

const agentToml = ({ modelUrl, serviceUrl }) => `
[[agents]]
id = "deploys"
name = "Deploy desk"
description = "Restarts instances through the ops service, once you approve."
system_prompt = "You restart instances. Call restart_instance with the instance and the reason."
[agents.model]
kind = "openai"
base_url = ${quote(modelUrl)}
name = "scripted"
max_retries = 0
[[agents.tools]]
kind = "http"
name = "restart_instance"
description = "Restart one instance."
method = "POST"
url = ${quote(`${serviceUrl}/restart/{instanceId}`)}
timeout = "5s"
idempotent = true
policy = "ask"
args_schema = { type = "object", properties = { instanceId = { type = "string" }, reason = { type = "string" } }, required = ["instanceId", "reason"], additionalProperties = false }
result_schema = { type = "object", required = ["restarted"], properties = { restarted = { type = "boolean" } } }
[agents.tools.confirm]
title = "Restart {instanceId}?"
risk = "{instanceId} drops the requests it is serving while it restarts."
description = "POST /restart/{instanceId} (reason: {reason})"
`;

/**
 * The model's script, by the last message: "Restart <id> because <reason>" asks for the tool; a
 * tool result is answered by what it says (a restart, or a denial and its reason).
 */
function reply(last) {
  if (last?.role === 'tool') {
    const result = JSON.parse(last.content);
    if (result.status === 'denied') return { text: `I did not restart it: ${result.reason}.` };
    return { text: `Restarted ${result.instanceId}; that is restart number ${result.restartCount}.` };
  }
  const asked = /^restart (\S+) because (.+)$/i.exec(String(last?.content ?? ''));
  if (asked) {
    const [, instanceId, reason] = asked;
    return { text: `Restarting ${instanceId}. `, call: { name: 'restart_instance', args: { instanceId, reason } } };
  }
  return { text: 'Tell me which instance to restart, and why.' };
}

let browser;
let service;
let model;
let keel;
before(async () => {
  browser = await launch();
  if (skip) return;
  service = await startToolService();
  model = await startScriptedModel(reply);
  keel = await startKeel(['serve'], { toml: agentToml({ modelUrl: model.url, serviceUrl: service.url }) });
});
after(async () => {
  await browser?.close();
  await keel?.stop();
  await model?.close();
  await service?.close();
});

const button = (card, name) => card.getByRole('button', { name, exact: true });

/** Every decision the page sends: its path and body. */
function recordResumes(page) {
  const resumes = [];
  page.on('request', (r) => {
    if (r.method() === 'POST' && r.url().endsWith('/resume')) resumes.push({ path: new URL(r.url()).pathname, body: r.postDataJSON() });
  });
  return resumes;
}

/** Sends `text` in a new conversation; resolves to the pending confirmation card and the run's id. */
async function ask(page, text) {
  await newConversation(page);
  await say(page, text);
  await waitTurn(page, 0, 'paused');
  const pending = turn(page, 0).locator('.card[data-kind="confirm_action"][data-state="pending"]');
  await pending.waitFor();
  const card = page.locator(`.card[data-interrupt="${await pending.getAttribute('data-interrupt')}"]`);
  return { card, runId: await runIdOf(page, 0) };
}

/** The requests the service got for `runId`. */
const requestsOf = async (runId) => (await service.requests()).filter((r) => r.keelRunId === runId);

test('the agent of keel.toml is the only one, and the page offers it', { timeout: 60000, skip }, async () => {
  const { status, body } = await api('GET', '/v1/agents', undefined, keel.base);
  assert.equal(status, 200);
  assert.deepEqual(body.agents.map((a) => a.id), ['deploys'], 'keel serve runs the agents of keel.toml, nothing else');
  const page = await open(browser.context, '/', keel.base);
  await page.locator('.welcome h2').waitFor();
  assert.equal(await page.locator('.welcome h2').textContent(), 'Deploy desk');
  assert.equal(await page.locator('.welcome .welcome-description').textContent(),
    'Restarts instances through the ops service, once you approve.');
  assert.equal(await page.locator('.agent-picker').count(), 0, 'one agent, no picker');
  assert.equal(await page.title(), 'Keel · Deploy desk');
  await noPageErrors(page);
  await page.close();
});

test('Approve: the card says what the templates say, one request reaches the service with the call\'s key and the run\'s id', { timeout: 60000, skip }, async () => {
  const page = await open(browser.context, '/', keel.base);
  const resumes = recordResumes(page);
  const { card, runId } = await ask(page, 'Restart pay-prod-2 because it stopped answering health checks');

  // The card: the tool's confirm templates, their placeholders filled from the model's arguments.
  assert.equal(await card.locator('h3').textContent(), 'Restart pay-prod-2?');
  assert.equal(await card.locator('.risk').textContent(), 'Risk: pay-prod-2 drops the requests it is serving while it restarts.');
  const action = card.locator('.action');
  assert.equal(await action.count(), 1);
  assert.equal(await action.locator('.action-head code').textContent(), 'restart_instance');
  assert.equal(await action.locator('.action-head .target').textContent(), 'pay-prod-2', 'what it acts on; the free-text reason is not a target');
  assert.equal(await action.locator('p.muted').textContent(), 'POST /restart/pay-prod-2 (reason: it stopped answering health checks)');
  assert.deepEqual(await action.locator('.args dt').allTextContents(), ['instanceId', 'reason']);
  assert.deepEqual(await action.locator('.args dd').allTextContents(), ['pay-prod-2', 'it stopped answering health checks']);
  assert.match(await card.locator('.badge').textContent(), /Your approval is needed/);
  const callId = await action.getAttribute('data-call');
  // Keel's own id (the idempotency key), not the model's `call_scripted_1`: unique across runs.
  assert.match(callId, /^call_[0-9a-f]{32}$/, 'Keel\'s call id');
  assert.match(await turnText(page, 0), /^Restarting pay-prod-2\. $/, 'the model\'s words before its call');
  assert.ok(await page.locator('#input').isDisabled(), 'waiting for the decision');

  // What the API says is what the card shows; nothing has reached the service yet.
  const { body: waiting } = await api('GET', `/v1/runs/${runId}`, undefined, keel.base);
  assert.equal(waiting.status, 'interrupted');
  assert.equal(waiting.pendingInterrupt.kind, 'confirm_action');
  assert.equal(waiting.pendingInterrupt.payload.title, 'Restart pay-prod-2?');
  assert.equal(await card.getAttribute('data-interrupt'), waiting.pendingInterrupt.id);
  assert.deepEqual(await service.requests(), [], 'an "ask" tool sends nothing before the approval');

  await button(card, 'Approve').click();
  await waitTurn(page, 0, 'completed');

  // Exactly one request, with the call's key and the run's id, and one restart.
  const sent = await service.requests();
  assert.equal(sent.length, 1, `one request: ${JSON.stringify(sent)}`);
  const [request] = sent;
  assert.equal(request.method, 'POST');
  assert.equal(request.path, '/restart/pay-prod-2');
  assert.deepEqual(request.body, { reason: 'it stopped answering health checks' }, 'the path argument is not in the body');
  assert.equal(request.idempotencyKey, callId, 'Idempotency-Key: the call\'s id');
  assert.equal(request.keelRunId, runId, 'Keel-Run-Id: the run');
  assert.equal(request.keelCallId, callId);
  assert.equal(request.keelAttempt, '1');
  assert.deepEqual(await service.effects(), { 'pay-prod-2': 1 });

  // The page: the decision on the card, the step with its result summary, the model's answer.
  assert.equal(resumes.length, 1);
  assert.equal(resumes[0].body.decision, 'approve');
  assert.equal(await card.getAttribute('data-state'), 'resolved');
  assert.match(await card.locator('.card-message').textContent(), /^Approved by demo after /);
  const step = turn(page, 0).locator(`.step[data-call="${callId}"]`);
  assert.equal(await step.getAttribute('data-status'), 'success');
  assert.equal(await step.locator('.step-tool').textContent(), 'restart_instance');
  assert.equal(await step.locator('.step-args').textContent(), 'instanceId=pay-prod-2, reason=it stopped answering health checks');
  assert.equal(await step.locator('.step-state').textContent(), 'done');
  assert.equal(await step.locator('.step-summary').textContent(), 'POST /restart/{instanceId} → 200');
  assert.equal(await turnText(page, 0), 'Restarting pay-prod-2. Restarted pay-prod-2; that is restart number 1.');
  assert.ok(!(await page.locator('#input').isDisabled()), 'the composer is back');

  // The model was offered the agent's tool, and told the service's answer.
  const told = model.requests.at(-1);
  assert.deepEqual(told.tools.map((t) => t.function.name), ['restart_instance']);
  assert.equal(told.messages[0].role, 'system');
  assert.match(told.messages[0].content, /You restart instances/);
  const result = told.messages.at(-1);
  assert.equal(result.role, 'tool');
  assert.equal(result.tool_call_id, callId);
  assert.deepEqual(JSON.parse(result.content), { instanceId: 'pay-prod-2', restarted: true, restartCount: 1 });

  // The public API: the interrupt resolved by the user, the call succeeded.
  const { body: run } = await api('GET', `/v1/runs/${runId}`, undefined, keel.base);
  assert.equal(run.status, 'completed');
  assert.equal(run.pendingInterrupt, null);
  assert.deepEqual(run.interrupts.map((i) => [i.kind, i.status, i.decision, i.resolvedBy]),
    [['confirm_action', 'resolved', 'approve', 'demo']]);
  assert.deepEqual(run.interrupts[0].callIds, [callId]);
  assert.deepEqual(run.toolCalls.map((c) => [c.id, c.name, c.state, c.summary]),
    [[callId, 'restart_instance', 'succeeded', 'POST /restart/{instanceId} → 200']]);

  // A reload tells the same story from the stored events.
  await page.reload();
  await waitTurn(page, 0, 'completed');
  assert.equal(await turnText(page, 0), 'Restarting pay-prod-2. Restarted pay-prod-2; that is restart number 1.');
  assert.equal(await turn(page, 0).locator(`.step[data-call="${callId}"] .step-summary`).textContent(), 'POST /restart/{instanceId} → 200');
  assert.match(await turn(page, 0).locator('.card .card-message').textContent(), /^Approved by demo after /);
  assert.equal((await service.requests()).length, 1, 'and sends nothing');
  await noPageErrors(page);
  await page.close();
});

test('Reject: nothing reaches the service; the page shows the rejection and the model\'s answer', { timeout: 60000, skip }, async () => {
  const page = await open(browser.context, '/', keel.base);
  const before = (await service.requests()).length;
  const { card, runId } = await ask(page, 'Restart pay-prod-3 because its latency doubled');
  assert.equal(await card.locator('h3').textContent(), 'Restart pay-prod-3?');
  const callId = await card.locator('.action').getAttribute('data-call');

  await button(card, 'Reject').click();
  await waitTurn(page, 0, 'completed');
  assert.equal((await service.requests()).length, before, 'no request');
  assert.deepEqual(await requestsOf(runId), []);
  assert.equal((await service.effects())['pay-prod-3'], undefined, 'no restart');

  assert.equal(await card.getAttribute('data-state'), 'resolved');
  assert.match(await card.locator('.card-message').textContent(), /^Rejected by demo after /);
  const step = turn(page, 0).locator(`.step[data-call="${callId}"]`);
  assert.equal(await step.getAttribute('data-status'), 'denied');
  assert.equal(await step.locator('.step-state').textContent(), 'denied');
  assert.equal(await step.locator('.step-summary').textContent(), 'rejected by demo; it did not run');
  assert.equal(await turnText(page, 0), 'Restarting pay-prod-3. I did not restart it: rejected by demo; it did not run.');
  const told = model.requests.at(-1).messages.at(-1);
  assert.equal(told.role, 'tool');
  assert.equal(JSON.parse(told.content).status, 'denied', 'the model was told');

  const { body: run } = await api('GET', `/v1/runs/${runId}`, undefined, keel.base);
  assert.equal(run.status, 'completed');
  assert.deepEqual(run.interrupts.map((i) => [i.kind, i.status, i.decision, i.resolvedBy]),
    [['confirm_action', 'resolved', 'reject', 'demo']]);
  assert.deepEqual(run.toolCalls.map((c) => [c.id, c.state]), [[callId, 'denied']]);
  await noPageErrors(page);
  await page.close();
});

test('a double click on Approve sends one decision and one request to the service', { timeout: 60000, skip }, async () => {
  const page = await open(browser.context, '/', keel.base);
  const resumes = recordResumes(page);
  const { card, runId } = await ask(page, 'Restart pay-prod-4 because it leaks memory');
  const callId = await card.locator('.action').getAttribute('data-call');

  await button(card, 'Approve').dblclick();
  await waitTurn(page, 0, 'completed');
  assert.equal(resumes.length, 1, `one decision for a double click: ${JSON.stringify(resumes)}`);
  const sent = await requestsOf(runId);
  assert.equal(sent.length, 1, `one request: ${JSON.stringify(sent)}`);
  assert.equal(sent[0].idempotencyKey, callId);
  assert.equal((await service.effects())['pay-prod-4'], 1, 'one restart');
  assert.equal(await turn(page, 0).locator('.step').count(), 1, 'one step');
  assert.match(await turnText(page, 0), /Restarted pay-prod-4; that is restart number 1\.$/);

  // The same decision sent again is answered with the first answer; nothing is sent again.
  const again = await api('POST', resumes[0].path, resumes[0].body, keel.base);
  assert.equal(again.status, 200, `the same key and body: ${JSON.stringify(again.body)}`);
  assert.equal((await requestsOf(runId)).length, 1);
  const { body: run } = await api('GET', `/v1/runs/${runId}`, undefined, keel.base);
  assert.deepEqual(run.interrupts.map((i) => [i.status, i.decision, i.resolvedBy]), [['resolved', 'approve', 'demo']]);
  assert.deepEqual(run.toolCalls.map((c) => [c.id, c.state]), [[callId, 'succeeded']]);
  await noPageErrors(page);
  await page.close();
});
