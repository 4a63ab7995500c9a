-- Retention (docs/operations.md, "Retention"): the events of finished runs older than a policy's
-- duration are deleted in bounded batches; the run, its messages, tool calls and interrupts stay.
-- A run that lost events has a row here with the first sequence it still holds (its next sequence
-- once all are gone), so a replay of the pruned range is answered 410 EVENTS_PRUNED with it.
CREATE TABLE run_prunes (
    run_id               text COLLATE "C" PRIMARY KEY REFERENCES runs (id),
    first_held_sequence  bigint NOT NULL CHECK (first_held_sequence >= 1),
    pruned_at            timestamptz NOT NULL
);

-- The pruner's scan: finished runs by the time they ended (a run's last change). Partial, so the
-- commits of running runs, which change updated_at at every step, never touch it.
CREATE INDEX runs_finished ON runs (updated_at)
    WHERE status IN ('completed', 'failed', 'cancelled');
