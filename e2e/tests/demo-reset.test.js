// The demo's "Reset the demo" control: after an approved restart the fleet has no abnormal instance
// left, and the control (shown only by a server that routes POST /v1/demo/reset) brings it back.
import { after, before, test } from 'node:test';
import assert from 'node:assert/strict';
import { api, launch, open, resetFleet, restartCount, newConversation, say, turn, waitTurn, noPageErrors } from './helpers.js';
import { startKeel } from './servers.js';

let browser;
before(async () => { browser = await launch(); });
after(async () => { await browser?.close(); });

const status = async (id) => (await api('GET', '/v1/demo/instances')).body.find((i) => i.id === id)?.status;

test('after an approved restart, Reset the demo brings the abnormal instance back', { timeout: 60000 }, async () => {
  await resetFleet();
  const page = await open(browser.context);
  await newConversation(page);
  await say(page, 'Restart the abnormal instance of payment-api');
  await waitTurn(page, 0, 'paused');
  await turn(page, 0).locator('.card[data-state="pending"] button', { hasText: 'Approve' }).click();
  await waitTurn(page, 0, 'completed');
  assert.equal(await restartCount('pay-prod-2'), 1);
  assert.equal(await status('pay-prod-2'), 'healthy', 'nothing abnormal is left to restart');

  const reset = page.locator('#reset-demo');
  await reset.waitFor({ state: 'visible' });
  assert.equal((await reset.textContent()).trim(), 'Reset the demo');
  await reset.click();
  await page.locator('#reset-status', { hasText: 'back as it was seeded' }).waitFor();
  assert.equal(await restartCount('pay-prod-2'), 0, 'the seeded fleet is back');
  assert.equal(await status('pay-prod-2'), 'abnormal');
  assert.equal(await page.locator('.turn.assistant').count(), 1, 'the conversation stays');
  await noPageErrors(page);
  await page.close();
});

test('keel serve (no demo) shows no reset control', { timeout: 60000 }, async () => {
  const server = await startKeel(['serve']);
  try {
    const page = await open(browser.context, '/', server.base);
    await page.locator('.welcome').waitFor();
    // The control appears once the served spec has been read; give that read time to finish.
    await page.waitForLoadState('networkidle');
    assert.equal(await page.locator('#reset-demo').isVisible(), false);
    await noPageErrors(page);
    await page.close();
  } finally {
    await server.stop();
  }
});
