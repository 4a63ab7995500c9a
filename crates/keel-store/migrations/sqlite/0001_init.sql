-- Keel's SQLite schema.
--
-- Timestamps are TEXT in RFC 3339, UTC, with exactly nine fractional digits and a `Z`
-- (`2030-01-01T00:00:00.000000000Z`): they compare and sort correctly as strings, so `expires_at <= ?`
-- works in SQL, and they round-trip a chrono timestamp without loss. JSON columns are TEXT.

CREATE TABLE conversations (
    id          TEXT PRIMARY KEY NOT NULL,
    user_id     TEXT NOT NULL,
    title       TEXT NOT NULL,
    version     INTEGER NOT NULL DEFAULT 0,
    created_at  TEXT NOT NULL
);
CREATE INDEX conversations_by_user ON conversations (user_id, created_at DESC, id DESC);

CREATE TABLE runs (
    id                    TEXT PRIMARY KEY NOT NULL,
    conversation_id       TEXT NOT NULL REFERENCES conversations (id),
    -- not a foreign key: the run and its user message are written in one transaction, run first
    user_message_id       TEXT NOT NULL,
    user_id               TEXT NOT NULL,
    status                TEXT NOT NULL
        CHECK (status IN ('queued', 'running', 'interrupted', 'completed', 'failed', 'cancelled')),
    reason                TEXT,
    cancel_on_disconnect  INTEGER NOT NULL DEFAULT 0,
    cancel_requested      INTEGER NOT NULL DEFAULT 0,
    next_sequence         INTEGER NOT NULL DEFAULT 1,
    lease_owner           TEXT,
    lease_expires_at      TEXT,
    checkpoint            TEXT NOT NULL CHECK (json_valid(checkpoint)),
    created_at            TEXT NOT NULL,
    updated_at            TEXT NOT NULL
);
-- One active run per conversation, enforced by the database.
CREATE UNIQUE INDEX runs_one_active_per_conversation ON runs (conversation_id)
    WHERE status IN ('queued', 'running', 'interrupted');
CREATE INDEX runs_by_conversation ON runs (conversation_id, created_at);
-- claim_runs: queued runs, and running runs whose lease ran out.
CREATE INDEX runs_claimable ON runs (status, lease_expires_at, created_at)
    WHERE status IN ('queued', 'running');

CREATE TABLE messages (
    seq              INTEGER PRIMARY KEY AUTOINCREMENT,
    id               TEXT NOT NULL UNIQUE,
    conversation_id  TEXT NOT NULL REFERENCES conversations (id),
    run_id           TEXT REFERENCES runs (id),
    role             TEXT NOT NULL CHECK (role IN ('user', 'assistant', 'tool')),
    content          TEXT NOT NULL,
    tool_call_id     TEXT,
    created_at       TEXT NOT NULL
);
CREATE INDEX messages_by_conversation ON messages (conversation_id, seq);
CREATE INDEX messages_by_run ON messages (run_id);

CREATE TABLE facts (
    conversation_id  TEXT NOT NULL REFERENCES conversations (id),
    key              TEXT NOT NULL,
    value            TEXT NOT NULL,
    source           TEXT NOT NULL CHECK (source IN ('tool_result', 'user_confirmed')),
    updated_at       TEXT NOT NULL,
    PRIMARY KEY (conversation_id, key)
) WITHOUT ROWID;

CREATE TABLE summaries (
    conversation_id     TEXT PRIMARY KEY NOT NULL REFERENCES conversations (id),
    through_message_id  TEXT NOT NULL,
    text                TEXT NOT NULL
);

CREATE TABLE run_events (
    run_id      TEXT NOT NULL REFERENCES runs (id),
    sequence    INTEGER NOT NULL CHECK (sequence >= 1),
    type        TEXT NOT NULL,
    data        TEXT NOT NULL CHECK (json_valid(data)),
    created_at  TEXT NOT NULL,
    PRIMARY KEY (run_id, sequence)
) WITHOUT ROWID;

CREATE TABLE interrupts (
    id           TEXT PRIMARY KEY NOT NULL,
    run_id       TEXT NOT NULL REFERENCES runs (id),
    kind         TEXT NOT NULL CHECK (kind IN ('confirm_action', 'select_option', 'provide_input')),
    status       TEXT NOT NULL CHECK (status IN ('pending', 'resolved', 'expired', 'cancelled')),
    payload      TEXT NOT NULL CHECK (json_valid(payload)),
    call_ids     TEXT NOT NULL CHECK (json_valid(call_ids)),
    created_at   TEXT NOT NULL,
    expires_at   TEXT NOT NULL,
    decision     TEXT CHECK (decision IS NULL OR json_valid(decision)),
    resolved_by  TEXT,
    resolved_at  TEXT
);
CREATE INDEX interrupts_by_run ON interrupts (run_id, status, created_at);
-- due_interrupts
CREATE INDEX interrupts_pending_by_expiry ON interrupts (expires_at) WHERE status = 'pending';

CREATE TABLE tool_calls (
    seq              INTEGER PRIMARY KEY AUTOINCREMENT,
    id               TEXT NOT NULL UNIQUE,
    run_id           TEXT NOT NULL REFERENCES runs (id),
    conversation_id  TEXT NOT NULL REFERENCES conversations (id),
    name             TEXT NOT NULL,
    args             TEXT NOT NULL CHECK (json_valid(args)),
    state            TEXT NOT NULL CHECK (state IN ('requested', 'asking', 'allowed', 'denied', 'executing',
                                                    'succeeded', 'failed', 'suspended', 'unknown')),
    result           TEXT CHECK (result IS NULL OR json_valid(result)),
    summary          TEXT,
    started_at       TEXT,
    finished_at      TEXT
);
CREATE INDEX tool_calls_by_run ON tool_calls (run_id, seq);
CREATE INDEX tool_calls_by_conversation ON tool_calls (conversation_id, seq);
-- calls of a tool waiting for a human (asking_calls)
CREATE INDEX tool_calls_asking ON tool_calls (name) WHERE state = 'asking';

CREATE TABLE idempotency_keys (
    user_id       TEXT NOT NULL,
    key           TEXT NOT NULL,
    request_hash  TEXT NOT NULL,
    state         TEXT NOT NULL CHECK (state IN ('in_flight', 'done')),
    status        INTEGER,
    response      TEXT CHECK (response IS NULL OR json_valid(response)),
    expires_at    TEXT NOT NULL,
    PRIMARY KEY (user_id, key)
) WITHOUT ROWID;

CREATE TABLE users (
    id    TEXT PRIMARY KEY NOT NULL,
    role  TEXT NOT NULL CHECK (role IN ('viewer', 'operator', 'admin'))
);
