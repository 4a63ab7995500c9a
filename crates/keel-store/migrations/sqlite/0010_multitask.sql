-- The multitask strategies `enqueue` and `rollback` (docs/langgraph.md, "Multitask strategies").
--
-- Two run statuses: `waiting`, a message queued behind its conversation's active run (the
-- one-active-run index does not cover it and claims do not take it; it becomes `queued` when its
-- turn comes), and `rolled_back`, a finished run whose messages and events were removed (its row,
-- tool calls and interrupts stay, the audit of what it did). A waiting run keeps its message's
-- text in `pending_content` until it starts: the message joins the conversation only then, so
-- the conversation's messages stay in the order their runs ran.
--
-- SQLite cannot change a CHECK constraint in place: the table is rebuilt as migration 8 did (its
-- CHECK written as `=` terms joined by OR, never an IN list, which SQLite checks through a
-- temporary b-tree). The migration runner turns foreign keys off around it and checks them
-- before it commits.

CREATE TABLE runs_new (
    id                    TEXT PRIMARY KEY NOT NULL,
    conversation_id       TEXT NOT NULL REFERENCES conversations (id),
    -- not a foreign key: the run and its user message are written in one transaction, run first
    -- (a waiting run's message is written when the run starts)
    user_message_id       TEXT NOT NULL,
    user_id               TEXT NOT NULL,
    status                TEXT NOT NULL
        CHECK (status = 'queued' OR status = 'running' OR status = 'interrupted' OR status = 'completed'
               OR status = 'failed' OR status = 'cancelled' OR status = 'waiting' OR status = 'rolled_back'),
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
    worker                TEXT,
    pending_content       TEXT
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
CREATE INDEX runs_finished ON runs (updated_at)
    WHERE status = 'completed' OR status = 'failed' OR status = 'cancelled';
-- A conversation's queue, oldest first: what starts next, and whether anything waits at all (a
-- probe of an index that is empty unless messages wait).
CREATE INDEX runs_waiting ON runs (conversation_id, created_at, id) WHERE status = 'waiting';
