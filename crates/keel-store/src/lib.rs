//! Keel's storage backends and the conformance suite every backend passes.
#![forbid(unsafe_code)]

pub mod conformance;
mod fence;
mod pipeline;
mod postgres;
mod sqlite;

pub use postgres::{CommitStats, PostgresOptions, PostgresStore};
pub use sqlite::{backup as sqlite_backup, restore as sqlite_restore, Copied, SqliteOptions, SqliteStore};

/// The drivers, for programs that keep tables of their own beside Keel's
/// ([`SqliteStore::write_with`], [`PostgresStore::pool`]): the same versions the stores use.
pub use {rusqlite, sqlx};
