-- `GET /v1/runs`: a user's runs, newest first, without scanning every run.
CREATE INDEX runs_by_user ON runs (user_id, created_at DESC, id DESC);
