//! Keel's domain and engine: ids, records and their state machines, events, the storage, model and
//! tool contracts, and the durable agent loop. Knows nothing of HTTP or SQL.
#![forbid(unsafe_code)]

pub mod agent;
pub mod bus;
pub mod clock;
pub mod context;
pub mod domain;
pub mod engine;
pub mod event;
pub mod ids;
pub mod mask;
pub mod metrics;
pub mod model;
pub mod rfc3339;
pub mod store;
pub mod stream;
pub mod tool;
pub mod wire;

pub use domain::*;
pub use event::{Event, EventKind, ToolOutcomeStatus};
pub use ids::{CallId, ConversationId, InterruptId, InvalidId, MessageId, RunId};
