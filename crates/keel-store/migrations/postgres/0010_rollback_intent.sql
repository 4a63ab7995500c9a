-- A rollback's intent, written with the cancel that starts it (multitask `rollback`, LangGraph's
-- cancel with `action=rollback`): whoever finds the run ended — the caller, recovery, a sweep —
-- rolls it back, so a crash between the cancel and the rollback leaves nothing half done. The
-- rollback clears it: the index holds only the rollbacks not done yet.
ALTER TABLE runs ADD COLUMN roll_back_requested boolean NOT NULL DEFAULT false;
CREATE INDEX runs_roll_back_requested ON runs (id) WHERE roll_back_requested;
