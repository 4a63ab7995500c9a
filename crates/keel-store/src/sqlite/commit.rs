//! SQLite's side of the commit pipeline (`crate::pipeline`): its [`Tx`] over the writer thread's
//! connection, inside the writer's transaction, and the encodings SQLite stores (timestamps as
//! fixed-width text, JSON as text).

use std::sync::{Arc, LazyLock};

use keel_core::domain::Timestamp;
use keel_core::event::{Event, EventKind, DATA_FORMAT};
use keel_core::ids::RunId;
use keel_core::store::{StoreError, StoreResult};
use rusqlite::ToSql;
use serde::Serialize;

pub use crate::pipeline::ACTIVE;
use crate::pipeline::{event_data, numbered, Arg, Cell, DbError, Dialect, Encoded, Tx, Ty};

use super::db::{insert, is_unique_violation};
use super::kept::Conn;
use super::rows::exec_or;

/// Fixed width, UTC, nanoseconds: sorts as text, round-trips exactly.
pub fn ts(t: &Timestamp) -> String {
    keel_core::rfc3339::format(t, keel_core::rfc3339::Fraction::Nanos).as_str().to_owned()
}

pub fn opt_ts(t: &Option<Timestamp>) -> Option<String> {
    t.as_ref().map(ts)
}

pub fn json<T: Serialize + ?Sized>(what: &'static str, value: &T) -> StoreResult<String> {
    serde_json::to_string(value).map_err(|e| StoreError::Backend(format!("encode {what}: {e}")))
}

/// Events per `INSERT` statement: a commit's events go in a few multi-row statements (5 parameters a
/// row, far under SQLite's limit), each prepared once per shape.
const EVENTS_PER_INSERT: usize = 64;

/// The `INSERT` of `rows` events (1 to [`EVENTS_PER_INSERT`]), made once per row count.
fn insert_events_sql(rows: usize) -> &'static str {
    static SHAPES: LazyLock<Vec<String>> = LazyLock::new(|| {
        // the data's form, the same for every row: in the statement, not bound
        let row = format!("(?, ?, ?, ?, ?, {DATA_FORMAT})");
        (1..=EVENTS_PER_INSERT)
            .map(|n| {
                let rows = vec![row.as_str(); n].join(", ");
                format!("INSERT INTO run_events (run_id, sequence, type, data, created_at, data_format) VALUES {rows}")
            })
            .collect()
    });
    &SHAPES[rows.clamp(1, EVENTS_PER_INSERT) - 1]
}

/// Inserts `kinds` as the run's events from `first_sequence` on; the events as written.
fn insert_events(
    conn: &Conn<'_, '_>,
    run_id: &RunId,
    first_sequence: i64,
    kinds: &[EventKind],
    now: &Timestamp,
) -> StoreResult<Vec<Event>> {
    let created_at = ts(now);
    let events = numbered(run_id, first_sequence, kinds, *now);
    // each event's data, written once: stored here, and copied into the event's frames
    let data: Vec<Arc<str>> = events.iter().map(|e| event_data(&e.kind).map(Arc::from)).collect::<StoreResult<_>>()?;
    let run = run_id.as_str();
    for (chunk, data) in events.chunks(EVENTS_PER_INSERT).zip(data.chunks(EVENTS_PER_INSERT)) {
        let types: Vec<&str> = chunk.iter().map(Event::type_name).collect();
        let data: Vec<&str> = data.iter().map(|d| &**d).collect();
        let mut values: Vec<&dyn ToSql> = Vec::with_capacity(chunk.len() * 5);
        for ((event, type_name), data) in chunk.iter().zip(&types).zip(&data) {
            values.extend([&run as &dyn ToSql, &event.sequence, type_name, data, &created_at]);
        }
        exec_or(conn, insert_events_sql(chunk.len()), values.as_slice(), insert("event"))?;
    }
    Ok(events.into_iter().zip(data).map(|(event, data)| event.with_data_text(data)).collect())
}

/// The writer thread's connection, in its transaction, as the pipeline's [`Tx`]. Every call is
/// answered at once: the pipeline's future never waits (`crate::pipeline::ready`).
pub struct SqliteTx<'a, 'k, 'c>(pub &'a Conn<'k, 'c>);

fn failure(e: rusqlite::Error) -> DbError {
    // SQLite's messages never carry the bound parameters, so no value written leaks into them.
    DbError { unique: is_unique_violation(&e), constraint: None, message: e.to_string() }
}

/// A JSON value's text, written by serde_json into a buffer (`Display` goes through a formatter
/// for every piece).
fn json_text(v: &serde_json::Value) -> rusqlite::Result<String> {
    serde_json::to_string(v).map_err(|e| rusqlite::Error::ToSqlConversionFailure(Box::new(e)))
}

fn bind(statement: &mut rusqlite::Statement<'_>, args: &[Arg<'_>]) -> rusqlite::Result<()> {
    for (i, arg) in args.iter().enumerate() {
        let i = i + 1;
        match *arg {
            Arg::Text(v) => statement.raw_bind_parameter(i, v)?,
            Arg::Int(v) => statement.raw_bind_parameter(i, v)?,
            Arg::I32(v) => statement.raw_bind_parameter(i, v)?,
            Arg::Bool(v) => statement.raw_bind_parameter(i, v)?,
            Arg::Time(v) => statement.raw_bind_parameter(i, v.as_ref().map(ts))?,
            Arg::Json(v) => statement.raw_bind_parameter(i, v.map(json_text).transpose()?)?,
            Arg::Encoded(None) => statement.raw_bind_parameter(i, None::<&str>)?,
            Arg::Encoded(Some(Encoded::Text(v))) => statement.raw_bind_parameter(i, v.as_str())?,
            Arg::Encoded(Some(Encoded::Json(v))) => statement.raw_bind_parameter(i, json_text(v)?)?,
            // the pipeline binds arrays on PostgreSQL only: were one handed here, an error
            Arg::Texts(_) => {
                return Err(rusqlite::Error::ToSqlConversionFailure("an array parameter on SQLite".into()))
            }
        }
    }
    Ok(())
}

impl Tx for SqliteTx<'_, '_, '_> {
    const DIALECT: Dialect = Dialect::Sqlite;

    fn encode<T: Serialize + ?Sized>(what: &'static str, value: &T) -> StoreResult<Encoded> {
        json(what, value).map(Encoded::Text)
    }

    fn stored(t: Timestamp) -> Timestamp {
        t
    }

    async fn execute(&mut self, sql: &'static str, args: &[Arg<'_>]) -> Result<u64, DbError> {
        let mut statement = self.0.prepare_kept(sql).map_err(failure)?;
        bind(&mut statement, args).map_err(failure)?;
        let changed = statement.raw_execute().map_err(failure)?;
        Ok(changed as u64)
    }

    async fn row(&mut self, sql: &'static str, args: &[Arg<'_>], shape: &[Ty]) -> Result<Option<Vec<Cell>>, DbError> {
        let mut statement = self.0.prepare_kept(sql).map_err(failure)?;
        bind(&mut statement, args).map_err(failure)?;
        let mut rows = statement.raw_query();
        let Some(row) = rows.next().map_err(failure)? else {
            return Ok(None);
        };
        let mut cells = Vec::with_capacity(shape.len());
        for (i, ty) in shape.iter().enumerate() {
            cells.push(match ty {
                Ty::Text | Ty::OptText => Cell::Text(row.get(i).map_err(failure)?),
                Ty::Int => Cell::Int(row.get(i).map_err(failure)?),
                Ty::Bool => Cell::Bool(row.get(i).map_err(failure)?),
            });
        }
        Ok(Some(cells))
    }

    async fn insert_events(
        &mut self,
        run_id: &RunId,
        first_sequence: i64,
        kinds: &[EventKind],
        now: Timestamp,
    ) -> StoreResult<Vec<Event>> {
        insert_events(self.0, run_id, first_sequence, kinds, &now)
    }
}
