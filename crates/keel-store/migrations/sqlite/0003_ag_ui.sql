-- AG-UI threads and message ids (docs/ag-ui.md).
--
-- An AG-UI client names its conversation with a `threadId` of its own choosing and its messages with
-- ids of its own. A thread id that is not a Keel conversation id is bound here, per user, to the
-- conversation created for it; a client message id is remembered once Keel stored the message, so a
-- client that re-sends its whole history (as AG-UI clients do) does not start the same turn twice.

CREATE TABLE ag_ui_threads (
    user_id          TEXT NOT NULL,
    thread_id        TEXT NOT NULL,
    conversation_id  TEXT NOT NULL REFERENCES conversations (id),
    created_at       TEXT NOT NULL,
    PRIMARY KEY (user_id, thread_id)
);

CREATE TABLE ag_ui_messages (
    conversation_id    TEXT NOT NULL REFERENCES conversations (id),
    client_message_id  TEXT NOT NULL,
    message_id         TEXT NOT NULL,
    PRIMARY KEY (conversation_id, client_message_id)
);
