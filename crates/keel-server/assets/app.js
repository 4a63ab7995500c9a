// Keel's page: the server's agents, conversations, streamed runs, tool steps, confirmation cards,
// the execution graph and the confirmed facts. Plain JavaScript, no build step, no dependency. Every
// piece of data is inserted as text (h() appends strings as text nodes), never as HTML.
'use strict';

const $ = (id) => document.getElementById(id);
const ui = {
  app: $('app'), list: $('conv-list'), messages: $('messages'), title: $('conv-title'), conn: $('conn'),
  form: $('composer'), input: $('input'), send: $('send'), stop: $('stop'), graph: $('graph'),
  caption: $('graph-caption'), facts: $('facts'), newConv: $('new-conv'), scrim: $('scrim'),
  sidebar: $('sidebar'), inspector: $('inspector'), agentTag: $('conv-agent'), brandAgent: $('brand-agent'),
  demoTools: $('demo-tools'), resetDemo: $('reset-demo'), resetStatus: $('reset-status'),
  toggles: { sidebar: $('toggle-sidebar'), inspector: $('toggle-inspector') },
};
const LEAVE = 'leaving this conversation';
const TERMINAL = new Set(['done', 'error', 'cancelled']);
// The most a decision's note may hold (the server's limit).
const NOTE_MAX = 2000;

// `epoch` changes when another conversation is opened; work begun for the old one then stops.
// `agents` is GET /v1/agents once read; `draftAgent` the one picked for the next new conversation;
// `convAgent` the agent of the open conversation (its `agentId`; null: the server's default).
const state = {
  convId: null, epoch: 0, runs: [], active: null, shown: null, facts: {}, retryMs: 2000,
  agents: null, draftAgent: null, convAgent: null,
};

// ------------------------------------------------------------------ helpers

function h(tag, props = {}, ...children) {
  const el = document.createElement(tag);
  for (const [k, v] of Object.entries(props)) {
    if (v == null || v === false) continue;
    if (k === 'class') el.className = v;
    else if (k.startsWith('on')) el.addEventListener(k.slice(2), v);
    else el.setAttribute(k, v === true ? '' : v);
  }
  el.append(...children.flat().filter((c) => c != null && c !== false).map((c) => (c instanceof Node ? c : String(c))));
  return el;
}

function svg(tag, attrs = {}, ...children) {
  const el = document.createElementNS('http://www.w3.org/2000/svg', tag);
  for (const [k, v] of Object.entries(attrs)) el.setAttribute(k, v);
  el.append(...children.map((c) => (c instanceof Node ? c : String(c))));
  return el;
}

// A server with API keys answers 401 until the page has one. The key lives in this tab's
// sessionStorage only, and goes out as `Authorization: Bearer` (never in a URL, never a cookie, so
// there is no cross-site request to forge).
const KEY_SLOT = 'keel.apiKey';

function withAuth(headers) {
  const key = sessionStorage.getItem(KEY_SLOT);
  return key ? { ...headers, Authorization: `Bearer ${key}` } : headers;
}

// Asks for a key after a 401; true when the user gave one (the request is then worth retrying).
function askForKey(message) {
  sessionStorage.removeItem(KEY_SLOT);
  const key = window.prompt(`${message}\n\nThis Keel server needs an API key (made with \`keel users add NAME --role operator\`):`);
  if (!key || !key.trim()) return false;
  sessionStorage.setItem(KEY_SLOT, key.trim());
  return true;
}

async function authedFetch(path, init = {}) {
  for (;;) {
    const sentWith = sessionStorage.getItem(KEY_SLOT);
    const res = await fetch(path, { ...init, headers: withAuth(init.headers || {}) });
    if (res.status !== 401) return res;
    // Another request asked for a key while this one was out: try that key before asking again.
    if (sessionStorage.getItem(KEY_SLOT) !== sentWith) continue;
    const data = await res.clone().json().catch(() => null);
    if (!askForKey(data?.error?.message || 'Not signed in.')) return res;
  }
}

async function api(method, path, body) {
  const headers = { Accept: 'application/json' };
  if (body !== undefined) headers['Content-Type'] = 'application/json';
  const res = await authedFetch(path, { method, headers, body: body === undefined ? undefined : JSON.stringify(body) });
  const data = await res.json().catch(() => null);
  if (!res.ok) {
    const err = new Error(data?.error?.message || `${res.status} ${res.statusText}`);
    Object.assign(err, { status: res.status, code: data?.error?.code });
    throw err;
  }
  return data;
}

const sleep = (ms) => new Promise((r) => setTimeout(r, ms));
const ms = (n) => (n < 1000 ? `${n} ms` : n < 60000 ? `${(n / 1000).toFixed(1)} s` : `${Math.round(n / 60000)} min`);
const randomId = () => Date.now().toString(36) + Math.random().toString(36).slice(2, 10);

function scrollDown(force) {
  const m = ui.messages;
  if (force || m.scrollHeight - m.scrollTop - m.clientHeight < 120) m.scrollTop = m.scrollHeight;
}

function setConn(mode) {
  ui.conn.className = `conn ${mode}`;
  ui.conn.textContent = { live: 'live', reconnecting: 'reconnecting…', '': '' }[mode];
}

// ------------------------------------------------------------------ agents

// GET /v1/agents, read once (again after a failure). The page names no agent of its own: names,
// descriptions and suggestions all come from here.
let agentsRead = null;
function loadAgents() {
  agentsRead ??= api('GET', '/v1/agents').then(({ agents }) => {
    state.agents = Array.isArray(agents) ? agents : [];
    const brand = state.agents.length === 1 ? state.agents[0].name : state.agents.length > 1 ? `${state.agents.length} agents` : '';
    ui.brandAgent.textContent = brand;
    return state.agents;
  }, (e) => {
    agentsRead = null;
    throw e;
  });
  return agentsRead;
}

const defaultAgent = () => state.agents?.find((a) => a.default) || state.agents?.[0] || null;
/** The agent of this id; null or undefined: the server's default. Null when the server runs none such. */
const agentOf = (id) => (id ? state.agents?.find((a) => a.id === id) : defaultAgent()) || null;
/** The name to show for an agent id (a conversation's `agentId`): its name, else the id itself. */
const agentName = (id) => agentOf(id)?.name || id || '';
/** The agent the page is talking to now: the open conversation's, or the one picked for a new one. */
const currentAgentName = () => agentName(state.convId ? state.convAgent : state.draftAgent);

/** The header's agent tag, the tab's title and the composer's wording follow the current agent. */
function showAgent() {
  const name = currentAgentName();
  ui.agentTag.hidden = !name;
  ui.agentTag.replaceChildren(h('span', { class: 'visually-hidden' }, 'Agent: '), h('span', { class: 'agent-tag-name' }, name));
  document.title = name ? `Keel · ${name}` : 'Keel';
  updateComposer();
}

/**
 * The welcome of a new conversation: the picked agent's name, description and suggestions, and,
 * when the server runs several agents, a picker (a group of radio buttons: Tab reaches it, the
 * arrow keys move the choice).
 */
function welcome(error) {
  const agents = state.agents || [];
  if (!agents.some((a) => a.id === state.draftAgent)) state.draftAgent = defaultAgent()?.id ?? null;
  const name = h('h2', {});
  const description = h('p', { class: 'welcome-description' });
  const chips = h('div', { class: 'suggestions', role: 'group', 'aria-label': 'Suggestions' });
  const fill = () => {
    const agent = agentOf(state.draftAgent);
    name.textContent = agent?.name || 'New conversation';
    description.textContent = agent?.description || (agent ? '' : 'Write a message to start.');
    description.hidden = !description.textContent;
    chips.replaceChildren(...(agent?.suggestions || []).map((s) => h('button', {
      type: 'button', class: 'chip', onclick: () => { ui.input.value = s; autogrow(); ui.input.focus(); },
    }, s)));
    chips.hidden = !chips.childElementCount;
    showAgent();
  };
  const picker = agents.length > 1 && h('fieldset', { class: 'agent-picker' },
    h('legend', {}, 'Agent'),
    agents.map((a) => {
      const nameId = `agent-name-${a.id}`;
      const descId = `agent-desc-${a.id}`;
      return h('label', { class: 'agent-option', 'data-agent': a.id },
        h('input', {
          type: 'radio', name: 'agent', value: a.id, checked: a.id === state.draftAgent, 'aria-labelledby': nameId,
          'aria-describedby': a.description ? descId : null, onchange: () => { state.draftAgent = a.id; fill(); },
        }),
        h('span', { class: 'agent-text' }, h('span', { class: 'agent-name', id: nameId }, a.name),
          a.description && h('span', { class: 'agent-description', id: descId }, a.description)));
    }));
  const el = h('div', { class: 'welcome' }, picker, name, description, chips,
    error && h('p', { class: 'notice error' }, `Cannot list the agents: ${error.message}`));
  fill();
  return el;
}

// ------------------------------------------------------------------ conversations

async function loadList() {
  await loadAgents().catch(() => null); // named per conversation when there are several
  const { conversations } = await api('GET', '/v1/conversations');
  const several = (state.agents?.length || 0) > 1;
  ui.list.replaceChildren(...conversations.map((c) => h('li', {},
    h('a', { href: `#${c.id}`, 'aria-current': c.id === state.convId ? 'page' : null },
      h('span', { class: 'conv-title' }, c.title),
      several && h('span', { class: 'conv-agent' }, agentName(c.agentId)),
      h('time', { datetime: c.createdAt }, new Date(c.createdAt).toLocaleString())))));
}

function leave() {
  state.epoch += 1;
  for (const run of state.runs) run.ctl?.abort(LEAVE);
  Object.assign(state, { runs: [], active: null, shown: null });
  ui.messages.replaceChildren();
  setConn('');
  renderFacts({});
  drawGraph();
  closeDrawers();
}

function showDraft() {
  // From a conversation, a new one starts with the same agent.
  if (state.convId) state.draftAgent = state.convAgent;
  leave();
  state.convId = null;
  state.convAgent = null;
  ui.title.textContent = 'New conversation';
  const epoch = state.epoch;
  showAgent();
  loadAgents().then(() => welcome(), (e) => welcome(e)).then((el) => {
    if (epoch === state.epoch) ui.messages.append(el);
  });
  loadList().catch(() => {});
}

async function openConversation(id) {
  leave();
  state.convId = id;
  const epoch = state.epoch;
  loadList().catch(() => {});
  let conv;
  try {
    conv = await api('GET', `/v1/conversations/${encodeURIComponent(id)}`);
  } catch (e) {
    if (epoch === state.epoch) ui.messages.append(h('p', { class: 'notice error' }, `Cannot open this conversation: ${e.message}`));
    return;
  }
  if (epoch !== state.epoch) return;
  ui.title.textContent = conv.title;
  state.convAgent = conv.agentId ?? null;
  await loadAgents().catch(() => null);
  if (epoch !== state.epoch) return;
  showAgent();
  // One turn per run, in the order of the messages; each turn is rebuilt from its run's events.
  const byId = new Map();
  for (const m of conv.messages) {
    if (m.role === 'user') ui.messages.append(userBubble(m.content));
    if (m.runId && !byId.has(m.runId)) byId.set(m.runId, addRun(m.runId));
  }
  if (conv.activeRunId && !byId.has(conv.activeRunId)) byId.set(conv.activeRunId, addRun(conv.activeRunId));
  const histories = await Promise.all([...byId.values()].map((run) =>
    api('GET', `/v1/runs/${run.id}/events`).then((r) => r.events, () => [])));
  if (epoch !== state.epoch) return;
  [...byId.values()].forEach((run, i) => histories[i].forEach((ev) => apply(run, ev, false)));
  renderFacts(conv.facts);
  const active = conv.activeRunId && byId.get(conv.activeRunId);
  if (active) {
    // The run's own view names the pending decision, should the events have been cut short.
    const info = await api('GET', `/v1/runs/${active.id}`).catch(() => null);
    if (epoch !== state.epoch) return;
    const pending = info?.pendingInterrupt;
    if (pending && !active.cards.has(pending.id)) {
      showCard(active, { interruptId: pending.id, kind: pending.kind, payload: pending.payload, expiresAt: pending.expiresAt });
      active.paused = true;
    }
    state.active = active;
    follow(active);
  }
  showGraph(state.runs.at(-1));
  for (const run of state.runs) updateTurn(run);
  updateComposer();
  scrollDown(true);
}

async function send(text) {
  const epoch = state.epoch;
  ui.send.disabled = true;
  try {
    if (!state.convId) {
      const body = { title: text.length > 60 ? `${text.slice(0, 57)}…` : text };
      if (state.draftAgent) body.agentId = state.draftAgent;
      const conv = await api('POST', '/v1/conversations', body);
      if (epoch !== state.epoch) return;
      state.convId = conv.id;
      state.convAgent = conv.agentId ?? null;
      history.replaceState(null, '', `#${conv.id}`);
      ui.title.textContent = conv.title;
      ui.messages.replaceChildren();
      showAgent();
      loadList().catch(() => {});
    }
    const { runId } = await api('POST', `/v1/conversations/${state.convId}/messages`, { content: text });
    if (epoch !== state.epoch) return;
    ui.messages.append(userBubble(text));
    ui.input.value = '';
    autogrow();
    const run = addRun(runId);
    state.active = run;
    showGraph(run);
    follow(run);
    updateTurn(run);
    scrollDown(true);
  } catch (e) {
    ui.messages.append(h('p', { class: 'notice error' }, `Not sent: ${e.message}`));
  } finally {
    ui.send.disabled = false;
    updateComposer();
  }
}

function userBubble(text) {
  return h('div', { class: 'turn user' }, h('div', { class: 'bubble user' }, text));
}

// ------------------------------------------------------------------ runs and their events

function addRun(id) {
  const typing = h('div', { class: 'typing', role: 'img', 'aria-label': `${currentAgentName() || 'The agent'} is writing` },
    h('i'), h('i'), h('i'));
  const meta = h('div', { class: 'turn-meta' });
  const el = h('div', { class: 'turn assistant', 'data-run': id }, typing, meta);
  const run = {
    id, el, typing, meta, lastSeq: 0, status: 'running', paused: false, ended: false, ctl: null, following: false,
    texts: new Map(), steps: new Map(), cards: new Map(), nodes: [], edges: [], stats: new Map(), taken: new Map(),
    current: null, prev: null, startedAt: null, endedAt: null, holdUntil: 0,
  };
  meta.append(h('span', { class: 'run-id' }, id.slice(0, 14) + '…'), h('span', { class: 'run-status' }),
    h('button', { type: 'button', class: 'link', onclick: () => showGraph(run) }, 'graph'));
  state.runs.push(run);
  ui.messages.append(el);
  return run;
}

/// Adds a block at the end of the turn, before the typing indicator; consecutive text shares a
/// bubble and consecutive tool calls share a step bar.
function block(run, kind) {
  const last = run.typing.previousElementSibling;
  if (last?.dataset.kind === kind) return last;
  const el = kind === 'text' ? h('div', { class: 'bubble assistant', 'data-kind': 'text' })
    : h('ol', { class: 'steps', 'data-kind': 'steps', 'aria-label': 'Steps' });
  run.el.insertBefore(el, run.typing);
  return el;
}

function apply(run, ev, live) {
  if (ev.sequence <= run.lastSeq) return; // already shown: a replay after a reconnect
  run.lastSeq = ev.sequence;
  switch (ev.type) {
    case 'run_started': run.startedAt = Date.parse(ev.ts); break;
    case 'graph_topology': run.nodes = ev.nodes; run.edges = ev.edges; break;
    case 'node_started': {
      if (run.current) run.prev = run.current;
      const from = run.prev;
      if (from) run.taken.set(`${from}>${ev.node}`, (run.taken.get(`${from}>${ev.node}`) || 0) + 1);
      run.current = ev.node;
      break;
    }
    case 'node_finished': {
      const s = run.stats.get(ev.node) || { visits: 0, totalMs: 0 };
      s.visits += 1;
      s.totalMs += ev.durationMs;
      run.stats.set(ev.node, s);
      run.prev = ev.node;
      if (run.current === ev.node) run.current = null;
      break;
    }
    case 'text_delta': {
      let text = run.texts.get(ev.messageId);
      if (!text) {
        text = document.createTextNode('');
        block(run, 'text').append(h('span', { 'data-message': ev.messageId }, text));
        run.texts.set(ev.messageId, text);
      }
      text.appendData(ev.delta);
      break;
    }
    case 'text_discarded': {
      const span = run.texts.get(ev.messageId)?.parentNode;
      run.texts.delete(ev.messageId);
      const bubble = span?.parentNode;
      span?.remove();
      if (bubble && !bubble.childNodes.length) bubble.remove();
      break;
    }
    case 'tool_started': step(run, ev, 'running'); break;
    case 'tool_finished': step(run, ev, ev.status); break;
    case 'facts_updated': if (live) renderFacts(ev.facts); break;
    case 'interrupt': run.paused = true; showCard(run, ev); break;
    case 'resumed': run.paused = false; resolveCard(run, ev.interruptId, 'resolved', describeDecision(ev), ev.note); break;
    case 'done': case 'error': case 'cancelled': finish(run, ev); break;
    default: break; // a type this page does not know yet: ignore it, as the contract says
  }
  if (live) {
    updateTurn(run);
    if (run === state.shown && (ev.type.startsWith('node') || ev.type === 'graph_topology' || ev.type === 'interrupt'
      || ev.type === 'resumed' || TERMINAL.has(ev.type))) drawGraph();
    scrollDown(ev.type === 'interrupt');
  }
}

function finish(run, ev) {
  run.ended = true;
  run.paused = false;
  run.status = ev.type === 'done' ? 'completed' : ev.type === 'error' ? 'failed' : 'cancelled';
  run.endedAt = Date.parse(ev.ts);
  run.current = null;
  if (ev.type === 'error') run.el.insertBefore(h('p', { class: 'notice error' }, `The run failed: ${ev.message} (${ev.code})`), run.typing);
  if (ev.type === 'cancelled') {
    const unknown = [...run.cards.values()].some((c) => c.state === 'pending' && c.kind === 'outcome_unknown');
    const expired = unknown ? 'The question expired, so the run was cancelled. The outcome of the interrupted action is still unknown.'
      : 'The confirmation expired, so the run was cancelled. Nothing was changed.';
    const why = { cancelled_by_user: 'Stopped.', client_disconnected: 'Stopped: the client went away.',
      interrupt_expired: expired }[ev.reason] || `Cancelled (${ev.reason}).`;
    run.el.insertBefore(h('p', { class: 'notice' }, why), run.typing);
  }
  for (const [id, card] of run.cards) {
    if (card.state !== 'pending') continue;
    if (ev.reason === 'interrupt_expired') resolveCard(run, id, 'expired', expiredText(card));
    else resolveCard(run, id, 'closed', 'The run ended before a decision was made.');
  }
  if (state.active === run) state.active = null;
}

const STEP_STATES = { running: 'running', success: 'done', error: 'failed', denied: 'denied', unknown: 'outcome unknown' };

/** A tool step, keyed by its call id. A failed step shows why (`errorCode`: "failed: timeout"). */
function step(run, ev, status) {
  let li = run.steps.get(ev.callId);
  if (!li) {
    li = h('li', { class: 'step', 'data-call': ev.callId },
      h('span', { class: 'step-icon', 'aria-hidden': 'true' }),
      h('span', { class: 'step-line' }, h('code', { class: 'step-tool' }, ev.tool), ' ', h('span', { class: 'step-args' }, ev.argsSummary || ''),
        ' ', h('span', { class: 'step-state' })),
      h('span', { class: 'step-summary' }));
    block(run, 'steps').append(li);
    run.steps.set(ev.callId, li);
  }
  li.dataset.status = status;
  const state = li.querySelector('.step-state');
  const detail = status === 'error' && ev.errorCode ? `failed: ${ev.errorCode}` : status === 'unknown' ? 'outcome unknown' : '';
  state.textContent = detail || STEP_STATES[status] || status;
  state.classList.toggle('shown', !!detail);
  if (status === 'error' && ev.errorCode) li.dataset.errorCode = ev.errorCode; else delete li.dataset.errorCode;
  if (ev.summary) li.querySelector('.step-summary').textContent = ev.summary;
}

function updateTurn(run) {
  run.typing.hidden = run.ended || run.paused;
  const status = run.ended ? run.status : run.paused ? 'waiting for you' : 'running';
  const took = run.endedAt && run.startedAt ? ` · ${ms(run.endedAt - run.startedAt)}` : '';
  run.meta.querySelector('.run-status').textContent = status + took;
  run.el.dataset.status = run.ended ? run.status : run.paused ? 'paused' : 'running';
  if (run === state.active || run === state.shown) updateComposer();
}

// Follows a run's events: GET /v1/runs/{id}/events with the last sequence seen, again and again
// until the run ends, so a dropped connection only costs a short "reconnecting…".
async function follow(run) {
  if (run.following) return;
  run.following = true;
  const epoch = state.epoch;
  let delay = 250;
  while (!run.ended && epoch === state.epoch) {
    const ctl = new AbortController();
    run.ctl = ctl;
    try {
      const res = await authedFetch(`/v1/runs/${run.id}/events`, {
        headers: { Accept: 'text/event-stream', 'Last-Event-ID': String(run.replayFrom ?? run.lastSeq) }, signal: ctl.signal, cache: 'no-store',
      });
      run.replayFrom = undefined;
      if (res.status >= 400 && res.status < 500) {
        const body = await res.json().catch(() => null);
        run.el.insertBefore(h('p', { class: 'notice error' }, `Cannot follow this run: ${body?.error?.message || res.status}`), run.typing);
        break;
      }
      if (!res.ok) throw new Error(`HTTP ${res.status}`);
      setConn('live');
      await readEvents(res.body, (ev) => { delay = 250; apply(run, ev, true); });
    } catch (e) {
      if (ctl.signal.reason === LEAVE) break;
    }
    if (run.ended || epoch !== state.epoch) break;
    setConn('reconnecting');
    await sleep(Math.max(delay, run.holdUntil - Date.now()));
    delay = Math.min(delay * 2, state.retryMs);
  }
  run.following = false;
  if (epoch === state.epoch && !state.runs.some((r) => r.following)) setConn('');
}

async function readEvents(body, onEvent) {
  const reader = body.pipeThrough(new TextDecoderStream()).getReader();
  let buf = '';
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buf += value.replace(/\r/g, ''); // the JSON in data: never holds a raw CR
    let end;
    while ((end = buf.indexOf('\n\n')) >= 0) {
      const frame = buf.slice(0, end);
      buf = buf.slice(end + 2);
      let data = '';
      for (const line of frame.split('\n')) {
        if (line.startsWith('data:')) data += (data ? '\n' : '') + line.slice(5).replace(/^ /, '');
        else if (line.startsWith('retry:')) state.retryMs = Number(line.slice(6)) || state.retryMs;
      }
      if (data) onEvent(JSON.parse(data));
    }
  }
}

// ------------------------------------------------------------------ confirmation cards

// Two kinds of question. `confirm_action`: may this run? (approve, reject, edit the arguments).
// `outcome_unknown`: a call was sent and no answer came back, so it may or may not have happened
// (retry it with the same idempotency key, say it was done, say it did not happen).
const OUTCOME = [
  { decision: 'retry', label: 'Retry with the same key', all: 'Retry all with the same keys', short: 'Retry' },
  { decision: 'mark_done', label: 'It was done', all: 'All were done', short: 'It was done' },
  { decision: 'mark_failed', label: 'It did not happen', all: 'None happened', short: 'It did not happen' },
];
const SENT = {
  approve: 'Approved; continuing…', reject: 'Rejected; continuing…', calls: 'Decisions sent; continuing…',
  retry: 'Retrying with the same idempotency key…', mark_done: 'Marked as done; continuing…',
  mark_failed: 'Marked as not done; continuing…',
};

const isOutcomeUnknown = (ev) => ev.kind === 'outcome_unknown';
const expiredText = (card) => (card.kind === 'outcome_unknown'
  ? 'This question expired and the run was cancelled; the outcome of the action is still unknown.'
  : card.kind === 'tool_call' ? 'This request expired and the run was cancelled.'
    : 'This confirmation expired; nothing was done.');

/** A note for the decision (`note`, kept with it and shown to everyone): open, or behind "Add a note". */
function noteField(card, open) {
  const id = `note-${card.id}`;
  const input = h('textarea', { id, class: 'note-input', rows: 2, maxlength: NOTE_MAX, spellcheck: 'true',
    placeholder: card.kind === 'outcome_unknown' ? 'What you checked, e.g. "the service log shows no restart"' : 'Why, for the record' });
  const field = h('div', { class: 'note', id: `${id}-field`, hidden: !open },
    h('label', { for: id }, 'Note', h('span', { class: 'muted' }, ' (optional, kept with the decision)')), input);
  card.note = input;
  if (open) return [field];
  const add = h('button', { type: 'button', class: 'btn ghost small note-toggle', 'aria-expanded': 'false', 'aria-controls': field.id,
    onclick: () => { field.hidden = false; add.hidden = true; add.setAttribute('aria-expanded', 'true'); input.focus(); } }, 'Add a note');
  return [h('div', { class: 'action-tools' }, add), field];
}

function actionItem(card, a, extra) {
  const args = a.args || {};
  // What the action is on: its word-like string arguments (an instance, a service), not free text
  // such as a reason, which the description and the arguments below show in full.
  const target = Object.values(args).filter((v) => typeof v === 'string' && v && v.length <= 80 && !/\s/.test(v)).join(' · ');
  return h('li', { class: 'action', 'data-call': a.callId },
    h('div', { class: 'action-head' }, h('code', {}, a.tool), target && h('span', { class: 'target' }, target)),
    card.multi && a.title && h('p', { class: 'action-title' }, a.title),
    a.description && h('p', { class: 'muted' }, a.description),
    h('dl', { class: 'args' }, Object.entries(args).flatMap(([k, v]) => [h('dt', {}, k), h('dd', {}, typeof v === 'string' ? v : JSON.stringify(v))])),
    extra);
}

function showCard(run, ev) {
  if (run.cards.has(ev.interruptId)) return;
  if (ev.kind === 'tool_call') { showToolCallCard(run, ev); return; }
  const p = ev.payload || {};
  const actions = p.actions || [];
  const kind = isOutcomeUnknown(ev) ? 'outcome_unknown' : ev.kind || 'confirm_action';
  const card = {
    id: ev.interruptId, run, kind, state: 'pending', expiresAt: Date.parse(ev.expiresAt), keys: new Map(), actions: [],
    multi: actions.length > 1, note: null,
  };
  const countdown = h('span', { class: 'countdown', 'aria-live': 'off' });
  const badge = h('span', { class: 'badge' }, kind === 'outcome_unknown' ? 'Outcome unknown: your decision is needed' : 'Your approval is needed');
  const message = h('p', { class: 'card-message', role: 'status' });
  const list = h('ul', { class: 'actions' });
  if (kind === 'outcome_unknown') {
    for (const a of actions) {
      const act = { callId: a.callId, choice: null };
      const attempts = Number(a.attempts) || 0;
      const outcome = h('p', { class: 'outcome' }, h('span', { class: 'outcome-label' }, 'outcome unknown'),
        attempts ? ` · ${attempts} ${attempts === 1 ? 'attempt' : 'attempts'}` : '');
      const choice = card.multi && h('div', { class: 'choice', role: 'radiogroup', 'aria-label': `What happened to ${a.tool}` },
        OUTCOME.map((o) => h('label', {}, h('input', { type: 'radio', name: `${card.id}-${a.callId}`, value: o.decision,
          onchange: () => { act.choice = o.decision; } }), o.short)));
      list.append(actionItem(card, a, [outcome, choice]));
      card.actions.push(act);
      // Its step was left running when the answer never came.
      const li = run.steps.get(a.callId);
      if (li && li.dataset.status === 'running') step(run, { callId: a.callId }, 'unknown');
    }
    // None of the three is the default: which is right depends on what the user finds out.
    card.buttons = OUTCOME.map((o) => h('button', { type: 'button', class: 'btn', 'data-decision': o.decision,
      onclick: () => decide(card, o.decision) }, card.multi ? o.all : o.label));
    if (card.multi) card.buttons.push(h('button', { type: 'button', class: 'btn', onclick: () => decide(card, 'calls') }, 'Submit per-action decisions'));
  } else {
    for (const a of actions) {
      const act = { callId: a.callId, args: a.args || {}, choice: 'approve', editor: null };
      const editor = h('textarea', { class: 'args-editor', rows: 4, spellcheck: 'false', 'aria-label': `Arguments of ${a.tool}`, hidden: true });
      editor.value = JSON.stringify(act.args, null, 2);
      act.editor = editor;
      const editBtn = h('button', { type: 'button', class: 'btn ghost small', 'aria-expanded': 'false', onclick: () => {
        editor.hidden = !editor.hidden;
        editBtn.setAttribute('aria-expanded', String(!editor.hidden));
        editBtn.textContent = editor.hidden ? 'Edit arguments' : 'Keep original arguments';
        if (editor.hidden) editor.value = JSON.stringify(act.args, null, 2); else editor.focus();
      } }, 'Edit arguments');
      const choice = card.multi && h('div', { class: 'choice', role: 'radiogroup', 'aria-label': `Decision for ${a.tool}` },
        ['approve', 'reject'].map((c) => h('label', {}, h('input', { type: 'radio', name: `${card.id}-${a.callId}`, value: c,
          checked: c === 'approve', onchange: () => { act.choice = c; } }), c === 'approve' ? 'Approve' : 'Reject')));
      list.append(actionItem(card, a, [choice, h('div', { class: 'action-tools' }, editBtn), editor]));
      card.actions.push(act);
    }
    const approve = h('button', { type: 'button', class: 'btn primary', onclick: () => decide(card, 'approve') }, card.multi ? 'Submit decisions' : 'Approve');
    const reject = h('button', { type: 'button', class: 'btn', onclick: () => decide(card, 'reject') }, card.multi ? 'Reject all' : 'Reject');
    card.buttons = [approve, reject];
  }
  const footer = h('footer', {}, card.buttons);
  card.countdown = countdown;
  card.badge = badge;
  card.message = message;
  card.noteShown = h('p', { class: 'card-note', hidden: true });
  card.el = h('section', { class: 'card', 'data-interrupt': card.id, 'data-kind': kind, 'data-state': 'pending',
    'aria-label': kind === 'outcome_unknown' ? 'Outcome unknown: decision needed' : 'Confirmation needed' },
    h('header', {}, badge, countdown),
    h('h3', {}, p.title || (kind === 'outcome_unknown' ? 'Did the action happen?' : 'Confirm the action')),
    p.risk && h('p', { class: 'risk' }, h('strong', {}, kind === 'outcome_unknown' ? 'Outcome unknown: ' : 'Risk: '), p.risk),
    kind !== 'outcome_unknown' && p.outcomeUnknown
      && h('p', { class: 'risk' }, h('strong', {}, 'Outcome unknown: '), 'an earlier attempt was cut off and may or may not have happened.'),
    list, noteField(card, kind === 'outcome_unknown'), footer, message, card.noteShown);
  run.cards.set(card.id, card);
  run.el.insertBefore(card.el, run.typing);
  tick();
}

// ------------------------------------------------------------------ client-side tool calls

// A `tool_call` interrupt: a client-side tool waits for its result. The page answers the ones it
// can: a form built from the tool's result schema (one field per scalar property), or a JSON text
// area for any other schema; "Can't answer" sends an error the model is told.
const SCALARS = ['string', 'number', 'integer', 'boolean'];

function resultForm(card, schema) {
  const props = schema?.type === 'object' && schema.properties && typeof schema.properties === 'object' ? schema.properties : null;
  const simple = props && Object.values(props).every((p) => SCALARS.includes(p?.type));
  if (!simple) {
    const area = h('textarea', { class: 'args-editor result-json', rows: 4, spellcheck: 'false', 'aria-label': 'Result (JSON)' });
    area.value = props ? JSON.stringify(Object.fromEntries(Object.keys(props).map((k) => [k, null])), null, 2) : '{}';
    card.read = () => {
      try { return { result: JSON.parse(area.value) }; } catch { return { problem: 'The result is not valid JSON.' }; }
    };
    card.inputs = [area];
    return h('div', { class: 'result-form' }, h('label', {}, 'Result (JSON)'), area);
  }
  const required = new Set(Array.isArray(schema.required) ? schema.required : []);
  const fields = Object.entries(props).map(([name, p]) => {
    const id = `${card.id}-${name}`;
    let input;
    if (p.type === 'boolean') input = h('input', { id, type: 'checkbox', name });
    else if (Array.isArray(p.enum)) input = h('select', { id, name }, h('option', { value: '' }, '—'), p.enum.map((v) => h('option', { value: String(v) }, String(v))));
    else input = h('input', { id, name, type: p.type === 'string' ? 'text' : 'number', step: p.type === 'integer' ? '1' : 'any',
      maxlength: p.maxLength, autocomplete: 'off' });
    return { name, p, input, el: h('div', { class: 'field' },
      h('label', { for: id }, name, required.has(name) ? '' : h('span', { class: 'muted' }, ' (optional)')),
      p.description && h('p', { class: 'muted' }, p.description), input) };
  });
  card.read = () => {
    const result = {};
    for (const f of fields) {
      if (f.p.type === 'boolean') { result[f.name] = f.input.checked; continue; }
      const raw = f.input.value;
      if (raw === '') {
        if (required.has(f.name)) return { problem: `${f.name} is required.` };
        continue;
      }
      if (f.p.type === 'string') result[f.name] = raw;
      else {
        const n = Number(raw);
        if (!Number.isFinite(n) || (f.p.type === 'integer' && !Number.isInteger(n))) return { problem: `${f.name} must be a number.` };
        result[f.name] = n;
      }
    }
    return { result };
  };
  card.inputs = fields.map((f) => f.input);
  return h('div', { class: 'result-form' }, fields.map((f) => f.el));
}

function showToolCallCard(run, ev) {
  const p = ev.payload || {};
  const a = (p.actions || [])[0] || { callId: p.callId, tool: p.tool, args: p.args };
  const card = { id: ev.interruptId, run, kind: 'tool_call', state: 'pending', expiresAt: Date.parse(ev.expiresAt), keys: new Map(),
    actions: [], multi: false, note: null, callId: a.callId };
  const form = resultForm(card, a.resultSchema);
  card.countdown = h('span', { class: 'countdown', 'aria-live': 'off' });
  card.badge = h('span', { class: 'badge' }, 'Your answer is needed');
  card.message = h('p', { class: 'card-message', role: 'status' });
  card.noteShown = h('p', { class: 'card-note', hidden: true });
  card.buttons = [
    h('button', { type: 'button', class: 'btn primary', onclick: () => answerCall(card, 'result') }, 'Send answer'),
    h('button', { type: 'button', class: 'btn', onclick: () => answerCall(card, 'error') }, 'Can\u2019t answer'),
  ];
  card.el = h('section', { class: 'card', 'data-interrupt': card.id, 'data-kind': 'tool_call', 'data-state': 'pending',
    'aria-label': 'Answer needed' },
    h('header', {}, card.badge, card.countdown),
    h('h3', {}, p.title || `Waiting for ${a.tool}`),
    h('ul', { class: 'actions' }, actionItem(card, a)),
    form, h('footer', {}, card.buttons), card.message, card.noteShown);
  run.cards.set(card.id, card);
  run.el.insertBefore(card.el, run.typing);
  tick();
}

async function answerCall(card, how) {
  if (card.state !== 'pending' || card.busy) return;
  const read = how === 'error' ? { error: 'The user could not answer.' } : card.read();
  if (read.problem) { cardError(card, read.problem); return; }
  const sig = JSON.stringify(read);
  // One key per answer: the same answer again (a double click, a retry) gets the first answer.
  if (!card.keys.has(sig)) card.keys.set(sig, `result_${card.id}_${randomId()}`);
  const body = { callId: card.callId, ...read, idempotencyKey: card.keys.get(sig) };
  setCardBusy(card, true);
  card.inputs.forEach((i) => { i.disabled = true; });
  card.message.classList.remove('error');
  card.message.textContent = 'Sending your answer…';
  for (let attempt = 0; ; attempt++) {
    try {
      await api('POST', `/v1/runs/${card.run.id}/tool-results`, body);
      if (card.state === 'pending') card.message.textContent = 'Answer sent; continuing…';
      follow(card.run);
      break;
    } catch (e) {
      if (e.code === 'IDEMPOTENCY_KEY_IN_FLIGHT' && attempt < 20) { await sleep(300); continue; }
      if (e.code === 'INTERRUPT_EXPIRED') resolveCard(card.run, card.id, 'expired', expiredText(card));
      else if (e.code === 'TOOL_CALL_ALREADY_ANSWERED' || e.code === 'RUN_NOT_INTERRUPTED') {
        if (card.state === 'pending') resolveCard(card.run, card.id, 'resolved', 'This request was already answered elsewhere.');
      } else {
        const refused = e.status >= 400 && e.status < 500;
        cardError(card, refused ? `The answer was refused: ${e.message}` : `Not sent: ${e.message}. You can try again.`, e.code);
        setCardBusy(card, false);
        card.inputs.forEach((i) => { i.disabled = false; });
        return;
      }
      break;
    }
  }
  card.busy = false;
}

/** The decision a press of `verdict` means on this card, or a string saying what is missing. */
function decisionOf(card, verdict) {
  if (card.kind === 'outcome_unknown') {
    if (verdict !== 'calls') return { decision: verdict };
    const calls = {};
    for (const a of card.actions) {
      if (!a.choice) return { problem: 'Choose what happened for every action first.' };
      calls[a.callId] = a.choice;
    }
    return { decision: { calls } };
  }
  const calls = {};
  let plain = true;
  for (const a of card.actions) {
    let d = verdict === 'reject' ? 'reject' : a.choice;
    if (d === 'approve' && !a.editor.hidden) {
      let edited;
      try { edited = JSON.parse(a.editor.value); } catch { return { problem: 'The edited arguments are not valid JSON.' }; }
      if (JSON.stringify(edited) !== JSON.stringify(a.args)) d = { edit: edited };
    }
    if (d !== verdict) plain = false;
    calls[a.callId] = d;
  }
  return { decision: plain ? verdict : { calls } };
}

function cardError(card, text, code) {
  card.message.textContent = text;
  card.message.classList.add('error');
  if (code) card.message.dataset.code = code; else delete card.message.dataset.code;
}

function setCardBusy(card, busy) {
  card.busy = busy;
  card.buttons.forEach((b) => { b.disabled = busy; });
  if (card.note) card.note.disabled = busy;
}

async function decide(card, verdict) {
  if (card.state !== 'pending' || card.busy) return;
  const { decision, problem } = decisionOf(card, verdict);
  if (problem) { cardError(card, problem); return; }
  const note = card.note?.value.trim() || '';
  if (note.length > NOTE_MAX) { cardError(card, `The note is too long: at most ${NOTE_MAX} characters.`); return; }
  // One key per decision (and note): sending the same decision again (a double click, a retry) is
  // answered with the first answer, and nothing runs twice.
  const sig = JSON.stringify([decision, note]);
  if (!card.keys.has(sig)) card.keys.set(sig, `resume_${card.id}_${randomId()}`);
  const body = { interruptId: card.id, decision, idempotencyKey: card.keys.get(sig) };
  if (note) body.note = note;
  setCardBusy(card, true);
  card.message.classList.remove('error');
  card.message.textContent = 'Sending your decision…';
  for (let attempt = 0; ; attempt++) {
    try {
      await api('POST', `/v1/runs/${card.run.id}/resume`, body);
      if (card.state === 'pending') card.message.textContent = SENT[typeof decision === 'string' ? decision : 'calls'];
      follow(card.run);
      break;
    } catch (e) {
      if (e.code === 'IDEMPOTENCY_KEY_IN_FLIGHT' && attempt < 20) { await sleep(300); continue; }
      if (e.code === 'INTERRUPT_EXPIRED') resolveCard(card.run, card.id, 'expired', expiredText(card));
      else if (e.code === 'INTERRUPT_ALREADY_RESOLVED' || e.code === 'RUN_NOT_INTERRUPTED') {
        if (card.state === 'pending') resolveCard(card.run, card.id, 'resolved', 'This question was already answered elsewhere.');
      } else {
        // Refused (a role that may not decide, a decision that does not fit) or not delivered: say
        // so, and let the user try again (the same decision goes out with the same key).
        const refused = e.status >= 400 && e.status < 500;
        cardError(card, refused ? `The decision was refused: ${e.message}` : `Not sent: ${e.message}. You can try again.`, e.code);
        setCardBusy(card, false);
        return;
      }
      break;
    }
  }
  card.busy = false;
}

const DECIDED = {
  approve: 'Approved', reject: 'Rejected', retry: 'Retried with the same idempotency key',
  mark_done: 'Marked as done (it happened)', mark_failed: 'Marked as not done (it did not happen)',
};

function describeDecision(ev) {
  const d = ev.decision;
  const what = typeof d === 'string' ? DECIDED[d] || `Answered ${d}` : d?.edit ? 'Approved with edited arguments'
    : d?.calls ? 'Decided per action' : d?.toolResult ? (d.toolResult.status === 'error' ? 'Declined' : 'Answered') : 'Answered';
  return `${what}${ev.resolvedBy ? ` by ${ev.resolvedBy}` : ''} after ${ms(ev.humanWaitMs ?? 0)}.`;
}

function resolveCard(run, id, newState, text, note) {
  const card = run.cards.get(id);
  if (!card || card.state !== 'pending') return;
  card.state = newState;
  card.el.dataset.state = newState;
  card.buttons.forEach((b) => { b.disabled = true; });
  card.el.querySelectorAll('textarea, input, select, .action-tools button').forEach((c) => { c.disabled = true; });
  card.countdown.textContent = '';
  card.badge.textContent = { resolved: 'Decision recorded', expired: 'Expired', closed: 'Closed' }[newState];
  card.message.classList.remove('error');
  card.message.textContent = text;
  if (note) {
    card.noteShown.replaceChildren(h('strong', {}, 'Note: '), note);
    card.noteShown.hidden = false;
  }
  updateTurn(run);
}

function tick() {
  for (const run of state.runs) {
    for (const card of run.cards.values()) {
      if (card.state !== 'pending') continue;
      const left = Math.max(0, Math.ceil((card.expiresAt - Date.now()) / 1000));
      card.countdown.textContent = `expires in ${Math.floor(left / 60)}:${String(left % 60).padStart(2, '0')}`;
      if (left === 0) resolveCard(run, card.id, 'expired', expiredText(card));
    }
  }
}
setInterval(tick, 1000);

// ------------------------------------------------------------------ execution graph

function showGraph(run) {
  state.shown = run || null;
  drawGraph();
}

function drawGraph() {
  const run = state.shown;
  if (!run || !run.nodes.length) {
    ui.caption.textContent = 'No run yet.';
    ui.graph.replaceChildren();
    return;
  }
  const status = run.ended ? run.status : run.paused ? 'paused' : 'running';
  ui.caption.textContent = `${run.id} · ${status}${run.ended ? ' · the path taken is highlighted' : ''}`;
  // Columns by breadth-first depth from the first node; an edge to a placed node goes back.
  const col = new Map([[run.nodes[0].id, 0]]);
  const queue = [run.nodes[0].id];
  while (queue.length) {
    const id = queue.shift();
    for (const e of run.edges) if (e.from === id && !col.has(e.to)) { col.set(e.to, col.get(id) + 1); queue.push(e.to); }
  }
  const rows = new Map();
  const pos = new Map();
  const W = 92, H = 40, DX = 116, DY = 78, X0 = 6, Y0 = 50;
  for (const n of run.nodes) {
    const c = col.get(n.id) ?? 0;
    const r = rows.get(c) || 0;
    rows.set(c, r + 1);
    pos.set(n.id, { x: X0 + c * DX, y: Y0 + r * DY });
  }
  const width = X0 * 2 + Math.max(...[...pos.values()].map((p) => p.x)) + W;
  const height = Y0 + Math.max(...[...pos.values()].map((p) => p.y)) + H + 10;
  const g = svg('svg', { viewBox: `0 0 ${width} ${height}`, role: 'img', 'aria-label': `Execution graph of ${run.id}` });
  g.append(svg('defs', {}, ...['edge', 'taken'].map((k) => svg('marker', { id: `arrow-${k}`, viewBox: '0 0 10 10', refX: 9, refY: 5,
    markerWidth: 7, markerHeight: 7, orient: 'auto-start-reverse', class: `arrow ${k}` }, svg('path', { d: 'M0,0 L10,5 L0,10 z' })))));
  for (const e of run.edges) {
    const a = pos.get(e.from), b = pos.get(e.to);
    if (!a || !b) continue;
    let d;
    if (b.x > a.x) { // forward: from the right side of one to the left side of the other
      const x1 = a.x + W, y1 = a.y + H / 2, x2 = b.x, y2 = b.y + H / 2;
      d = `M${x1},${y1} C${x1 + 24},${y1} ${x2 - 24},${y2} ${x2},${y2}`;
    } else { // back: an arc over the top, higher the further it goes
      const x1 = a.x + W / 2, x2 = b.x + W / 2, y = a.y, lift = 14 + (a.x - b.x) / DX * 14;
      d = `M${x1 - 8},${y} C${x1 - 8},${y - lift * 1.4} ${x2 + 8},${y - lift * 1.4} ${x2 + 8},${y}`;
    }
    const taken = run.taken.has(`${e.from}>${e.to}`);
    g.append(svg('path', { d, class: `edge${taken ? ' taken' : ''}`, 'marker-end': `url(#arrow-${taken ? 'taken' : 'edge'})` }));
  }
  for (const n of run.nodes) {
    const { x, y } = pos.get(n.id);
    const s = run.stats.get(n.id);
    const active = run.current === n.id && !run.ended;
    const cls = active ? (run.paused ? 'paused' : 'active') : s ? 'visited' : 'idle';
    const label = active && run.paused ? 'waiting…' : active ? 'running…' : s ? `${s.visits > 1 ? `${s.visits}× · ` : ''}${ms(s.totalMs)}` : '';
    const words = n.label.split(' ');
    const lines = n.label.length > 12 && words.length > 1 ? [words.slice(0, -1).join(' '), words.at(-1)] : [n.label];
    g.append(svg('g', { class: `node ${cls}`, 'data-node': n.id },
      svg('title', {}, `${n.label}${label ? `: ${label}` : ''}`),
      svg('rect', { x, y, width: W, height: H, rx: 8 }),
      ...lines.map((t, i) => svg('text', { x: x + W / 2, y: y + H / 2 + (i - (lines.length - 1) / 2) * 13 + 4, class: 'label' }, t)),
      svg('text', { x: x + W / 2, y: y + H + 13, class: 'latency' }, label)));
  }
  ui.graph.replaceChildren(g);
}

// ------------------------------------------------------------------ facts and composer

function renderFacts(facts) {
  const changed = Object.keys(facts).filter((k) => state.facts[k] !== facts[k]);
  const first = !Object.keys(state.facts).length;
  state.facts = { ...facts };
  const entries = Object.entries(facts).sort(([a], [b]) => a.localeCompare(b));
  if (!entries.length) {
    ui.facts.replaceChildren(h('p', { class: 'muted small' }, 'No confirmed facts yet. They appear when a tool result confirms them.'));
    return;
  }
  ui.facts.replaceChildren(...entries.map(([k, v]) => h('div', { class: `fact${!first && changed.includes(k) ? ' changed' : ''}`, 'data-key': k },
    h('dt', {}, k), h('dd', {}, v))));
}

function updateComposer() {
  const run = state.active && !state.active.ended ? state.active : null;
  ui.input.disabled = !!run;
  ui.send.hidden = !!run;
  ui.stop.hidden = !run;
  ui.stop.disabled = !!run?.stopping;
  const name = currentAgentName();
  ui.input.placeholder = run?.paused ? 'Waiting for your decision above…'
    : run ? `${name || 'The agent'} is working… (Stop cancels the run)`
      : `${name ? `Ask ${name}…` : 'Write a message…'} (Enter sends, Shift+Enter for a new line)`;
  if (!run && document.activeElement === document.body) ui.input.focus();
}

function autogrow() {
  ui.input.style.height = 'auto';
  ui.input.style.height = `${Math.min(ui.input.scrollHeight, 160)}px`;
}

function closeDrawers() {
  for (const [name, btn] of Object.entries(ui.toggles)) { ui[name].classList.remove('open'); btn.setAttribute('aria-expanded', 'false'); }
  ui.scrim.hidden = true;
}

for (const [name, btn] of Object.entries(ui.toggles)) {
  btn.addEventListener('click', () => {
    const open = !ui[name].classList.contains('open');
    closeDrawers();
    ui[name].classList.toggle('open', open);
    btn.setAttribute('aria-expanded', String(open));
    ui.scrim.hidden = !open;
  });
}
ui.scrim.addEventListener('click', closeDrawers);
document.addEventListener('keydown', (e) => { if (e.key === 'Escape') closeDrawers(); });

ui.form.addEventListener('submit', (e) => {
  e.preventDefault();
  const text = ui.input.value.trim();
  if (text && !state.active) send(text);
});
ui.input.addEventListener('keydown', (e) => {
  if (e.key === 'Enter' && !e.shiftKey && !e.isComposing) { e.preventDefault(); ui.form.requestSubmit(); }
});
ui.input.addEventListener('input', autogrow);
ui.stop.addEventListener('click', async () => {
  const run = state.active;
  if (!run) return;
  run.stopping = true;
  updateComposer();
  try { await api('POST', `/v1/runs/${run.id}/cancel`); } catch (e) {
    run.el.insertBefore(h('p', { class: 'notice error' }, `Could not stop the run: ${e.message}`), run.typing);
    run.stopping = false;
    updateComposer();
  }
});
ui.newConv.addEventListener('click', () => { history.pushState(null, '', location.pathname); showDraft(); ui.input.focus(); });

// ------------------------------------------------------------------ the demo's reset

// A server that routes `POST /v1/demo/reset` (`keel demo`; its served OpenAPI spec says so) gets a
// control for it: after a walk-through or an approved restart, the seeded data comes back without
// a terminal. Conversations and runs stay. Any other server shows nothing.
async function offerDemoReset() {
  const spec = await api('GET', '/v1/openapi.json').catch(() => null);
  ui.demoTools.hidden = !spec?.paths?.['/v1/demo/reset']?.post;
}

ui.resetDemo.addEventListener('click', async () => {
  ui.resetDemo.disabled = true;
  ui.resetStatus.textContent = 'Resetting…';
  try {
    await api('POST', '/v1/demo/reset');
    ui.resetStatus.textContent = 'The demo is back as it was seeded.';
  } catch (e) {
    ui.resetStatus.textContent = `Could not reset the demo: ${e.message}`;
  } finally {
    ui.resetDemo.disabled = false;
  }
});
offerDemoReset();

function route() {
  const id = decodeURIComponent(location.hash.slice(1));
  if (id) openConversation(id); else showDraft();
}
window.addEventListener('hashchange', route);
route();

// Test hook for the browser tests: cut the current event stream as a network failure would, and
// keep it down for `holdMs`; the page then reconnects with Last-Event-ID. `from` asks that
// reconnect for events the page has already shown, as a replaying proxy might: it must drop them.
window.keel = {
  dropStream(holdMs = 0, { from } = {}) {
    const run = state.active;
    if (!run?.ctl) return false;
    run.holdUntil = Date.now() + holdMs;
    run.replayFrom = from;
    run.ctl.abort(new Error('connection dropped (test)'));
    return true;
  },
};
