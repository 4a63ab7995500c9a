-- The multitask strategies `enqueue` and `rollback` (docs/langgraph.md, "Multitask strategies").
--
-- Two run statuses: `waiting`, a message queued behind its conversation's active run (the
-- one-active-run index does not cover it and claims do not take it; it becomes `queued` when its
-- turn comes), and `rolled_back`, a finished run whose messages and events were removed (its row,
-- tool calls and interrupts stay, the audit of what it did). A waiting run keeps its message's
-- text in `pending_content` until it starts: the message joins the conversation only then, so
-- the conversation's messages stay in the order their runs ran.
ALTER TABLE runs DROP CONSTRAINT runs_status_check;
ALTER TABLE runs ADD CONSTRAINT runs_status_check
    CHECK (status IN ('queued', 'running', 'interrupted', 'completed', 'failed', 'cancelled', 'waiting',
                      'rolled_back'));
ALTER TABLE runs ADD COLUMN pending_content text;

-- A conversation's queue, oldest first: what starts next, and whether anything waits at all (a
-- probe of an index that is empty unless messages wait).
CREATE INDEX runs_waiting ON runs (conversation_id, created_at, id) WHERE status = 'waiting';
