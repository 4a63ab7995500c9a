-- Agents, tools of one's own, ids bound by protocol layers.
--
-- A conversation keeps its agent, and its runs are run by it (NULL: made before agents, the default
-- agent). A tool call counts its attempts: each is committed `executing` before the tool is called,
-- and one cut off by a crash is retried only while attempts remain. Interrupts gain two kinds:
-- `outcome_unknown` (a call was sent and no answer came back) and `tool_call` (a client-side tool).
-- Client-chosen ids (an AG-UI thread id, a client's message id) live in one table of bindings,
-- namespaced by the layer that owns them. The demo's tables move out of Keel's schema: the demo
-- keeps its own.

ALTER TABLE conversations ADD COLUMN agent_id TEXT;
ALTER TABLE runs ADD COLUMN agent_id TEXT;
ALTER TABLE tool_calls ADD COLUMN attempts INTEGER NOT NULL DEFAULT 0;
-- A call already executing was attempted once.
UPDATE tool_calls SET attempts = 1 WHERE started_at IS NOT NULL;

-- SQLite cannot change a CHECK constraint in place: the table is rebuilt.
CREATE TABLE interrupts_new (
    id           TEXT PRIMARY KEY NOT NULL,
    run_id       TEXT NOT NULL REFERENCES runs (id),
    kind         TEXT NOT NULL CHECK (kind IN ('confirm_action', 'select_option', 'provide_input',
                                               'outcome_unknown', 'tool_call')),
    status       TEXT NOT NULL CHECK (status IN ('pending', 'resolved', 'expired', 'cancelled')),
    payload      TEXT NOT NULL CHECK (json_valid(payload)),
    call_ids     TEXT NOT NULL CHECK (json_valid(call_ids)),
    created_at   TEXT NOT NULL,
    expires_at   TEXT NOT NULL,
    decision     TEXT CHECK (decision IS NULL OR json_valid(decision)),
    resolved_by  TEXT,
    resolved_at  TEXT,
    note         TEXT
);
INSERT INTO interrupts_new (id, run_id, kind, status, payload, call_ids, created_at, expires_at, decision,
                            resolved_by, resolved_at, note)
    SELECT id, run_id, kind, status, payload, call_ids, created_at, expires_at, decision, resolved_by,
           resolved_at, note
    FROM interrupts;
DROP TABLE interrupts;
ALTER TABLE interrupts_new RENAME TO interrupts;
CREATE INDEX interrupts_by_run ON interrupts (run_id, status, created_at);
CREATE INDEX interrupts_pending_by_expiry ON interrupts (expires_at) WHERE status = 'pending';

CREATE TABLE bindings (
    namespace    TEXT NOT NULL,
    scope        TEXT NOT NULL,
    external_id  TEXT NOT NULL,
    value        TEXT NOT NULL,
    created_at   TEXT NOT NULL,
    PRIMARY KEY (namespace, scope, external_id)
) WITHOUT ROWID;
INSERT INTO bindings (namespace, scope, external_id, value, created_at)
    SELECT 'ag_ui.thread', user_id, thread_id, conversation_id, created_at FROM ag_ui_threads;
INSERT INTO bindings (namespace, scope, external_id, value, created_at)
    SELECT 'ag_ui.message', conversation_id, client_message_id, message_id, '1970-01-01T00:00:00.000000000Z'
    FROM ag_ui_messages;
DROP TABLE ag_ui_threads;
DROP TABLE ag_ui_messages;

DROP TABLE IF EXISTS error_logs;
DROP TABLE IF EXISTS instances;
