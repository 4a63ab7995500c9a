-- A run's events are its busiest rows: about 26 in a HITL run, each of which made PostgreSQL check
-- its foreign key to `runs` — a lookup of the run's row, locked, run from a trigger, once per
-- event. Measured (docs/benchmarks.md, "Twelfth session"): 10% of the database's CPU per run.
--
-- The reference needs no check: events are written only by the statement (or, on the lone path,
-- the transaction) that fences their run — an `UPDATE` of the run's row, which exists, is locked
-- until the write commits, and is never deleted — and the events are numbered from the sequence
-- that update reserved. A commit for a run that does not exist writes nothing (`NotFound`).
-- The other foreign keys stay: they are checked once or twice a run.
ALTER TABLE run_events DROP CONSTRAINT IF EXISTS run_events_run_id_fkey;
