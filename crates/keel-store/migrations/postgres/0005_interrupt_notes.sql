-- What the human who decided an interrupt wrote with the decision (masked like the decision).
ALTER TABLE interrupts ADD COLUMN note TEXT;
