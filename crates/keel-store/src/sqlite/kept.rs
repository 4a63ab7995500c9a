//! Prepared statements kept by the thread that owns their connection, found by the address of
//! their SQL text.
//!
//! rusqlite's own cache (`prepare_cached`) finds a statement by its text: every use trims the text,
//! hashes it twice with SipHash (to take the statement out and to put it back) and copies it into a
//! new `Arc<str>`. With SQL of a few hundred bytes and some ninety statements per HITL run, that was
//! ~3% of the server's instructions. Here a statement's text is `&'static` (SQL made from constants
//! is made once: `crate::pipeline::static_sql!`), and the statement is found by the text's address
//! and length: the text never moves and is never freed, so no other text can take its address. An
//! in-memory database's connection, shared between threads, uses rusqlite's cache.

use std::cell::RefCell;
use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::ops::{Deref, DerefMut};

use rusqlite::{CachedStatement, Connection, PrepFlags, Statement};

/// The statements one connection keeps, for as long as this lives (it must not outlive the
/// connection, which the lifetime holds it to). One per thread: it is not `Sync`.
#[derive(Default)]
pub struct Kept<'c> {
    statements: RefCell<HashMap<(usize, usize), Statement<'c>, BuildHasherDefault<AddressHasher>>>,
}

/// A connection as a job gets it: the connection, and the statements its thread keeps (`None`
/// where the connection is shared between threads, an in-memory database's: then rusqlite's cache).
pub struct Conn<'k, 'c> {
    conn: &'c Connection,
    kept: Option<&'k Kept<'c>>,
}

impl<'k, 'c> Conn<'k, 'c> {
    pub fn new(conn: &'c Connection, kept: Option<&'k Kept<'c>>) -> Self {
        Self { conn, kept }
    }

    /// The prepared statement for `sql`: one this connection kept, or a new one it keeps once
    /// dropped. A statement in use while the same text is asked for again is prepared a second time.
    pub fn prepare_kept(&self, sql: &'static str) -> rusqlite::Result<KeptStatement<'k, 'c>> {
        let Some(kept) = self.kept else {
            return self.conn.prepare_cached(sql).map(KeptStatement::Cached);
        };
        let key = (sql.as_ptr() as usize, sql.len());
        let found = kept.statements.borrow_mut().remove(&key);
        let statement = match found {
            Some(statement) => statement,
            None => self.conn.prepare_with_flags(sql, PrepFlags::SQLITE_PREPARE_PERSISTENT)?,
        };
        Ok(KeptStatement::Kept { statement: Some(statement), key, kept })
    }
}

impl<'c> Deref for Conn<'_, 'c> {
    type Target = Connection;

    fn deref(&self) -> &Connection {
        self.conn
    }
}

/// A statement in use; back among the kept ones when dropped, its bindings cleared (rusqlite resets
/// a statement at the end of each use, so it is ready for the next).
pub enum KeptStatement<'k, 'c> {
    Kept { statement: Option<Statement<'c>>, key: (usize, usize), kept: &'k Kept<'c> },
    Cached(CachedStatement<'c>),
}

impl<'c> Deref for KeptStatement<'_, 'c> {
    type Target = Statement<'c>;

    fn deref(&self) -> &Statement<'c> {
        match self {
            KeptStatement::Kept { statement, .. } => statement.as_ref().expect("a statement in use"),
            KeptStatement::Cached(statement) => statement,
        }
    }
}

impl<'c> DerefMut for KeptStatement<'_, 'c> {
    fn deref_mut(&mut self) -> &mut Statement<'c> {
        match self {
            KeptStatement::Kept { statement, .. } => statement.as_mut().expect("a statement in use"),
            KeptStatement::Cached(statement) => statement,
        }
    }
}

impl Drop for KeptStatement<'_, '_> {
    fn drop(&mut self) {
        if let KeptStatement::Kept { statement, key, kept } = self {
            if let Some(mut statement) = statement.take() {
                // Its bound values freed now, not at its next use: each one holds a slot of the
                // connection's small-allocation pool (lookaside) until then, and a hundred kept
                // statements holding theirs sent every other allocation of SQLite's to malloc.
                statement.clear_bindings();
                kept.statements.borrow_mut().insert(*key, statement);
            }
        }
    }
}

/// Hashes a key of two words (an address and a length) by multiplying: the keys are distinct
/// addresses, so nothing stronger is needed, and SipHash was the cost this module removes.
#[derive(Default)]
pub struct AddressHasher(u64);

impl Hasher for AddressHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.write_u64(u64::from(b));
        }
    }

    fn write_usize(&mut self, n: usize) {
        self.write_u64(n as u64);
    }

    fn write_u64(&mut self, n: u64) {
        self.0 = (self.0.rotate_left(5) ^ n).wrapping_mul(0x51_7c_c1_b7_27_22_0a_95);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SELECT: &str = "SELECT ?1 + 1";

    #[test]
    fn a_kept_statement_is_prepared_once_and_used_again() {
        let conn = Connection::open_in_memory().unwrap();
        let kept = Kept::default();
        let c = Conn::new(&conn, Some(&kept));
        for n in 0..3_i64 {
            let mut statement = c.prepare_kept(SELECT).unwrap();
            assert_eq!(statement.query_row([n], |r| r.get::<_, i64>(0)).unwrap(), n + 1);
        }
        assert_eq!(kept.statements.borrow().len(), 1, "one statement, kept");
        // the same text at another address is another statement; each gives its own answer
        let other: &'static str = Box::leak(SELECT.to_owned().into_boxed_str());
        let mut a = c.prepare_kept(SELECT).unwrap();
        let mut b = c.prepare_kept(other).unwrap();
        assert_eq!(a.query_row([1_i64], |r| r.get::<_, i64>(0)).unwrap(), 2);
        assert_eq!(b.query_row([5_i64], |r| r.get::<_, i64>(0)).unwrap(), 6);
        drop((a, b));
        assert_eq!(kept.statements.borrow().len(), 2);
    }

    #[test]
    fn a_statement_asked_for_while_in_use_is_prepared_again() {
        let conn = Connection::open_in_memory().unwrap();
        let kept = Kept::default();
        let c = Conn::new(&conn, Some(&kept));
        let mut outer = c.prepare_kept(SELECT).unwrap();
        let mut inner = c.prepare_kept(SELECT).unwrap();
        assert_eq!(outer.query_row([1_i64], |r| r.get::<_, i64>(0)).unwrap(), 2);
        assert_eq!(inner.query_row([2_i64], |r| r.get::<_, i64>(0)).unwrap(), 3);
        drop((inner, outer));
        assert_eq!(kept.statements.borrow().len(), 1, "one kept; the other finalized");
    }

    #[test]
    fn a_shared_connection_uses_the_connections_own_cache() {
        let conn = Connection::open_in_memory().unwrap();
        let c = Conn::new(&conn, None);
        let mut statement = c.prepare_kept(SELECT).unwrap();
        assert_eq!(statement.query_row([41_i64], |r| r.get::<_, i64>(0)).unwrap(), 42);
        assert!(matches!(statement, KeptStatement::Cached(_)));
    }
}
