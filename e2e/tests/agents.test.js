// The server's agents: the welcome of a new conversation is the agent's, as GET /v1/agents tells it;
// with several agents a picker chooses one, and the conversation is made with its id.
import { after, before, test } from 'node:test';
import assert from 'node:assert/strict';
import { BASE, api, launch, open, say, turn, waitTurn, noPageErrors } from './helpers.js';
import { opsAgentToml, startKeel, startMockModel, startSilentService } from './servers.js';

let browser;
before(async () => { browser = await launch(); });
after(async () => { await browser?.close(); });

const texts = (locator) => locator.evaluateAll((els) => els.map((e) => e.textContent));

test('one agent: the welcome shows its name, description and suggestions from GET /v1/agents, and no picker', { timeout: 60000 }, async () => {
  const { status, body } = await api('GET', '/v1/agents');
  assert.equal(status, 200);
  assert.equal(body.agents.length, 1, 'keel demo runs one agent');
  const [agent] = body.agents;
  assert.equal(agent.name, 'OpsPilot');
  assert.ok(agent.suggestions.length >= 2, 'OpsPilot has suggestions');

  const page = await open(browser.context);
  await page.locator('.welcome .suggestions .chip').first().waitFor();
  assert.equal(await page.locator('.welcome h2').textContent(), agent.name);
  assert.equal(await page.locator('.welcome .welcome-description').textContent(), agent.description);
  assert.deepEqual(await texts(page.locator('.welcome .chip')), agent.suggestions);
  assert.equal(await page.locator('.agent-picker').count(), 0, 'no picker for one agent');
  assert.equal(await page.locator('#conv-agent .agent-tag-name').textContent(), agent.name, 'the header names the agent');
  assert.match(await page.getAttribute('#input', 'placeholder'), new RegExp(`^Ask ${agent.name}…`));
  assert.equal(await page.title(), `Keel · ${agent.name}`);
  await page.locator('.welcome .chip').nth(1).click();
  assert.equal(await page.inputValue('#input'), agent.suggestions[1], 'a suggestion fills the composer');

  // None of it is in the page's own files: it all came from the API.
  for (const path of ['/', '/assets/app.js']) {
    const file = await (await fetch(BASE + path)).text();
    for (const text of [agent.name, agent.description, ...agent.suggestions]) {
      assert.ok(!file.includes(text), `${path} does not contain ${JSON.stringify(text)}`);
    }
  }

  // And what the API says is what the page shows: the same server, told other words.
  const other = await browser.context.newPage();
  other.errors = [];
  other.on('pageerror', (e) => other.errors.push(e.message));
  await other.route('**/v1/agents', async (route) => {
    const real = await (await route.fetch()).json();
    real.agents[0] = { ...real.agents[0], name: 'Night <b>shift</b>', description: 'Says what the API says.', suggestions: ['Check the queue'] };
    await route.fulfill({ json: real });
  });
  await other.goto(BASE + '/');
  await other.locator('.welcome .chip').waitFor();
  assert.equal(await other.locator('.welcome h2').textContent(), 'Night <b>shift</b>', 'as text, never as HTML');
  assert.equal(await other.locator('.welcome h2 b').count(), 0);
  assert.equal(await other.locator('.welcome .welcome-description').textContent(), 'Says what the API says.');
  assert.deepEqual(await texts(other.locator('.welcome .chip')), ['Check the queue']);
  await noPageErrors(other);
  await other.close();
  await noPageErrors(page);
  await page.close();
});

// A second server, `keel demo` with one more agent from a keel.toml: OpsPilot (the default) and
// Ops, whose model is a mock that calls its tool.
const skip = !process.env.KEEL_BIN && 'KEEL_BIN not set';
let two;
let model;
let service;
before(async () => {
  if (skip) return;
  model = await startMockModel();
  service = await startSilentService();
  two = await startKeel(['demo', '--demo-delay-ms', '5'], {
    toml: opsAgentToml({ description: 'Restarts services over HTTP; no fleet of its own.', modelUrl: model.url, serviceUrl: service.url }),
  });
});
after(async () => {
  await two?.stop();
  await model?.close();
  await service?.close();
});

test('several agents: a labelled picker chooses one, and the conversation is made with its agentId', { timeout: 60000, skip }, async () => {
  const { body } = await api('GET', '/v1/agents', undefined, two.base);
  const byId = Object.fromEntries(body.agents.map((a) => [a.id, a]));
  assert.deepEqual(Object.keys(byId).sort(), ['ops', 'opspilot']);
  assert.equal(byId.opspilot.default, true);

  const page = await open(browser.context, '/', two.base);
  const created = [];
  page.on('request', (r) => { if (r.method() === 'POST' && new URL(r.url()).pathname === '/v1/conversations') created.push(r.postDataJSON()); });
  const picker = page.getByRole('group', { name: 'Agent' });
  await picker.waitFor();
  const radios = picker.getByRole('radio');
  assert.equal(await radios.count(), 2);
  for (const agent of body.agents) {
    const option = picker.locator(`.agent-option[data-agent="${agent.id}"]`);
    assert.equal(await option.locator('.agent-name').textContent(), agent.name);
    assert.equal(await option.locator('.agent-description').textContent(), agent.description, 'listed with its description');
    const radio = picker.getByRole('radio', { name: agent.name, exact: true });
    assert.equal(await radio.getAttribute('aria-describedby'), `agent-desc-${agent.id}`);
  }
  // The default is picked first, and the welcome is its.
  assert.ok(await picker.getByRole('radio', { name: 'OpsPilot', exact: true }).isChecked());
  assert.equal(await page.locator('.welcome h2').textContent(), 'OpsPilot');
  assert.deepEqual(await texts(page.locator('.welcome .chip')), byId.opspilot.suggestions);

  // The keyboard moves the choice (arrow keys within the group); the welcome follows.
  await picker.getByRole('radio', { name: 'OpsPilot', exact: true }).focus();
  await page.keyboard.press('ArrowUp');
  assert.ok(await picker.getByRole('radio', { name: 'Ops', exact: true }).isChecked());
  assert.equal(await page.locator('.welcome h2').textContent(), 'Ops');
  assert.equal(await page.locator('.welcome .welcome-description').textContent(), byId.ops.description);
  assert.equal(await page.locator('.welcome .suggestions').isVisible(), false, 'Ops has no suggestions');
  assert.equal(await page.locator('#conv-agent .agent-tag-name').textContent(), 'Ops');
  assert.match(await page.getAttribute('#input', 'placeholder'), /^Ask Ops…/);

  await say(page, 'Restart checkout');
  await page.waitForFunction(() => location.hash.length > 1);
  const convId = decodeURIComponent(new URL(page.url()).hash.slice(1));
  assert.deepEqual(created.map((b) => b.agentId), ['ops'], 'created with the picked agent');
  const conv = await api('GET', `/v1/conversations/${convId}`, undefined, two.base);
  assert.equal(conv.body.agentId, 'ops', 'the API says the conversation is Ops\'s');
  assert.equal(await page.locator('#conv-agent .agent-tag-name').textContent(), 'Ops', 'the open conversation names its agent');
  await page.locator(`.conv-list a[href="#${convId}"] .conv-agent`).waitFor();
  assert.equal(await page.locator(`.conv-list a[href="#${convId}"] .conv-agent`).textContent(), 'Ops', 'the list names the agent');

  // Ops's run asks about its call (see outcome.test.js); stop it, then reopen the conversation.
  await turn(page, 0).locator('.card[data-kind="outcome_unknown"]').waitFor();
  await page.click('#stop');
  await waitTurn(page, 0, 'cancelled');
  await page.reload();
  await page.locator('.turn.assistant').first().waitFor();
  assert.equal(await page.locator('#conv-agent .agent-tag-name').textContent(), 'Ops', 'after a reload too');
  assert.equal(await page.title(), 'Keel · Ops');

  // A new conversation from this one starts with the same agent; the default is one click away.
  await page.click('#new-conv');
  await picker.waitFor();
  assert.ok(await picker.getByRole('radio', { name: 'Ops', exact: true }).isChecked());
  await picker.getByText('OpsPilot', { exact: true }).click();
  assert.equal(await page.locator('.welcome h2').textContent(), 'OpsPilot');
  await say(page, 'List the services');
  await waitTurn(page, 0, 'completed');
  assert.deepEqual(created.map((b) => b.agentId), ['ops', 'opspilot']);
  const list = await api('GET', '/v1/conversations', undefined, two.base);
  assert.deepEqual(list.body.conversations.map((c) => c.agentId), ['opspilot', 'ops'], 'newest first, each with its agent');
  await noPageErrors(page);
  await page.close();
});
