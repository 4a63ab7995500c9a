//! The JSON shapes of responses that are not a domain record as it is (see DESIGN.md, "The
//! contract, by example"). They live in [`keel_core::wire`], shared with the client; fields may be
//! added, none may be renamed.

pub use keel_core::wire::{MessageAccepted, RunBody, RunList, RunSummary, ToolCallBody, TurnBody};
