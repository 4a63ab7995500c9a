-- The same constraints, written so that checking them costs no temporary b-tree.
--
-- SQLite evaluates `x IN ('a', 'b', 'c')` — a list of three or more values — by building a
-- temporary b-tree of the list each time the expression runs: a page allocated, zeroed and freed.
-- The CHECK constraints on a run's status, a message's role, a tool call's state and an
-- interrupt's kind and status, and the condition of the one-active-run index, ran that way on
-- every write of those columns (about 75 temporary b-trees per HITL run, ~14% of the server's
-- instructions; docs/benchmarks.md). Written as `=` terms joined by `OR` they accept and refuse
-- exactly the same values and cost a few comparisons.
--
-- SQLite cannot change a CHECK constraint in place: each table is rebuilt (created anew, copied,
-- dropped, renamed, its indexes made again), the procedure SQLite documents for ALTER TABLE.
-- The migration runner turns foreign keys off around it and checks them before it commits.

CREATE TABLE runs_new (
    id                    TEXT PRIMARY KEY NOT NULL,
    conversation_id       TEXT NOT NULL REFERENCES conversations (id),
    -- not a foreign key: the run and its user message are written in one transaction, run first
    user_message_id       TEXT NOT NULL,
    user_id               TEXT NOT NULL,
    status                TEXT NOT NULL
        CHECK (status = 'queued' OR status = 'running' OR status = 'interrupted' OR status = 'completed'
               OR status = 'failed' OR status = 'cancelled'),
    reason                TEXT,
    cancel_on_disconnect  INTEGER NOT NULL DEFAULT 0,
    cancel_requested      INTEGER NOT NULL DEFAULT 0,
    next_sequence         INTEGER NOT NULL DEFAULT 1,
    lease_owner           TEXT,
    lease_expires_at      TEXT,
    checkpoint            TEXT NOT NULL CHECK (json_valid(checkpoint)),
    created_at            TEXT NOT NULL,
    updated_at            TEXT NOT NULL,
    agent_id              TEXT,
    worker                TEXT
);
INSERT INTO runs_new (id, conversation_id, user_message_id, user_id, status, reason, cancel_on_disconnect,
                      cancel_requested, next_sequence, lease_owner, lease_expires_at, checkpoint, created_at,
                      updated_at, agent_id, worker)
    SELECT id, conversation_id, user_message_id, user_id, status, reason, cancel_on_disconnect, cancel_requested,
           next_sequence, lease_owner, lease_expires_at, checkpoint, created_at, updated_at, agent_id, worker
    FROM runs;
DROP TABLE runs;
ALTER TABLE runs_new RENAME TO runs;
CREATE UNIQUE INDEX runs_one_active_per_conversation ON runs (conversation_id)
    WHERE status = 'queued' OR status = 'running' OR status = 'interrupted';
CREATE INDEX runs_by_conversation ON runs (conversation_id, created_at);
-- two values: SQLite compares them in place
CREATE INDEX runs_claimable ON runs (status, lease_expires_at, created_at)
    WHERE status IN ('queued', 'running');
CREATE INDEX runs_by_user ON runs (user_id, created_at DESC, id DESC);

CREATE TABLE messages_new (
    seq              INTEGER PRIMARY KEY AUTOINCREMENT,
    id               TEXT NOT NULL UNIQUE,
    conversation_id  TEXT NOT NULL REFERENCES conversations (id),
    run_id           TEXT REFERENCES runs (id),
    role             TEXT NOT NULL CHECK (role = 'user' OR role = 'assistant' OR role = 'tool'),
    content          TEXT NOT NULL,
    tool_call_id     TEXT,
    created_at       TEXT NOT NULL
);
INSERT INTO messages_new (seq, id, conversation_id, run_id, role, content, tool_call_id, created_at)
    SELECT seq, id, conversation_id, run_id, role, content, tool_call_id, created_at FROM messages;
DROP TABLE messages;
ALTER TABLE messages_new RENAME TO messages;
CREATE INDEX messages_by_conversation ON messages (conversation_id, seq);
CREATE INDEX messages_by_run ON messages (run_id);

CREATE TABLE tool_calls_new (
    seq              INTEGER PRIMARY KEY AUTOINCREMENT,
    id               TEXT NOT NULL UNIQUE,
    run_id           TEXT NOT NULL REFERENCES runs (id),
    conversation_id  TEXT NOT NULL REFERENCES conversations (id),
    name             TEXT NOT NULL,
    args             TEXT NOT NULL CHECK (json_valid(args)),
    state            TEXT NOT NULL
        CHECK (state = 'requested' OR state = 'asking' OR state = 'allowed' OR state = 'denied'
               OR state = 'executing' OR state = 'succeeded' OR state = 'failed' OR state = 'suspended'
               OR state = 'unknown'),
    result           TEXT CHECK (result IS NULL OR json_valid(result)),
    summary          TEXT,
    started_at       TEXT,
    finished_at      TEXT,
    attempts         INTEGER NOT NULL DEFAULT 0
);
INSERT INTO tool_calls_new (seq, id, run_id, conversation_id, name, args, state, result, summary, started_at,
                            finished_at, attempts)
    SELECT seq, id, run_id, conversation_id, name, args, state, result, summary, started_at, finished_at, attempts
    FROM tool_calls;
DROP TABLE tool_calls;
ALTER TABLE tool_calls_new RENAME TO tool_calls;
CREATE INDEX tool_calls_by_run ON tool_calls (run_id, seq);
CREATE INDEX tool_calls_by_conversation ON tool_calls (conversation_id, seq);
CREATE INDEX tool_calls_asking ON tool_calls (name) WHERE state = 'asking';

CREATE TABLE interrupts_new (
    id           TEXT PRIMARY KEY NOT NULL,
    run_id       TEXT NOT NULL REFERENCES runs (id),
    kind         TEXT NOT NULL
        CHECK (kind = 'confirm_action' OR kind = 'select_option' OR kind = 'provide_input'
               OR kind = 'outcome_unknown' OR kind = 'tool_call'),
    status       TEXT NOT NULL
        CHECK (status = 'pending' OR status = 'resolved' OR status = 'expired' OR status = 'cancelled'),
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
