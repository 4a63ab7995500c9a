-- Most of a running run's commits change its row's next sequence, checkpoint and `updated_at`,
-- and leave its status and lease as they are. PostgreSQL can write such an update as a heap-only
-- tuple (HOT: no new entry in any of the table's indexes, the old version pruned from its page)
-- only when no column an index names — as a key or in its condition — changes, and when the row's
-- page has room for the new version.
--
-- The pruner's index (0008) named `updated_at`, so every commit wrote a new entry in each of the
-- table's five other indexes. It now names `finished_at`, which the database keeps equal to
-- `updated_at` once the run is over and NULL before: unchanged by a running run's commits. (Adding
-- a stored generated column rewrites the table once, under its lock: an upgrade of a database
-- with millions of runs takes a while; docs/operations.md, "Upgrades".)
ALTER TABLE runs ADD COLUMN finished_at timestamptz
    GENERATED ALWAYS AS (CASE WHEN status IN ('completed', 'failed', 'cancelled') THEN updated_at END) STORED;
CREATE INDEX runs_finished_at ON runs (finished_at) WHERE finished_at IS NOT NULL;
DROP INDEX runs_finished;

-- Room on each page for the new versions of its rows (new pages only; a run's row is updated
-- about six times in its life).
ALTER TABLE runs SET (fillfactor = 80);
