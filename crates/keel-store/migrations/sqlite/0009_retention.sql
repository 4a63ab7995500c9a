-- Retention (docs/operations.md, "Retention"): the events of finished runs older than a policy's
-- duration are deleted in bounded batches; the run, its messages, tool calls and interrupts stay.
-- A run that lost events has a row here with the first sequence it still holds (its next sequence
-- once all are gone), so a replay of the pruned range is answered 410 EVENTS_PRUNED with it.
CREATE TABLE run_prunes (
    run_id               TEXT PRIMARY KEY NOT NULL REFERENCES runs (id),
    first_held_sequence  INTEGER NOT NULL CHECK (first_held_sequence >= 1),
    pruned_at            TEXT NOT NULL
) WITHOUT ROWID;

-- The pruner's scan: finished runs by the time they ended (a run's last change). Partial, so the
-- commits of running runs, which change updated_at at every step, never touch it.
CREATE INDEX runs_finished ON runs (updated_at)
    WHERE status = 'completed' OR status = 'failed' OR status = 'cancelled';
