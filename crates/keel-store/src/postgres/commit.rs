//! PostgreSQL's side of the commit pipeline (`crate::pipeline`): its [`Tx`] over a connection in a
//! transaction, with `timestamptz` and `jsonb` columns, and events inserted from arrays in one
//! statement.

use keel_core::domain::Timestamp;
use keel_core::event::{Event, EventKind};
use keel_core::ids::RunId;
use keel_core::store::StoreResult;
use serde::Serialize;
use serde_json::Value;
use sqlx::postgres::{PgArguments, PgRow};
use sqlx::query::Query;
use sqlx::{PgConnection, Postgres, Row};

use crate::pipeline::{event_data, numbered, Arg, Cell, DbError, Dialect, Encoded, Tx, Ty};

use super::{insert, json, micros};

/// A connection in its transaction, as the pipeline's [`Tx`].
pub struct PgTx<'c>(pub &'c mut PgConnection);

/// Only the server's primary message is kept (never its detail, which quotes the row), so no value
/// written leaks into the error.
fn failure(e: sqlx::Error) -> DbError {
    match &e {
        sqlx::Error::Database(d) => DbError {
            unique: d.is_unique_violation(),
            constraint: d.constraint().map(str::to_owned),
            message: d.message().to_owned(),
        },
        other => DbError { unique: false, constraint: None, message: other.to_string() },
    }
}

fn bind<'q>(mut query: Query<'q, Postgres, PgArguments>, args: &[Arg<'q>]) -> Query<'q, Postgres, PgArguments> {
    for arg in args {
        query = match *arg {
            Arg::Text(v) => query.bind(v),
            Arg::Int(v) => query.bind(v),
            Arg::I32(v) => query.bind(v),
            Arg::Bool(v) => query.bind(v),
            Arg::Time(v) => query.bind(v),
            Arg::Json(v) => query.bind(v),
            Arg::Encoded(None) => query.bind(None::<&Value>),
            Arg::Encoded(Some(Encoded::Json(v))) => query.bind(v),
            // This backend's `encode` never makes text. Were it handed some, it goes as `text`, which
            // the server refuses for a `jsonb` column: an error, never a value stored wrongly.
            Arg::Encoded(Some(Encoded::Text(v))) => query.bind(v.as_str()),
            Arg::Texts(v) => query.bind(v),
        };
    }
    query
}

impl Tx for PgTx<'_> {
    const DIALECT: Dialect = Dialect::Postgres;

    fn encode<T: Serialize + ?Sized>(what: &'static str, value: &T) -> StoreResult<Encoded> {
        json(what, value).map(Encoded::Json)
    }

    fn stored(t: Timestamp) -> Timestamp {
        micros(t)
    }

    async fn execute(&mut self, sql: &'static str, args: &[Arg<'_>]) -> Result<u64, DbError> {
        let done = bind(sqlx::query(sql), args).execute(&mut *self.0).await.map_err(failure)?;
        Ok(done.rows_affected())
    }

    async fn row(&mut self, sql: &'static str, args: &[Arg<'_>], shape: &[Ty]) -> Result<Option<Vec<Cell>>, DbError> {
        let Some(row): Option<PgRow> =
            bind(sqlx::query(sql), args).fetch_optional(&mut *self.0).await.map_err(failure)?
        else {
            return Ok(None);
        };
        let mut cells = Vec::with_capacity(shape.len());
        for (i, ty) in shape.iter().enumerate() {
            cells.push(match ty {
                Ty::Text | Ty::OptText => Cell::Text(row.try_get(i).map_err(failure)?),
                Ty::Int => Cell::Int(row.try_get(i).map_err(failure)?),
                Ty::Bool => Cell::Bool(row.try_get(i).map_err(failure)?),
            });
        }
        Ok(Some(cells))
    }

    /// One statement, whatever the number of events: they go in as arrays.
    async fn insert_events(
        &mut self,
        run_id: &RunId,
        first_sequence: i64,
        kinds: &[EventKind],
        now: Timestamp,
    ) -> StoreResult<Vec<Event>> {
        if kinds.is_empty() {
            return Ok(Vec::new());
        }
        let events = numbered(run_id, first_sequence, kinds, now);
        let sequences: Vec<i64> = events.iter().map(|e| e.sequence).collect();
        let types: Vec<&str> = kinds.iter().map(EventKind::type_name).collect();
        // the data as JSON text, cast by the statement: no `Value` built to be serialized again
        let data = kinds.iter().map(event_data).collect::<StoreResult<Vec<_>>>()?;
        sqlx::query(
            "INSERT INTO run_events (run_id, sequence, type, data, created_at) \
             SELECT $1, e.sequence, e.type, e.data::jsonb, $5 \
             FROM unnest($2::bigint[], $3::text[], $4::text[]) AS e (sequence, type, data)",
        )
        .bind(run_id.as_str())
        .bind(&sequences)
        .bind(&types)
        .bind(&data)
        .bind(now)
        .execute(&mut *self.0)
        .await
        .map_err(insert("event"))?;
        Ok(events)
    }
}
