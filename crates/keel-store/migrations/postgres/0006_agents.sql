-- Agents, tools of one's own, ids bound by protocol layers (see the SQLite migration of the same
-- number for why each change is here).

ALTER TABLE conversations ADD COLUMN agent_id text COLLATE "C";
ALTER TABLE runs ADD COLUMN agent_id text COLLATE "C";
ALTER TABLE tool_calls ADD COLUMN attempts integer NOT NULL DEFAULT 0;
UPDATE tool_calls SET attempts = 1 WHERE started_at IS NOT NULL;

ALTER TABLE interrupts DROP CONSTRAINT interrupts_kind_check;
ALTER TABLE interrupts ADD CONSTRAINT interrupts_kind_check
    CHECK (kind IN ('confirm_action', 'select_option', 'provide_input', 'outcome_unknown', 'tool_call'));

CREATE TABLE bindings (
    namespace    text COLLATE "C" NOT NULL,
    scope        text COLLATE "C" NOT NULL,
    external_id  text COLLATE "C" NOT NULL,
    value        text COLLATE "C" NOT NULL,
    created_at   timestamptz NOT NULL,
    PRIMARY KEY (namespace, scope, external_id)
);
INSERT INTO bindings (namespace, scope, external_id, value, created_at)
    SELECT 'ag_ui.thread', user_id, thread_id, conversation_id, created_at FROM ag_ui_threads;
INSERT INTO bindings (namespace, scope, external_id, value, created_at)
    SELECT 'ag_ui.message', conversation_id, client_message_id, message_id, 'epoch'::timestamptz FROM ag_ui_messages;
DROP TABLE ag_ui_threads;
DROP TABLE ag_ui_messages;

DROP TABLE IF EXISTS error_logs;
DROP TABLE IF EXISTS instances;
