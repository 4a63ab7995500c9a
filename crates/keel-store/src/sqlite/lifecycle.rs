//! The data lifecycle on SQLite: retention (pruning the events of finished runs, then giving the
//! freed pages back), the exports' reads, and online backup and restore of the database file.

use std::path::Path;
use std::time::Duration;

use keel_core::domain::{Conversation, Run, Timestamp};
use keel_core::ids::{ConversationId, RunId};
use keel_core::store::{PruneRule, Pruned, StoreError, StoreResult};
use rusqlite::{params, Connection, OpenFlags, OptionalExtension};

use super::commit::ts;
use super::db::db;
use super::rows::{conversation_from, exec, many, one, run_from};
use super::SqliteStore;

/// The statuses whose runs retention covers (`RunStatus::is_terminal`).
const FINISHED: &str = "(r.status = 'completed' OR r.status = 'failed' OR r.status = 'cancelled')";

/// The runs `rule` covers that still hold events: (id, first held sequence, next sequence), the
/// runs that ended first first. `?1` the cutoff, `?2` the agent or NULL, `?3` the JSON array of
/// agents excluded when `?2` is NULL, `?4` the lower bound or NULL, `?5` the limit.
fn covered_sql(limit: bool) -> &'static str {
    static SQL: std::sync::LazyLock<[String; 2]> =
        std::sync::LazyLock::new(|| [covered_sql_text(false), covered_sql_text(true)]);
    &SQL[usize::from(limit)]
}

fn covered_sql_text(limit: bool) -> String {
    format!(
        "SELECT r.id, COALESCE(p.first_held_sequence, 1) AS first_held, r.next_sequence \
         FROM runs r LEFT JOIN run_prunes p ON p.run_id = r.id \
         WHERE {FINISHED} AND r.updated_at < ?1 AND (?4 IS NULL OR r.updated_at >= ?4) \
           AND (CASE WHEN ?2 IS NULL \
                     THEN r.agent_id IS NULL OR r.agent_id NOT IN (SELECT value FROM json_each(?3)) \
                     ELSE r.agent_id = ?2 END) \
           AND COALESCE(p.first_held_sequence, 1) < r.next_sequence \
         ORDER BY r.updated_at, r.id{}",
        if limit { " LIMIT ?5" } else { "" }
    )
}

fn except_json(rule: &PruneRule) -> StoreResult<String> {
    serde_json::to_string(&rule.except_agents).map_err(|e| StoreError::Backend(format!("encode agents: {e}")))
}

impl SqliteStore {
    pub(super) async fn prune(&self, rule: &PruneRule, max_events: u32, dry_run: bool) -> StoreResult<Pruned> {
        let cutoff = ts(&rule.finished_before);
        let after = rule.finished_after.as_ref().map(ts);
        let agent = rule.agent.clone();
        let except = except_json(rule)?;
        if dry_run {
            return self
                .db
                .read(move |c| {
                    let runs = many(
                        c,
                        "count prunable events",
                        covered_sql(false),
                        params![cutoff, agent, except, after],
                        |r| {
                            let first: i64 = r.get(1).map_err(db("count prunable events"))?;
                            let next: i64 = r.get(2).map_err(db("count prunable events"))?;
                            Ok(next - first)
                        },
                    )?;
                    Ok(Pruned { runs: runs.len() as u64, events: runs.iter().map(|n| *n as u64).sum() })
                })
                .await;
        }
        let now = ts(&chrono::Utc::now());
        let pruned = self
            .db
            .write(move |c| {
                // The same answer each time it runs on the same state: the group commit may run it again.
                let covered: Vec<(String, i64, i64)> = many(
                    c,
                    "find prunable runs",
                    covered_sql(true),
                    params![cutoff, agent, except, after, i64::from(max_events)],
                    |r| {
                        let fail = db("find prunable runs");
                        Ok((
                            r.get(0).map_err(fail)?,
                            r.get(1).map_err(db("find prunable runs"))?,
                            r.get(2).map_err(db("find prunable runs"))?,
                        ))
                    },
                )?;
                let mut budget = i64::from(max_events);
                let mut pruned = Pruned::default();
                for (run_id, first_held, next) in covered {
                    if budget <= 0 {
                        break;
                    }
                    // The oldest events first: what is held stays one contiguous range.
                    let upto = next.min(first_held + budget);
                    let deleted = exec(
                        c,
                        "prune events",
                        "DELETE FROM run_events WHERE run_id = ? AND sequence < ?",
                        params![run_id, upto],
                    )?;
                    exec(
                        c,
                        "record a prune",
                        "INSERT INTO run_prunes (run_id, first_held_sequence, pruned_at) VALUES (?1, ?2, ?3) \
                         ON CONFLICT (run_id) DO UPDATE SET first_held_sequence = ?2, pruned_at = ?3",
                        params![run_id, upto, now],
                    )?;
                    budget -= upto - first_held;
                    pruned.runs += 1;
                    pruned.events += deleted as u64;
                }
                Ok(pruned)
            })
            .await?;
        if pruned.events > 0 {
            self.reclaim().await?;
        }
        Ok(pruned)
    }

    /// Gives the pages a prune freed back to the file system, where the database was made with
    /// `auto_vacuum = INCREMENTAL` (every database Keel creates); one made before keeps them on its
    /// free list, for the next writes to reuse.
    async fn reclaim(&self) -> StoreResult<()> {
        self.db
            .write(|c| {
                let mode: i64 = c.query_row("PRAGMA auto_vacuum", [], |r| r.get(0)).map_err(db("read auto_vacuum"))?;
                if mode == 2 {
                    // One page freed per step: stepped to the end.
                    let mut vacuum = c.prepare("PRAGMA incremental_vacuum").map_err(db("incremental vacuum"))?;
                    let mut steps = vacuum.query([]).map_err(db("incremental vacuum"))?;
                    while steps.next().map_err(db("incremental vacuum"))?.is_some() {}
                }
                Ok(())
            })
            .await
    }

    pub(super) async fn first_held(&self, run_id: &RunId) -> StoreResult<Option<i64>> {
        let id = run_id.to_owned();
        self.db
            .read(move |c| {
                one(
                    c,
                    "read the first held event",
                    "SELECT first_held_sequence FROM run_prunes WHERE run_id = ?",
                    [id.as_str()],
                    |r| r.get(0).map_err(db("read the first held event")),
                )
            })
            .await
    }

    pub(super) async fn conversation_runs(&self, conversation_id: &ConversationId) -> StoreResult<Vec<Run>> {
        let id = conversation_id.to_owned();
        self.db
            .read(move |c| {
                many(
                    c,
                    "list a conversation's runs",
                    "SELECT * FROM runs WHERE conversation_id = ? ORDER BY created_at, id",
                    [id.as_str()],
                    run_from,
                )
            })
            .await
    }

    pub(super) async fn newest_runs(&self, conversation_id: &ConversationId, limit: u32) -> StoreResult<Vec<Run>> {
        let id = conversation_id.to_owned();
        self.db
            .read(move |c| {
                many(
                    c,
                    "list a conversation's newest runs",
                    "SELECT * FROM runs WHERE conversation_id = ? ORDER BY created_at DESC, id DESC LIMIT ?",
                    params![id.as_str(), limit],
                    run_from,
                )
            })
            .await
    }

    pub(super) async fn conversations_for(
        &self,
        user_id: Option<&str>,
        since: Option<Timestamp>,
    ) -> StoreResult<Vec<Conversation>> {
        let user_id = user_id.map(str::to_owned);
        let since = since.as_ref().map(ts);
        self.db
            .read(move |c| {
                many(
                    c,
                    "find conversations",
                    "SELECT * FROM conversations c WHERE (?1 IS NULL OR c.user_id = ?1) \
                     AND (?2 IS NULL OR EXISTS (SELECT 1 FROM runs r WHERE r.conversation_id = c.id AND r.updated_at >= ?2)) \
                     ORDER BY c.created_at, c.id",
                    params![user_id, since],
                    conversation_from,
                )
            })
            .await
    }
}

/// How a backup or a restore went.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Copied {
    /// The database's pages (of `page_size` bytes) copied.
    pub pages: i64,
    pub page_size: i64,
}

const BUSY: Duration = Duration::from_secs(5);

fn file_error(op: &'static str) -> impl Fn(rusqlite::Error) -> StoreError {
    move |e| StoreError::Backend(format!("{op}: {e}"))
}

/// Copies the database at `database` into a new file `to` with SQLite's online backup API, while
/// a server may be writing it: the copy is one read transaction, a consistent snapshot of every
/// commit before it began, and writers go on meanwhile (WAL). The copy is written beside `to` and
/// renamed into place once checked, so `to` is never a partial database. Refuses to overwrite.
pub fn backup(database: &Path, to: &Path) -> StoreResult<Copied> {
    if to.exists() {
        return Err(StoreError::Backend(format!("backup: {} exists; name a new file", to.display())));
    }
    if !database.exists() {
        return Err(StoreError::Backend(format!("backup: there is no database at {}", database.display())));
    }
    let fail = file_error("backup");
    let source =
        Connection::open_with_flags(database, OpenFlags::SQLITE_OPEN_READ_ONLY | OpenFlags::SQLITE_OPEN_NO_MUTEX)
            .map_err(&fail)?;
    source.busy_timeout(BUSY).map_err(&fail)?;
    let partial = to.with_extension("partial");
    let _ = std::fs::remove_file(&partial);
    let copied = (|| {
        let mut target = Connection::open(&partial).map_err(&fail)?;
        copy(&source, &mut target).map_err(&fail)?;
        check(&target, "backup")?;
        // One file: the copy keeps the source's WAL mode, which would leave its pages in a -wal
        // file beside it until the first checkpoint.
        target.execute_batch("PRAGMA journal_mode = DELETE").map_err(&fail)?;
        let pages = pages(&target).map_err(&fail)?;
        target.close().map_err(|(_, e)| fail(e))?;
        Ok::<_, StoreError>(pages)
    })();
    match copied {
        Ok(pages) => {
            std::fs::rename(&partial, to).map_err(|e| StoreError::Backend(format!("backup: {e}")))?;
            Ok(pages)
        }
        Err(e) => {
            let _ = std::fs::remove_file(&partial);
            Err(e)
        }
    }
}

/// Replaces the database at `database` with the backup `from`. Refused while any process has the
/// database open (a server): the database is locked exclusively first, and the copy is written
/// under that lock, so nobody sees it half-restored. The backup must be a Keel database; the next
/// open upgrades it if it is older than this binary.
pub fn restore(from: &Path, database: &Path) -> StoreResult<Copied> {
    let fail = file_error("restore");
    let source = Connection::open_with_flags(from, OpenFlags::SQLITE_OPEN_READ_ONLY | OpenFlags::SQLITE_OPEN_NO_MUTEX)
        .map_err(&fail)?;
    check(&source, "restore")?;
    let keel: Option<i64> = source
        .query_row("SELECT max(version) FROM _sqlx_migrations", [], |r| r.get(0))
        .optional()
        .map_err(|_| StoreError::Backend(format!("restore: {} is not a Keel database", from.display())))?
        .flatten();
    if keel.is_none() {
        return Err(StoreError::Backend(format!("restore: {} is not a Keel database", from.display())));
    }
    if let Some(dir) = database.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(|e| StoreError::Backend(format!("restore: {e}")))?;
    }
    let mut target = Connection::open(database).map_err(&fail)?;
    // An exclusive lock, kept until the connection closes: taken at once or not at all. A server
    // (any connection in WAL mode) holds a shared lock for as long as it has the database open.
    target.execute_batch("PRAGMA locking_mode = EXCLUSIVE; BEGIN EXCLUSIVE; COMMIT;").map_err(|e| {
        match e.sqlite_error_code() {
            Some(rusqlite::ErrorCode::DatabaseBusy | rusqlite::ErrorCode::DatabaseLocked) => StoreError::Backend(
                format!("restore: {} is in use (is a server running on it?); stop it first", database.display()),
            ),
            _ => fail(e),
        }
    })?;
    copy(&source, &mut target).map_err(&fail)?;
    check(&target, "restore")?;
    let pages = pages(&target).map_err(&fail)?;
    target.close().map_err(|(_, e)| fail(e))?;
    Ok(pages)
}

/// Every page in one step: one read transaction on the source, so the copy is one snapshot. (Steps
/// of a few pages would start over whenever another process writes the source between them.)
fn copy(source: &Connection, target: &mut Connection) -> rusqlite::Result<()> {
    let backup = rusqlite::backup::Backup::new(source, target)?;
    loop {
        match backup.step(-1)? {
            rusqlite::backup::StepResult::Done => return Ok(()),
            // Busy or locked: a writer holds what the copy needs for a moment
            _ => std::thread::sleep(Duration::from_millis(20)),
        }
    }
}

fn check(conn: &Connection, op: &'static str) -> StoreResult<()> {
    let answer: String = conn
        .query_row("PRAGMA quick_check", [], |r| r.get(0))
        .map_err(|e| StoreError::Backend(format!("{op}: {e}")))?;
    if answer != "ok" {
        return Err(StoreError::Backend(format!("{op}: the copy is damaged ({answer})")));
    }
    Ok(())
}

fn pages(conn: &Connection) -> rusqlite::Result<Copied> {
    Ok(Copied {
        pages: conn.query_row("PRAGMA page_count", [], |r| r.get(0))?,
        page_size: conn.query_row("PRAGMA page_size", [], |r| r.get(0))?,
    })
}
