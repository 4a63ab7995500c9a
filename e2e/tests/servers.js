// Servers the browser tests start for themselves: another `keel` (with a keel.toml of their own),
// tiny OpenAI-compatible models (one that streams one tool call and then an answer, one scripted by
// the test), a service that takes requests and never answers them (so a call to it times out with
// its outcome unknown), and the Rust tests' tool service (crates/keel/tests/support/tool_service.py),
// which applies an effect once per Idempotency-Key and records every request.
import { spawn } from 'node:child_process';
import { mkdtempSync, rmSync, writeFileSync } from 'node:fs';
import http from 'node:http';
import { tmpdir } from 'node:os';
import { dirname, join } from 'node:path';
import { fileURLToPath } from 'node:url';

/** Listens on 127.0.0.1, any free port; resolves to the port. */
function listen(server) {
  return new Promise((resolve, reject) => {
    server.once('error', reject);
    server.listen(0, '127.0.0.1', () => resolve(server.address().port));
  });
}

/** Closes `server` and every connection it still has. */
function closeAll(server, sockets) {
  for (const s of sockets) s.destroy();
  server.closeAllConnections?.();
  return new Promise((resolve) => server.close(() => resolve()));
}

/**
 * `keel <args…> --listen 127.0.0.1:0 --data-dir <fresh dir>`, with `toml` (if given) as its
 * --config. Resolves once it printed the address it listens on; `stop()` ends it and removes its
 * directory.
 */
export async function startKeel(args, { toml, extra = [] } = {}) {
  if (!process.env.KEEL_BIN) throw new Error('KEEL_BIN not set');
  const dir = mkdtempSync(join(tmpdir(), 'keel-e2e-srv-'));
  const config = [];
  if (toml) {
    writeFileSync(join(dir, 'keel.toml'), toml);
    config.push('--config', join(dir, 'keel.toml'));
  }
  const server = spawn(process.env.KEEL_BIN, [...args, ...config, '--listen', '127.0.0.1:0', '--data-dir', join(dir, 'data'), ...extra],
    { stdio: ['ignore', 'pipe', 'pipe'] });
  let log = '';
  server.stderr.on('data', (chunk) => { log += chunk; });
  const stop = async () => {
    if (server.exitCode === null && server.signalCode === null) {
      const exited = new Promise((r) => server.once('exit', r));
      server.kill('SIGTERM');
      await exited;
    }
    rmSync(dir, { recursive: true, force: true });
  };
  try {
    const base = await new Promise((resolve, reject) => {
      let out = '';
      const timer = setTimeout(() => reject(new Error(`keel printed no address: ${out}${log}`)), 30000);
      server.stdout.on('data', (chunk) => {
        out += chunk;
        const m = out.match(/(?:running at|listening on) (http:\/\/\S+?)\/?\s/);
        if (m) { clearTimeout(timer); resolve(m[1]); }
      });
      server.once('exit', (code) => { clearTimeout(timer); reject(new Error(`keel exited with ${code}: ${out}${log}`)); });
    });
    return { base, stop, log: () => log };
  } catch (e) {
    await stop();
    throw e;
  }
}

let calls = 0;

/**
 * An OpenAI-compatible model (`POST /v1/chat/completions`, streamed), scripted by what it is sent:
 * with tools and no tool result yet, a few words and one call of the first tool (`args`); after a
 * tool result, an answer that quotes it; without tools, a plain answer. `requests` keeps every body.
 */
export async function startMockModel({ args = { service: 'checkout' } } = {}) {
  const requests = [];
  const sockets = new Set();
  const server = http.createServer((req, res) => {
    let body = '';
    req.on('data', (c) => { body += c; });
    req.on('end', () => {
      if (req.method !== 'POST' || !req.url.endsWith('/chat/completions')) {
        res.writeHead(404, { 'content-type': 'application/json' });
        res.end(JSON.stringify({ error: { message: 'not found', type: 'invalid_request_error' } }));
        return;
      }
      const request = JSON.parse(body);
      requests.push(request);
      const messages = request.messages || [];
      const last = messages.at(-1);
      const tool = request.tools?.[0]?.function?.name;
      const chunk = (delta, finish = null) => ({ id: 'chatcmpl-mock', object: 'chat.completion.chunk', created: 1, model: 'mock',
        choices: [{ index: 0, delta, finish_reason: finish }] });
      let chunks;
      if (last?.role === 'tool') {
        const said = String(last.content).slice(0, 160);
        chunks = [chunk({ role: 'assistant', content: '' }), chunk({ content: 'The tool answered: ' }), chunk({ content: said }),
          chunk({ content: '. Nothing else to do.' }), chunk({}, 'stop')];
      } else if (tool) {
        calls += 1;
        const id = `call_mock${calls}${Math.random().toString(36).slice(2, 10)}`;
        const json = JSON.stringify(args);
        chunks = [chunk({ role: 'assistant', content: '' }), chunk({ content: `Calling ${tool}. ` }),
          chunk({ tool_calls: [{ index: 0, id, type: 'function', function: { name: tool, arguments: '' } }] }),
          chunk({ tool_calls: [{ index: 0, function: { arguments: json.slice(0, 5) } }] }),
          chunk({ tool_calls: [{ index: 0, function: { arguments: json.slice(5) } }] }),
          chunk({}, 'tool_calls')];
      } else {
        chunks = [chunk({ role: 'assistant', content: '' }), chunk({ content: 'Hello from ' }), chunk({ content: 'the mock model.' }),
          chunk({}, 'stop')];
      }
      res.writeHead(200, { 'content-type': 'text/event-stream', 'cache-control': 'no-cache' });
      res.end(chunks.map((c) => `data: ${JSON.stringify(c)}\n\n`).join('') + 'data: [DONE]\n\n');
    });
  });
  server.on('connection', (s) => { sockets.add(s); s.on('close', () => sockets.delete(s)); });
  const port = await listen(server);
  return { url: `http://127.0.0.1:${port}/v1`, requests, close: () => closeAll(server, sockets) };
}

/** A service that reads each request and never answers it. `requests` counts the requests it got. */
export async function startSilentService() {
  const sockets = new Set();
  const seen = [];
  const server = http.createServer((req) => {
    seen.push({ method: req.method, url: req.url, key: req.headers['idempotency-key'], attempt: req.headers['keel-attempt'] });
    req.resume(); // read the body; answer nothing
  });
  server.on('connection', (s) => { sockets.add(s); s.on('close', () => sockets.delete(s)); });
  const port = await listen(server);
  return { url: `http://127.0.0.1:${port}`, requests: seen, close: () => closeAll(server, sockets) };
}

/** A keel.toml agent (`[[agents]]`) talking to `modelUrl`, with an HTTP tool on `serviceUrl` that is not idempotent. */
export function opsAgentToml({ id = 'ops', name = 'Ops', description, modelUrl, serviceUrl, timeout = '300ms' }) {
  const quote = (s) => JSON.stringify(s); // a TOML basic string is a JSON string
  return `
[[agents]]
id = ${quote(id)}
name = ${quote(name)}
description = ${quote(description)}
system_prompt = "You operate services. Use restart_service when asked to restart one."
[agents.model]
kind = "openai"
base_url = ${quote(modelUrl)}
name = "mock"
max_retries = 0
[[agents.tools]]
kind = "http"
name = "restart_service"
description = "Restart a service"
method = "POST"
url = ${quote(`${serviceUrl}/restart/{service}`)}
timeout = ${quote(timeout)}
idempotent = false
policy = "allow"
args_schema = { type = "object", properties = { service = { type = "string" } }, required = ["service"] }
`;
}

/** One streamed chat completion, as OpenAI sends it: `text` (in a few pieces), then `call` if any. */
function completionChunks({ text = '', call } = {}) {
  const chunk = (delta, finish = null) => ({ id: 'chatcmpl-mock', object: 'chat.completion.chunk', created: 1, model: 'mock',
    choices: [{ index: 0, delta, finish_reason: finish }] });
  const chunks = [chunk({ role: 'assistant', content: '' })];
  for (const piece of text.match(/[^ ]* ?/g).filter(Boolean)) chunks.push(chunk({ content: piece }));
  if (call) {
    const json = JSON.stringify(call.args);
    chunks.push(chunk({ tool_calls: [{ index: 0, id: call.id, type: 'function', function: { name: call.name, arguments: '' } }] }),
      chunk({ tool_calls: [{ index: 0, function: { arguments: json.slice(0, 7) } }] }),
      chunk({ tool_calls: [{ index: 0, function: { arguments: json.slice(7) } }] }));
  }
  chunks.push(chunk({}, call ? 'tool_calls' : 'stop'));
  return chunks;
}

/**
 * An OpenAI-compatible model (`POST /v1/chat/completions`, streamed) whose every answer is
 * `reply(lastMessage, request)`: `{ text, call: { name, args } }`, either part optional. The n-th
 * call it makes has the id `call_scripted_<n>` (n from 1); Keel replaces it with an id of its own
 * (the idempotency key it sends), which the model then sees in its history. `requests` keeps every
 * body.
 */
export async function startScriptedModel(reply) {
  const requests = [];
  const sockets = new Set();
  let made = 0;
  const server = http.createServer((req, res) => {
    let body = '';
    req.on('data', (c) => { body += c; });
    req.on('end', () => {
      if (req.method !== 'POST' || !req.url.endsWith('/chat/completions')) {
        res.writeHead(404, { 'content-type': 'application/json' });
        res.end(JSON.stringify({ error: { message: 'not found', type: 'invalid_request_error' } }));
        return;
      }
      let answer;
      try {
        const request = JSON.parse(body);
        requests.push(request);
        answer = { ...reply((request.messages || []).at(-1), request) };
        if (answer.call) answer.call = { ...answer.call, id: `call_scripted_${++made}` };
      } catch (e) {
        res.writeHead(500, { 'content-type': 'application/json' });
        res.end(JSON.stringify({ error: { message: `the script failed: ${e.message}`, type: 'server_error' } }));
        return;
      }
      res.writeHead(200, { 'content-type': 'text/event-stream', 'cache-control': 'no-cache' });
      res.end(completionChunks(answer).map((c) => `data: ${JSON.stringify(c)}\n\n`).join('') + 'data: [DONE]\n\n');
    });
  });
  server.on('connection', (s) => { sockets.add(s); s.on('close', () => sockets.delete(s)); });
  const port = await listen(server);
  return { url: `http://127.0.0.1:${port}/v1`, requests, close: () => closeAll(server, sockets) };
}

const TOOL_SERVICE = join(dirname(fileURLToPath(import.meta.url)), '../../crates/keel/tests/support/tool_service.py');

/**
 * crates/keel/tests/support/tool_service.py in its own process (python3): `POST /restart/{id}`
 * applied once per Idempotency-Key. `requests()` is every request it got (GET /_requests: method,
 * path, idempotencyKey, keelRunId, keelCallId, keelAttempt, body), `effects()` how many restarts
 * each instance had; `close()` ends the process.
 */
export async function startToolService() {
  const child = spawn('python3', [TOOL_SERVICE, '0'], { stdio: ['ignore', 'pipe', 'pipe'] });
  let err = '';
  child.stderr.on('data', (c) => { err += c; });
  const close = async () => {
    if (child.exitCode === null && child.signalCode === null) {
      const exited = new Promise((r) => child.once('exit', r));
      child.kill('SIGTERM');
      await exited;
    }
  };
  try {
    const port = await new Promise((resolve, reject) => {
      let out = '';
      const timer = setTimeout(() => reject(new Error(`tool_service.py printed no port: ${out}${err}`)), 10000);
      child.stdout.on('data', (c) => {
        out += c;
        const m = out.match(/^listening (\d+)\n/);
        if (m) { clearTimeout(timer); resolve(Number(m[1])); }
      });
      child.once('error', (e) => { clearTimeout(timer); reject(e); });
      child.once('exit', (code) => { clearTimeout(timer); reject(new Error(`tool_service.py exited with ${code}: ${out}${err}`)); });
    });
    const url = `http://127.0.0.1:${port}`;
    const get = async (path) => (await fetch(url + path)).json();
    return { url, requests: () => get('/_requests'), effects: () => get('/_effects'), close };
  } catch (e) {
    await close();
    throw e;
  }
}
