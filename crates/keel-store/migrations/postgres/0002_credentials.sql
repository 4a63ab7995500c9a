-- Credentials: API keys and stream tickets. Only SHA-256 hashes of the secrets are stored; the
-- secret itself is shown once, when it is made.

CREATE TABLE api_keys (
    id          text COLLATE "C" PRIMARY KEY,
    user_id     text COLLATE "C" NOT NULL REFERENCES users (id),
    key_hash    text COLLATE "C" NOT NULL UNIQUE,
    created_at  timestamptz NOT NULL,
    revoked_at  timestamptz
);
CREATE INDEX api_keys_by_user ON api_keys (user_id);

-- Short-lived, single-use tickets that let an EventSource (which can't send headers) open a stream
-- without a long-lived key in its URL. `run_id` is the run whose events it opens; NULL for a
-- WebSocket connection ticket.
CREATE TABLE stream_tickets (
    ticket_hash  text COLLATE "C" PRIMARY KEY,
    user_id      text COLLATE "C" NOT NULL,
    scope        text NOT NULL CHECK (scope IN ('run_events', 'websocket')),
    run_id       text COLLATE "C",
    expires_at   timestamptz NOT NULL,
    used_at      timestamptz
);
CREATE INDEX stream_tickets_by_expiry ON stream_tickets (expires_at);
