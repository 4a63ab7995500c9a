// Phone width, the keyboard alone, and readable contrast.
import { after, before, test } from 'node:test';
import assert from 'node:assert/strict';
import { BASE, contrasts, launch, open, resetFleet, restartCount, turn, waitTurn, turnText, noPageErrors } from './helpers.js';

let browser;
before(async () => { browser = await launch({ viewport: { width: 390, height: 844 }, hasTouch: true }); });
after(async () => { await browser?.close(); });

const overflows = (page) => page.evaluate(() => document.documentElement.scrollWidth > window.innerWidth);
const inView = (page, sel) => page.locator(sel).evaluate((el) => {
  const r = el.getBoundingClientRect();
  return r.width > 0 && r.left >= 0 && r.right <= window.innerWidth + 0.5;
});

test('at phone width the drawers open and close and nothing overflows sideways', { timeout: 60000 }, async () => {
  const page = await open(browser.context);
  assert.equal(await overflows(page), false);
  assert.equal(await page.locator('#sidebar').isVisible(), false, 'the conversations are in a drawer');
  await page.click('#toggle-sidebar');
  await page.waitForFunction(() => document.getElementById('sidebar').getBoundingClientRect().left >= 0);
  assert.ok(await page.locator('#new-conv').isVisible());
  await page.keyboard.press('Escape');
  await page.waitForFunction(() => document.getElementById('sidebar').getBoundingClientRect().right <= 0);
  await page.click('#toggle-inspector');
  await page.waitForFunction(() => document.getElementById('inspector').getBoundingClientRect().right <= window.innerWidth + 0.5);
  assert.ok(await page.locator('#facts').isVisible());
  await page.click('#scrim', { position: { x: 10, y: 400 } });
  await page.waitForSelector('#scrim', { state: 'hidden' });
  assert.ok(await inView(page, '#send'), 'Send is on screen');
  await noPageErrors(page);
  await page.close();
});

test('the keyboard alone sends, reaches the card and approves (at phone width)', { timeout: 60000 }, async () => {
  await resetFleet();
  const page = await open(browser.context);
  await page.keyboard.press('Tab'); // from the document to the first control …
  await page.focus('#input'); // … the composer is reachable; put the caret there
  await page.keyboard.type('Restart the abnormal instance of payment-api');
  await page.keyboard.press('Enter');
  await waitTurn(page, 0, 'paused');
  await page.locator('.card[data-state="pending"]').waitFor();
  assert.equal(await overflows(page), false, 'the card fits');
  assert.ok(await inView(page, '.card'), 'the card is within the screen width');
  // Tab through the page until Approve has the focus.
  let focused = '';
  for (let i = 0; i < 40 && focused !== 'Approve'; i++) {
    await page.keyboard.press('Tab');
    focused = await page.evaluate(() => document.activeElement?.textContent?.trim());
  }
  assert.equal(focused, 'Approve', 'Approve is reachable with Tab');
  const ring = await page.evaluate(() => getComputedStyle(document.activeElement).outlineStyle);
  assert.notEqual(ring, 'none', 'the focused button shows a focus ring');
  await page.keyboard.press('Enter');
  await waitTurn(page, 0, 'completed');
  assert.match(await turnText(page, 0), /Restarted pay-prod-2/);
  assert.equal(await restartCount('pay-prod-2'), 1);

  // Shift+Enter is a new line, Enter sends.
  await page.focus('#input');
  await page.keyboard.type('List the');
  await page.keyboard.press('Shift+Enter');
  assert.equal(await page.inputValue('#input'), 'List the\n', 'Shift+Enter adds a line');
  await page.keyboard.type('services');
  await page.keyboard.press('Enter');
  await waitTurn(page, 1, 'completed');
  assert.match(await turnText(page, 1), /payment-api in prod/);
  assert.equal(await turn(page, 1).locator('.step-tool').textContent(), 'list_services');
  await noPageErrors(page);
  await page.close();
});

for (const scheme of ['light', 'dark']) test(`text is readable: WCAG AA contrast for the page's kinds of text (${scheme})`, { timeout: 60000 }, async () => {
  await resetFleet();
  const page = await browser.context.newPage();
  page.errors = [];
  page.on('pageerror', (e) => page.errors.push(e.message));
  await page.emulateMedia({ colorScheme: scheme });
  await page.goto(BASE + '/');
  await page.locator('.suggestions .chip').first().waitFor();
  const sample = (selectors) => contrasts(page, selectors);
  const check = (results, least) => {
    assert.ok(results.length >= least, `sampled ${results.length} kinds of text`);
    for (const { sel, ratio } of results) assert.ok(ratio >= 4.5, `${sel}: contrast ${ratio.toFixed(2)} < 4.5`);
  };
  check(await sample(['.brand', '.conv-list a', '.conv-list time', '#new-conv', '#conv-title', '.welcome h2', '.welcome p',
    '.chip', '#send', '.panel h2', '#graph-caption', '.legend li', '.facts .muted', '#conv-agent .agent-tag-name']), 11);

  // A conversation paused on a card: bubbles, steps, the card and the inspector.
  await page.fill('#input', 'Restart the abnormal instance of payment-api');
  await page.press('#input', 'Enter');
  await page.locator('.card[data-state="pending"]').waitFor();
  check(await sample(['.bubble.user', '.bubble.assistant', '.step-tool', '.step-args', '.step-summary', '.turn-meta',
    '.card .badge', '.card .countdown', '.card h3', '.card .risk', '.card .risk strong', '.action-head code', '.action .muted',
    '.args dt', '.args dd', '.card footer .btn.primary', '.card footer .btn:not(.primary)', '#stop', '.fact dt', '.fact dd',
    '#conn']), 18);
  // Leave no pending approval behind for the other tests.
  await page.click('#stop');
  await waitTurn(page, 0, 'cancelled');
  await noPageErrors(page);
  await page.close();
});
