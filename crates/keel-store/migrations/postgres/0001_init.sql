-- Keel's Postgres schema: the tables of the SQLite schema (migrations/sqlite/0001_init.sql), with
-- Postgres types.
--
-- Timestamps are timestamptz (microsecond precision: the store truncates the nanoseconds of the
-- times it is given), JSON columns are jsonb, integers are bigint, booleans are boolean. Ids and
-- keys are text in the "C" collation, so they sort by their bytes as in SQLite and in Rust, whatever
-- the database's collation.

CREATE TABLE conversations (
    id          text COLLATE "C" PRIMARY KEY,
    user_id     text COLLATE "C" NOT NULL,
    title       text NOT NULL,
    version     bigint NOT NULL DEFAULT 0,
    created_at  timestamptz NOT NULL
);
CREATE INDEX conversations_by_user ON conversations (user_id, created_at DESC, id DESC);

CREATE TABLE runs (
    id                    text COLLATE "C" PRIMARY KEY,
    conversation_id       text COLLATE "C" NOT NULL REFERENCES conversations (id),
    -- not a foreign key: the run and its user message are written in one transaction, run first
    user_message_id       text COLLATE "C" NOT NULL,
    user_id               text COLLATE "C" NOT NULL,
    status                text NOT NULL
        CHECK (status IN ('queued', 'running', 'interrupted', 'completed', 'failed', 'cancelled')),
    reason                text,
    cancel_on_disconnect  boolean NOT NULL DEFAULT false,
    cancel_requested      boolean NOT NULL DEFAULT false,
    next_sequence         bigint NOT NULL DEFAULT 1,
    lease_owner           text,
    lease_expires_at      timestamptz,
    checkpoint            jsonb NOT NULL,
    created_at            timestamptz NOT NULL,
    updated_at            timestamptz NOT NULL
);
-- One active run per conversation, enforced by the database.
CREATE UNIQUE INDEX runs_one_active_per_conversation ON runs (conversation_id)
    WHERE status IN ('queued', 'running', 'interrupted');
CREATE INDEX runs_by_conversation ON runs (conversation_id, created_at);
-- claim_runs: queued runs, and running runs whose lease ran out, oldest first.
CREATE INDEX runs_claimable ON runs (status, lease_expires_at, created_at)
    WHERE status IN ('queued', 'running');

CREATE TABLE messages (
    seq              bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    id               text COLLATE "C" NOT NULL UNIQUE,
    conversation_id  text COLLATE "C" NOT NULL REFERENCES conversations (id),
    run_id           text COLLATE "C" REFERENCES runs (id),
    role             text NOT NULL CHECK (role IN ('user', 'assistant', 'tool')),
    content          text NOT NULL,
    tool_call_id     text COLLATE "C",
    created_at       timestamptz NOT NULL
);
CREATE INDEX messages_by_conversation ON messages (conversation_id, seq);
CREATE INDEX messages_by_run ON messages (run_id);

CREATE TABLE facts (
    conversation_id  text COLLATE "C" NOT NULL REFERENCES conversations (id),
    key              text COLLATE "C" NOT NULL,
    value            text NOT NULL,
    source           text NOT NULL CHECK (source IN ('tool_result', 'user_confirmed')),
    updated_at       timestamptz NOT NULL,
    PRIMARY KEY (conversation_id, key)
);

CREATE TABLE summaries (
    conversation_id     text COLLATE "C" PRIMARY KEY REFERENCES conversations (id),
    through_message_id  text COLLATE "C" NOT NULL,
    text                text NOT NULL
);

CREATE TABLE run_events (
    run_id      text COLLATE "C" NOT NULL REFERENCES runs (id),
    sequence    bigint NOT NULL CHECK (sequence >= 1),
    type        text NOT NULL,
    data        jsonb NOT NULL,
    created_at  timestamptz NOT NULL,
    PRIMARY KEY (run_id, sequence)
);

CREATE TABLE interrupts (
    id           text COLLATE "C" PRIMARY KEY,
    run_id       text COLLATE "C" NOT NULL REFERENCES runs (id),
    kind         text NOT NULL CHECK (kind IN ('confirm_action', 'select_option', 'provide_input')),
    status       text NOT NULL CHECK (status IN ('pending', 'resolved', 'expired', 'cancelled')),
    payload      jsonb NOT NULL,
    call_ids     jsonb NOT NULL,
    created_at   timestamptz NOT NULL,
    expires_at   timestamptz NOT NULL,
    decision     jsonb,
    resolved_by  text,
    resolved_at  timestamptz
);
CREATE INDEX interrupts_by_run ON interrupts (run_id, status, created_at);
-- due_interrupts
CREATE INDEX interrupts_pending_by_expiry ON interrupts (expires_at) WHERE status = 'pending';

CREATE TABLE tool_calls (
    seq              bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    id               text COLLATE "C" NOT NULL UNIQUE,
    run_id           text COLLATE "C" NOT NULL REFERENCES runs (id),
    conversation_id  text COLLATE "C" NOT NULL REFERENCES conversations (id),
    name             text NOT NULL,
    args             jsonb NOT NULL,
    state            text NOT NULL CHECK (state IN ('requested', 'asking', 'allowed', 'denied', 'executing',
                                                    'succeeded', 'failed', 'suspended', 'unknown')),
    result           jsonb,
    summary          text,
    started_at       timestamptz,
    finished_at      timestamptz
);
CREATE INDEX tool_calls_by_run ON tool_calls (run_id, seq);
CREATE INDEX tool_calls_by_conversation ON tool_calls (conversation_id, seq);
-- calls of a tool waiting for a human (asking_calls)
CREATE INDEX tool_calls_asking ON tool_calls (name) WHERE state = 'asking';

CREATE TABLE idempotency_keys (
    user_id       text COLLATE "C" NOT NULL,
    key           text COLLATE "C" NOT NULL,
    request_hash  text NOT NULL,
    state         text NOT NULL CHECK (state IN ('in_flight', 'done')),
    status        bigint,
    response      jsonb,
    expires_at    timestamptz NOT NULL,
    PRIMARY KEY (user_id, key)
);

CREATE TABLE users (
    id    text COLLATE "C" PRIMARY KEY,
    role  text NOT NULL CHECK (role IN ('viewer', 'operator', 'admin'))
);
