-- The form of an event's stored data (`keel_core::event::DATA_FORMAT`) when it was written: a stream
-- copies stored data of the current form into its frames as it is, and serializes any other again.
-- 0: written before the form was recorded.
ALTER TABLE run_events ADD COLUMN data_format INTEGER NOT NULL DEFAULT 0;
