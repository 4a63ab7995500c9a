// Dropped connections: the page says "reconnecting…", reconnects with Last-Event-ID and catches up
// with nothing missing and nothing twice. Also: Stop cancels a streaming run.
import { after, before, test } from 'node:test';
import assert from 'node:assert/strict';
import {
  launch, open, resetFleet, restartCount, newConversation, say, turn, waitTurn, turnText, storedText, runIdOf,
  noPageErrors,
} from './helpers.js';

let browser;
before(async () => { browser = await launch(); });
after(async () => { await browser?.close(); });

/** The Last-Event-ID of every events request the page makes. */
function recordStreams(page) {
  const cursors = [];
  page.on('request', (r) => {
    if (/\/v1\/runs\/[^/]+\/events$/.test(new URL(r.url()).pathname) && r.headers().accept === 'text/event-stream') {
      cursors.push(Number(r.headers()['last-event-id']));
    }
  });
  return cursors;
}

const count = (text, part) => text.split(part).length - 1;

test('a connection cut mid-answer reconnects and the text has no duplicated fragment', { timeout: 60000 }, async () => {
  const page = await open(browser.context);
  const cursors = recordStreams(page);
  await newConversation(page);
  await say(page, 'Look at the recent errors of payment-api');
  // Cut while the answer after the tool call is streaming.
  await page.waitForFunction(() => {
    const bubbles = document.querySelector('.turn.assistant')?.querySelectorAll('.bubble.assistant') || [];
    return bubbles.length === 2 && bubbles[1].textContent.length > 20;
  });
  const shownAtCut = (await turnText(page, 0)).length;
  assert.ok(await page.evaluate(() => window.keel.dropStream(700)), 'a stream to cut');
  await page.waitForSelector('#conn.reconnecting');
  assert.equal(await page.locator('#conn').textContent(), 'reconnecting…');
  await waitTurn(page, 0, 'completed');

  const text = await turnText(page, 0);
  assert.ok(text.length > shownAtCut, 'the rest of the answer arrived after the reconnect');
  assert.equal(text, await storedText(page, await runIdOf(page, 0)), 'shown text = stored text: nothing lost, nothing twice');
  assert.equal(count(text, 'had 12 5xx errors'), 1);
  assert.equal(count(text, 'Let me look at the recent errors'), 1);
  assert.equal(await turn(page, 0).locator('.step').count(), 1, 'the step once');
  assert.ok(cursors.length >= 2, `reconnected (cursors ${cursors})`);
  assert.equal(cursors[0], 0, 'the first stream starts from the beginning');
  assert.ok(cursors.at(-1) > 0, `the reconnect sends Last-Event-ID (cursors ${cursors})`);
  await page.waitForFunction(() => !document.querySelector('#conn.reconnecting'));
  await noPageErrors(page);
  await page.close();
});

test('a reconnect that replays events already shown draws nothing twice', { timeout: 60000 }, async () => {
  const page = await open(browser.context);
  const cursors = recordStreams(page);
  await newConversation(page);
  await say(page, 'Look at the recent errors of payment-api');
  await page.waitForFunction(() => {
    const bubbles = document.querySelector('.turn.assistant')?.querySelectorAll('.bubble.assistant') || [];
    return bubbles.length === 2 && bubbles[1].textContent.length > 20;
  });
  // The next stream asks for everything from the start: the page must drop what it has seen.
  assert.ok(await page.evaluate(() => window.keel.dropStream(100, { from: 0 })));
  await waitTurn(page, 0, 'completed');
  assert.deepEqual(cursors.slice(0, 2), [0, 0], `the second stream replayed from the start (cursors ${cursors})`);
  const text = await turnText(page, 0);
  assert.equal(text, await storedText(page, await runIdOf(page, 0)));
  assert.equal(count(text, 'Let me look at the recent errors'), 1);
  assert.equal(await turn(page, 0).locator('.step').count(), 1);
  assert.equal(await turn(page, 0).locator('.bubble.assistant').count(), 2);
  await noPageErrors(page);
  await page.close();
});

test('a connection cut while waiting for approval comes back, and the approval continues the run', { timeout: 60000 }, async () => {
  await resetFleet();
  const page = await open(browser.context);
  const cursors = recordStreams(page);
  await newConversation(page);
  await say(page, 'Restart the abnormal instance of payment-api');
  const card = turn(page, 0).locator('.card[data-state="pending"]');
  await card.waitFor();
  await page.evaluate(() => window.keel.dropStream(300));
  await page.waitForSelector('#conn.reconnecting');
  await page.waitForSelector('#conn.live');
  assert.equal(await page.locator('.card').count(), 1, 'still one card');
  await card.locator('button', { hasText: 'Approve' }).click();
  await waitTurn(page, 0, 'completed');
  const text = await turnText(page, 0);
  assert.equal(text, await storedText(page, await runIdOf(page, 0)));
  assert.equal(count(text, "I'll restart pay-prod-2"), 1);
  assert.equal(await turn(page, 0).locator('.step').count(), 2, 'find, then restart: each once');
  assert.equal(await restartCount('pay-prod-2'), 1);
  assert.ok(cursors.at(-1) > 0, `reconnected with Last-Event-ID (cursors ${cursors})`);
  await noPageErrors(page);
  await page.close();
});

test('Stop cancels a streaming run and gives the composer back', { timeout: 60000 }, async () => {
  const page = await open(browser.context);
  await newConversation(page);
  await say(page, 'Look at the recent errors of payment-api');
  await page.waitForFunction(() => document.querySelector('.turn.assistant .bubble.assistant')?.textContent.length > 5);
  await page.click('#stop');
  await waitTurn(page, 0, 'cancelled');
  assert.match(await turn(page, 0).locator('.notice').textContent(), /Stopped/);
  assert.ok(!(await page.locator('#input').isDisabled()), 'the composer is back');
  assert.ok(await page.locator('#send').isVisible());
  assert.equal(await turnText(page, 0), await storedText(page, await runIdOf(page, 0)), 'shown text = stored text');
  await noPageErrors(page);
  await page.close();
});
