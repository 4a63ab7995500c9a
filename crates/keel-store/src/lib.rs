//! Keel's storage backends and the conformance suite every backend passes.
#![forbid(unsafe_code)]

pub mod conformance;
mod postgres;
pub mod seed;
mod sqlite;

pub use postgres::PostgresStore;
pub use sqlite::SqliteStore;
