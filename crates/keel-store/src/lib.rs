//! Keel's storage backends and the conformance suite every backend passes.
#![forbid(unsafe_code)]

pub mod conformance;
pub mod seed;
mod sqlite;

pub use sqlite::SqliteStore;
