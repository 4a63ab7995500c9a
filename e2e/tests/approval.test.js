// Confirmation cards: idempotent approval, rejection, a refresh while the card is shown, a decision
// taken in another tab, and an interrupt that expires.
import { after, before, test } from 'node:test';
import assert from 'node:assert/strict';
import { spawn } from 'node:child_process';
import { mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import {
  api, launch, open, resetFleet, restartCount, newConversation, say, turn, waitTurn, turnText, storedText, runIdOf,
  noPageErrors,
} from './helpers.js';

const RESTART = 'Restart the abnormal instance of payment-api';
let browser;
before(async () => { browser = await launch(); });
after(async () => { await browser?.close(); });

async function askForRestart(page) {
  await newConversation(page);
  await say(page, RESTART);
  await waitTurn(page, 0, 'paused');
  const card = turn(page, 0).locator('.card[data-state="pending"]');
  await card.waitFor();
  return card;
}

test('a double-clicked Approve restarts once; the same decision sent again changes nothing', { timeout: 60000 }, async () => {
  await resetFleet();
  const page = await open(browser.context);
  const resumes = [];
  page.on('request', (r) => { if (r.url().endsWith('/resume')) resumes.push({ url: r.url(), body: r.postData() }); });
  const card = await askForRestart(page);
  await card.locator('button', { hasText: 'Approve' }).dblclick();
  await waitTurn(page, 0, 'completed');
  assert.equal(await restartCount('pay-prod-2'), 1);
  assert.equal(await turn(page, 0).locator('.step-tool', { hasText: 'restart_instance' }).count(), 1, 'one restart step');

  // The page gave its decision one idempotency key: replaying that request is answered, not re-run.
  assert.ok(resumes.length >= 1);
  const body = JSON.parse(resumes[0].body);
  assert.equal(body.decision, 'approve');
  assert.match(body.idempotencyKey, /^resume_int_/);
  const path = new URL(resumes[0].url).pathname;
  const again = await api('POST', path, body);
  assert.equal(again.status, 200, `the same key and body are answered again: ${JSON.stringify(again.body)}`);
  assert.equal(await restartCount('pay-prod-2'), 1, 'still one restart');
  await noPageErrors(page);
  await page.close();
});

test('Reject: the step is denied, nothing restarts, the answer says so', { timeout: 60000 }, async () => {
  await resetFleet();
  const page = await open(browser.context);
  const card = await askForRestart(page);
  await card.locator('button', { hasText: 'Reject' }).click();
  await waitTurn(page, 0, 'completed');
  const denied = turn(page, 0).locator('.step[data-status="denied"]');
  assert.equal(await denied.locator('.step-tool').textContent(), 'restart_instance');
  assert.match(await turnText(page, 0), /I did not restart pay-prod-2/);
  assert.match(await turn(page, 0).locator('.card').textContent(), /Rejected by demo/);
  assert.equal(await restartCount('pay-prod-2'), 0);
  assert.ok(!(await page.locator('#input').isDisabled()));
  await noPageErrors(page);
  await page.close();
});

test('a refresh while the card is shown brings back the whole story and a card that works', { timeout: 60000 }, async () => {
  await resetFleet();
  const page = await open(browser.context);
  const card = await askForRestart(page);
  const interruptId = await card.getAttribute('data-interrupt');
  const before = await turnText(page, 0);

  const seen = [];
  page.on('request', (r) => seen.push(`${r.method()} ${new URL(r.url()).pathname}`));
  await page.reload();
  const back = turn(page, 0).locator('.card[data-state="pending"]');
  await back.waitFor();
  assert.equal(await back.getAttribute('data-interrupt'), interruptId, 'the same interrupt');
  assert.equal(await page.locator('.card').count(), 1, 'one card');
  assert.equal(await turnText(page, 0), before, 'the same text, once');
  assert.equal(await page.locator('.turn.user').count(), 1);
  assert.equal(await turn(page, 0).locator('.step').count(), 1, 'the step before the pause, once');
  assert.equal(await page.locator('#facts .fact[data-key="service"] dd').textContent(), 'payment-api');
  assert.equal(await page.locator('#graph .node.paused').getAttribute('data-node'), 'approval');
  assert.ok(await page.locator('#input').isDisabled(), 'still waiting for the decision');
  const runId = await runIdOf(page, 0);
  assert.ok(seen.includes(`GET /v1/runs/${runId}`), 'the pending interrupt is read from the run');

  await back.locator('button', { hasText: 'Approve' }).click();
  await waitTurn(page, 0, 'completed');
  assert.match(await turnText(page, 0), /Restarted pay-prod-2/);
  assert.equal(await turnText(page, 0), await storedText(page, runId), 'shown text = stored text');
  assert.equal(await restartCount('pay-prod-2'), 1);
  await noPageErrors(page);
  await page.close();
});

test('a decision taken in another tab resolves the card here too', { timeout: 60000 }, async () => {
  await resetFleet();
  const first = await open(browser.context);
  await askForRestart(first);
  const second = await open(browser.context, `/${new URL(first.url()).hash}`);
  const other = turn(second, 0).locator('.card[data-state="pending"]');
  await other.waitFor();
  await other.locator('button', { hasText: 'Approve' }).click();
  await waitTurn(first, 0, 'completed');
  const card = turn(first, 0).locator('.card');
  assert.equal(await card.getAttribute('data-state'), 'resolved');
  assert.match(await card.textContent(), /Approved by demo/);
  assert.equal(await card.locator('button', { hasText: 'Approve' }).isVisible(), false, 'no buttons left to press');
  assert.equal(await restartCount('pay-prod-2'), 1);
  await noPageErrors(first);
  await noPageErrors(second);
  await first.close();
  await second.close();
});

// Needs its own server, with a short time to decide.
test('an expired confirmation says so and nothing runs', { timeout: 60000, skip: !process.env.KEEL_BIN && 'KEEL_BIN not set' }, async () => {
  const data = mkdtempSync(join(tmpdir(), 'keel-e2e-ttl-'));
  const server = spawn(process.env.KEEL_BIN, ['demo', '--listen', '127.0.0.1:0', '--data-dir', data, '--demo-delay-ms', '5',
    '--interrupt-ttl', '3s'], { stdio: ['ignore', 'pipe', 'inherit'] });
  try {
    const base = await new Promise((resolve, reject) => {
      let out = '';
      const timer = setTimeout(() => reject(new Error(`no address printed: ${out}`)), 20000);
      server.stdout.on('data', (chunk) => {
        out += chunk;
        const m = out.match(/running at (http:\/\/\S+?)\/?\s/);
        if (m) { clearTimeout(timer); resolve(m[1]); }
      });
      server.on('exit', (code) => reject(new Error(`keel exited with ${code}: ${out}`)));
    });
    const page = await open(browser.context, '/', base);
    const card = await askForRestart(page);
    assert.match(await card.locator('.countdown').textContent(), /^expires in 0:0[0-3]$/);
    await page.waitForSelector('.card[data-state="expired"]', { timeout: 15000 });
    await waitTurn(page, 0, 'cancelled', 15000);
    const expired = turn(page, 0).locator('.card');
    assert.match(await expired.locator('.card-message').textContent(), /expired; nothing was done/);
    assert.match(await turn(page, 0).textContent(), /The confirmation expired, so the run was cancelled/);
    assert.equal(await expired.locator('button', { hasText: 'Approve' }).isVisible(), false);
    assert.equal(await restartCount('pay-prod-2', base), 0);
    assert.ok(!(await page.locator('#input').isDisabled()), 'the composer is back');
    await noPageErrors(page);
    await page.close();
  } finally {
    server.kill('SIGTERM');
    await new Promise((r) => (server.exitCode !== null ? r() : server.on('exit', r)));
    rmSync(data, { recursive: true, force: true });
  }
});

