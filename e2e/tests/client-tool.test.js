// A client-side tool in the page: `keel serve` with an agent whose `ask_user` is a client tool
// (kind = "client") with a result schema, and a scripted OpenAI-compatible model that calls it. The
// page shows the waiting call as a card with a form built from the schema; a missing required field
// is caught before anything is sent; "Send answer" (clicked twice) posts one tool result, and the run
// continues to the model's answer with the user's value.
import { after, before, test } from 'node:test';
import assert from 'node:assert/strict';
import { api, launch, open, newConversation, say, turn, waitTurn, turnText, runIdOf, noPageErrors } from './helpers.js';
import { startKeel, startScriptedModel } from './servers.js';

const skip = !process.env.KEEL_BIN && 'KEEL_BIN not set';

const agentToml = (modelUrl) => `
[[agents]]
id = "front"
name = "Front desk"
system_prompt = "Ask the user when you must."
[agents.model]
kind = "openai"
base_url = ${JSON.stringify(modelUrl)}
name = "scripted"
max_retries = 0
[[agents.tools]]
kind = "client"
name = "ask_user"
description = "Ask the user a question and get their answer"
args_schema = { type = "object", properties = { question = { type = "string" } }, required = ["question"] }
result_schema = { type = "object", properties = { answer = { type = "string", description = "Your answer" }, urgent = { type = "boolean" } }, required = ["answer"], additionalProperties = false }
`;

function reply(last) {
  if (last?.role === 'tool') return { text: `You said ${last.content}.` };
  return { text: 'Let me ask. ', call: { name: 'ask_user', args: { question: 'Which region?' } } };
}

let browser;
let model;
let keel;
before(async () => {
  browser = await launch();
  if (skip) return;
  model = await startScriptedModel(reply);
  keel = await startKeel(['serve'], { toml: agentToml(model.url) });
});
after(async () => {
  await browser?.close();
  await keel?.stop();
  await model?.close();
});

test('a client tool\'s call is a card with a form; one answer continues the run', { timeout: 60000, skip }, async () => {
  const page = await open(browser.context, '/', keel.base);
  const posts = [];
  page.on('request', (r) => {
    if (r.method() === 'POST' && r.url().endsWith('/tool-results')) posts.push(r.postDataJSON());
  });
  await newConversation(page);
  await say(page, 'Where should I deploy?');
  await waitTurn(page, 0, 'paused');
  const card = turn(page, 0).locator('.card[data-kind="tool_call"][data-state="pending"]');
  await card.waitFor();
  assert.equal(await card.locator('h3').textContent(), 'Waiting for ask_user');
  assert.match(await card.locator('.badge').textContent(), /Your answer is needed/);
  assert.deepEqual(await card.locator('.args dd').allTextContents(), ['Which region?']);
  const runId = await runIdOf(page, 0);
  const { body: waiting } = await api('GET', `/v1/runs/${runId}`, undefined, keel.base);
  assert.equal(waiting.pendingInterrupt.kind, 'tool_call');
  assert.equal(await card.locator('.action').getAttribute('data-call'), waiting.pendingInterrupt.payload.callId);

  // The required field, empty: said on the card, nothing sent.
  const send = card.getByRole('button', { name: 'Send answer', exact: true });
  await send.click();
  assert.equal(await card.locator('.card-message').textContent(), 'answer is required.');
  assert.equal(posts.length, 0);

  await card.locator('input[name="answer"]').fill('eu-west');
  await send.click();
  await send.click({ force: true }).catch(() => {});
  await waitTurn(page, 0, 'completed');
  assert.equal(posts.length, 1, `one answer posted: ${JSON.stringify(posts)}`);
  assert.deepEqual(posts[0].result, { answer: 'eu-west', urgent: false });
  assert.equal(await turnText(page, 0), 'Let me ask. You said {"answer":"eu-west","urgent":false}.');
  const done = page.locator(`.card[data-interrupt="${waiting.pendingInterrupt.id}"]`);
  assert.equal(await done.getAttribute('data-state'), 'resolved');
  assert.match(await done.locator('.card-message').textContent(), /^Answered by demo after /);

  const { body: run } = await api('GET', `/v1/runs/${runId}`, undefined, keel.base);
  assert.equal(run.status, 'completed');
  assert.deepEqual(run.toolCalls.map((c) => [c.name, c.state]), [['ask_user', 'succeeded']]);
  await noPageErrors(page);
  await page.close();
});
