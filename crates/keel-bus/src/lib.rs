//! Fan-out of committed events across instances.
//!
//! [`RedisBus`] implements [`keel_core::bus::Bus`] over Redis Streams, one stream per run, so a
//! reader on any instance is woken by events committed on any other. Like every bus it is a fast
//! path only: whatever it loses (a full queue, Redis being down, a trimmed stream) the reader
//! re-reads from the store (see `keel_core::stream`).
//!
//! [`conformance`] is the suite every bus passes, run against `LocalBus` and `RedisBus`.
#![forbid(unsafe_code)]

pub mod conformance;
mod redis_bus;

pub use redis_bus::{BusError, RedisBus, RedisBusConfig};
