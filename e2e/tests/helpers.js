// Shared by the browser tests: a headless Debian chromium driven by playwright-core, against the
// `keel demo` server named by KEEL_URL (e2e/run.sh starts one).
import { mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import assert from 'node:assert/strict';
import { chromium } from 'playwright-core';

export const BASE = (process.env.KEEL_URL || 'http://127.0.0.1:8080').replace(/\/$/, '');
export const SCREENSHOTS = process.env.KEEL_SCREENSHOTS_DIR || '';
const ARGS = ['--headless', '--no-sandbox', '--disable-gpu', '--disable-quic', '--no-first-run',
  '--disable-background-networking', '--disable-component-update', '--disable-sync'];

/** A browser with a fresh profile; `close()` removes it. */
export async function launch(options = {}) {
  const profile = mkdtempSync(join(tmpdir(), 'keel-e2e-'));
  const context = await chromium.launchPersistentContext(profile, {
    executablePath: process.env.CHROMIUM || '/usr/bin/chromium', headless: true, args: ARGS,
    viewport: { width: 1280, height: 820 }, ...options,
  });
  return {
    context,
    async close() { await context.close(); rmSync(profile, { recursive: true, force: true }); },
  };
}

/** A page on `/` (or `path`) whose script errors fail the test. */
export async function open(context, path = '/', base = BASE) {
  const page = await context.newPage();
  page.errors = [];
  page.on('pageerror', (e) => page.errors.push(e.message));
  await page.goto(base + path);
  await page.waitForSelector('#input');
  return page;
}

export async function api(method, path, body, base = BASE) {
  const res = await fetch(base + path, {
    method, headers: { Accept: 'application/json', ...(body ? { 'Content-Type': 'application/json' } : {}) },
    body: body ? JSON.stringify(body) : undefined,
  });
  return { status: res.status, body: await res.json().catch(() => null) };
}

export async function resetFleet(base = BASE) {
  const { status } = await api('POST', '/v1/demo/reset', undefined, base);
  assert.equal(status, 200, 'POST /v1/demo/reset');
}

export async function restartCount(id, base = BASE) {
  const { body } = await api('GET', '/v1/demo/instances', undefined, base);
  const instance = body.find((i) => i.id === id);
  assert.ok(instance, `instance ${id} in the fleet`);
  return instance.restartCount;
}

/** Starts a new conversation in the page (the first message creates it). */
export async function newConversation(page) {
  await page.click('#new-conv');
  await page.waitForSelector('.welcome');
}

/** Types `text` and sends it with Enter. */
export async function say(page, text) {
  await page.fill('#input', text);
  await page.press('#input', 'Enter');
}

export const turn = (page, n) => page.locator('.turn.assistant').nth(n);

/** Waits until the n-th assistant turn (0-based) has run status `status`. */
export async function waitTurn(page, n, status, timeout = 30000) {
  await page.waitForFunction(([n, status]) => document.querySelectorAll('.turn.assistant')[n]?.dataset.status === status,
    [n, status], { timeout });
  return turn(page, n);
}

/** The text the page shows for the n-th assistant turn: all its bubbles, in order. */
export async function turnText(page, n) {
  return turn(page, n).evaluate((t) => [...t.querySelectorAll('.bubble.assistant')].map((b) => b.textContent).join(''));
}

/** The stored assistant text of a run, as GET /v1/conversations/{id} tells it. */
export async function storedText(page, runId) {
  const convId = await page.evaluate(() => decodeURIComponent(location.hash.slice(1)));
  const { body } = await api('GET', `/v1/conversations/${convId}`);
  return body.messages.filter((m) => m.role === 'assistant' && m.runId === runId).map((m) => m.content).join('');
}

export async function runIdOf(page, n) {
  return turn(page, n).getAttribute('data-run');
}

/**
 * Samples the length of the newest assistant turn's text once per animation frame, so a test can
 * tell that text appeared in several paints rather than at once. Call before sending.
 */
export async function watchPaints(page) {
  await page.evaluate(() => {
    window.__paints = [];
    const sample = () => {
      const turns = document.querySelectorAll('.turn.assistant');
      const last = turns[turns.length - 1];
      const length = last ? [...last.querySelectorAll('.bubble.assistant')].map((b) => b.textContent).join('').length : 0;
      if (window.__paints.at(-1) !== length) window.__paints.push(length);
      requestAnimationFrame(sample);
    };
    requestAnimationFrame(sample);
  });
  return () => page.evaluate(() => window.__paints.filter((n) => n > 0));
}

/** The WCAG contrast ratio of the text of the first element of each selector that has one, on its background. */
export async function contrasts(page, selectors) {
  return page.evaluate((selectors) => {
    const rgb = (c) => (c.match(/[\d.]+/g) || []).map(Number);
    const lum = ([r, g, b]) => {
      const f = (v) => { v /= 255; return v <= 0.03928 ? v / 12.92 : ((v + 0.055) / 1.055) ** 2.4; };
      return 0.2126 * f(r) + 0.7152 * f(g) + 0.0722 * f(b);
    };
    const background = (el) => {
      for (; el; el = el.parentElement) {
        const c = rgb(getComputedStyle(el).backgroundColor);
        if (c.length === 3 || c[3] > 0.5) return c.slice(0, 3);
      }
      return [255, 255, 255];
    };
    return selectors.map((sel) => [sel, document.querySelector(sel)]).filter(([, el]) => el).map(([sel, el]) => {
      const fg = rgb(getComputedStyle(el).color).slice(0, 3);
      const [a, b] = [lum(fg), lum(background(el))].sort((x, y) => y - x);
      return { sel, ratio: (a + 0.05) / (b + 0.05) };
    });
  }, selectors);
}

export async function noPageErrors(page) {
  assert.deepEqual(page.errors, [], 'no script errors in the page');
}

export async function screenshot(page, name) {
  const dir = SCREENSHOTS || tmpdir();
  await page.screenshot({ path: join(dir, name) });
}
