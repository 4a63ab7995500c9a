-- The instance that holds or last held a run's lease (the part of the lease owner token before its
-- last colon). Unlike `lease_owner` it stays when the lease is let go (a pause, the end), so a
-- finished run still says which instance ran it.
ALTER TABLE runs ADD COLUMN worker TEXT;
