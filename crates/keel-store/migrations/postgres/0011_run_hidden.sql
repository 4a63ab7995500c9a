-- A run deleted through the LangGraph API (`runs.delete`): hidden from that API from then on, but
-- kept, with its events, tool calls and interrupts, for Keel's audit (`GET /v1/runs/{id}`). NULL for
-- a run shown; only a run that is over is hidden, once.
ALTER TABLE runs ADD COLUMN hidden_at timestamptz;
