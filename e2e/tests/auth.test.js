// A server with API keys: the page asks for a key once, keeps it in the tab, sends it as a Bearer
// header on every request and stream, and asks again when the key is refused.
import { after, before, test } from 'node:test';
import assert from 'node:assert/strict';
import { execFileSync, spawn } from 'node:child_process';
import { mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { launch, open, newConversation, say, waitTurn, turnText, noPageErrors } from './helpers.js';

let browser;
before(async () => { browser = await launch(); });
after(async () => { await browser?.close(); });

test('with API keys the page asks for one and streams with it', { timeout: 60000, skip: !process.env.KEEL_BIN && 'KEEL_BIN not set' }, async () => {
  const data = mkdtempSync(join(tmpdir(), 'keel-e2e-auth-'));
  const key = execFileSync(process.env.KEEL_BIN, ['users', 'add', 'alice', '--role', 'operator', '--data-dir', data],
    { encoding: 'utf8', stdio: ['ignore', 'pipe', 'ignore'] }).trim();
  assert.match(key, /^keel_[0-9a-f]{64}$/);
  const server = spawn(process.env.KEEL_BIN, ['serve', '--listen', '127.0.0.1:0', '--data-dir', data, '--demo-delay-ms', '5'],
    { stdio: ['ignore', 'pipe', 'inherit'] });
  try {
    const base = await new Promise((resolve, reject) => {
      let out = '';
      const timer = setTimeout(() => reject(new Error(`no address printed: ${out}`)), 20000);
      server.stdout.on('data', (chunk) => {
        out += chunk;
        const m = out.match(/listening on (http:\/\/\S+?)\/?\s/);
        if (m) { clearTimeout(timer); resolve(m[1]); }
      });
      server.on('exit', (code) => reject(new Error(`keel exited with ${code}: ${out}`)));
    });
    const noKey = await fetch(`${base}/v1/conversations`);
    assert.equal(noKey.status, 401);

    // First a wrong key, then the right one: the page asks again after a refusal.
    const { context } = browser;
    const answers = ['keel_wrong', key];
    const prompts = [];
    context.on('page', (p) => p.on('dialog', (d) => { prompts.push(d.message()); d.accept(answers.shift() ?? ''); }));
    const sent = [];
    context.on('request', (r) => { if (r.url().includes('/v1/')) sent.push({ url: r.url(), auth: r.headers().authorization }); });
    const page = await open(context, '/', base);
    await newConversation(page);
    await say(page, 'Look at the recent errors of payment-api');
    await waitTurn(page, 0, 'completed');
    assert.match(await turnText(page, 0), /payment-api/);
    assert.equal(prompts.length, 2, `asked for a key twice: ${prompts.join(' | ')}`);
    assert.match(prompts[0], /API key/);
    assert.equal(await page.evaluate(() => sessionStorage.getItem('keel.apiKey')), key, 'kept in this tab only');
    assert.equal(await page.evaluate(() => localStorage.length), 0, 'nothing in localStorage');
    assert.ok(sent.some((r) => r.url.includes('/events') && r.auth === `Bearer ${key}`), 'the stream carries the key');
    assert.ok(sent.every((r) => !r.url.includes(key)), 'the key is never in a URL');
    await noPageErrors(page);
    await page.close();
  } finally {
    server.kill('SIGTERM');
    await new Promise((r) => (server.exitCode !== null ? r() : server.on('exit', r)));
    rmSync(data, { recursive: true, force: true });
  }
});
