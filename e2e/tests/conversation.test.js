// The three-turn OpsPilot conversation, streamed, approved, with its steps, facts and graph.
import { after, before, test } from 'node:test';
import assert from 'node:assert/strict';
import {
  launch, open, resetFleet, restartCount, newConversation, say, turn, waitTurn, turnText, storedText, runIdOf,
  watchPaints, noPageErrors, screenshot,
} from './helpers.js';

let browser;
before(async () => { browser = await launch(); });
after(async () => { await browser?.close(); });

test('the three-turn OpsPilot conversation streams, asks, and restarts once approved', { timeout: 90000 }, async () => {
  await resetFleet();
  const page = await open(browser.context);
  await newConversation(page);

  // Turn 1: the answer streams in over many paints, with a typing indicator and the composer locked.
  const paints = await watchPaints(page);
  await say(page, 'Look at the recent errors of payment-api');
  await page.waitForSelector('.turn.assistant .typing:not([hidden])');
  assert.ok(await page.locator('#input').isDisabled(), 'the composer is disabled while the run is active');
  assert.ok(await page.locator('#stop').isVisible(), 'a Stop button while the run is active');
  await waitTurn(page, 0, 'completed');
  const lengths = await paints();
  const final = (await turnText(page, 0)).length;
  assert.ok(lengths.filter((n) => n < final).length >= 5, `text grew over several paints, saw lengths ${lengths}`);
  assert.match(await turnText(page, 0), /12 5xx errors/);
  const step1 = turn(page, 0).locator('.step');
  assert.equal(await step1.count(), 1);
  assert.equal(await step1.getAttribute('data-status'), 'success');
  assert.equal(await step1.locator('.step-tool').textContent(), 'get_recent_errors');
  assert.equal(await turn(page, 0).locator('.typing').isVisible(), false, 'no typing indicator once done');
  await page.waitForSelector('#facts .fact[data-key="service"]');
  assert.equal(await page.locator('#facts .fact[data-key="service"] dd').textContent(), 'payment-api');
  assert.equal(await page.locator('#facts .fact[data-key="env"] dd').textContent(), 'prod');
  assert.equal(await turnText(page, 0), await storedText(page, await runIdOf(page, 0)), 'shown text = stored text');

  // Turn 2: "its" is resolved from the confirmed facts.
  await say(page, 'Continue investigating its recent error logs');
  await waitTurn(page, 1, 'completed');
  assert.match(await turnText(page, 1), /pay-prod-2/);
  assert.equal(await turn(page, 1).locator('.step-tool').textContent(), 'find_abnormal_instances');
  await page.waitForSelector('#facts .fact[data-key="instance"]');
  assert.equal(await page.locator('#facts .fact[data-key="instance"] dd').textContent(), 'pay-prod-2');

  // Turn 3: a confirmation card, not an error.
  await say(page, 'Restart this abnormal instance');
  await waitTurn(page, 2, 'paused');
  const card = turn(page, 2).locator('.card[data-state="pending"]');
  await card.waitFor();
  assert.equal(await card.locator('h3').textContent(), 'Restart pay-prod-2?');
  assert.match(await card.locator('.risk').first().textContent(), /drops the requests/);
  assert.equal(await card.locator('.action-head code').textContent(), 'restart_instance');
  assert.equal(await card.locator('.target').textContent(), 'pay-prod-2');
  assert.equal(await card.locator('.args dd').textContent(), 'pay-prod-2');
  assert.match(await card.locator('.countdown').textContent(), /^expires in (14:[0-5]\d|15:00)$/);
  assert.equal(await page.locator('.notice.error').count(), 0, 'no error shown');
  assert.ok(await page.locator('#input').isDisabled(), 'the composer waits for the decision');
  assert.equal(await turn(page, 2).locator('.typing').isVisible(), false, 'no typing indicator while paused');
  assert.equal(await page.locator('#graph .node.paused').getAttribute('data-node'), 'approval', 'the graph shows where it paused');
  assert.equal(await restartCount('pay-prod-2'), 0, 'nothing restarted before the approval');
  await screenshot(page, 'screenshot-confirm.png');

  // Approve: the step bar shows the restart, the answer completes, the fleet counts one restart.
  await card.locator('button', { hasText: 'Approve' }).click();
  await waitTurn(page, 2, 'completed');
  const restart = turn(page, 2).locator('.step[data-status="success"]');
  assert.equal(await restart.locator('.step-tool').textContent(), 'restart_instance');
  assert.match(await restart.locator('.step-summary').textContent(), /restarted pay-prod-2/);
  assert.match(await turnText(page, 2), /Restarted pay-prod-2\. It is healthy now \(restart count 1\)\./);
  assert.match(await turn(page, 2).locator('.card').textContent(), /Approved by demo/);
  assert.equal(await restartCount('pay-prod-2'), 1);
  assert.equal(await turnText(page, 2), await storedText(page, await runIdOf(page, 2)), 'shown text = stored text');

  // The graph: every node visited, the path through approval highlighted, nothing left running.
  const nodes = await page.$$eval('#graph .node', (ns) => Object.fromEntries(ns.map((n) => [n.dataset.node, n.getAttribute('class')])));
  assert.deepEqual(Object.keys(nodes).sort(), ['approval', 'context', 'finalize', 'model', 'tools']);
  for (const [id, cls] of Object.entries(nodes)) assert.match(cls, /visited/, `${id} visited`);
  assert.ok(await page.locator('#graph .edge.taken').count() >= 5, 'the path taken is drawn');
  assert.match(await page.locator('#graph .node[data-node="approval"] .latency').textContent(), /\d+(\.\d)? (ms|s)/);
  assert.ok(!(await page.locator('#input').isDisabled()), 'the composer is back');
  await page.mouse.move(0, 0);
  await screenshot(page, 'screenshot-done.png');
  await noPageErrors(page);
});
