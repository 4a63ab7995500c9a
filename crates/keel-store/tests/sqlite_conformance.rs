//! The store conformance suite on SQLite: every case on a fresh database file in its own directory.

use std::sync::Arc;

use keel_core::store::Store;
use keel_store::SqliteStore;
use tempfile::TempDir;

async fn fresh() -> (Arc<dyn Store>, TempDir) {
    let dir = TempDir::new().expect("temp dir");
    let store = SqliteStore::open(&dir.path().join("keel.db")).await.expect("open sqlite");
    (Arc::new(store), dir)
}

keel_store::conformance_tests!(fresh);
