//! PostgreSQL's side of the commit pipeline (`crate::pipeline`): its [`Tx`] over a connection in a
//! transaction, with `timestamptz` and `jsonb` columns, and events inserted from arrays in one
//! statement.

use keel_core::domain::Checkpoint;
use keel_core::domain::Timestamp;
use keel_core::event::{Event, EventKind};
use keel_core::ids::{MessageId, RunId};
use keel_core::store::{NewRun, StartedRun, StoreError, StoreResult};
use serde::Serialize;
use serde_json::Value;
use sqlx::postgres::{PgArguments, PgRow};
use sqlx::query::Query;
use sqlx::{PgConnection, Postgres, Row};

use std::sync::LazyLock;

use crate::pipeline::{
    event_data, new_run_rows, numbered, refused_as_active, run_args, stored_role, Arg, Cell, DbError, Dialect, Encoded,
    NewRows, Tx, Ty, BLOCKING_RUN, INSERT_RUN,
};

use super::{insert, json, micros};

/// A run's events numbered from a first sequence, and the arrays a statement `unnest`s them from:
/// sequences, types, and the data as JSON text, cast by the statement (no `Value` built to be
/// serialized again).
struct EventArrays {
    events: Vec<Event>,
    sequences: Vec<i64>,
    types: Vec<&'static str>,
    data: Vec<String>,
}

fn event_arrays(run_id: &RunId, first: i64, kinds: &[EventKind], now: Timestamp) -> StoreResult<EventArrays> {
    let events = numbered(run_id, first, kinds, now);
    let sequences = events.iter().map(|e| e.sequence).collect();
    let types = kinds.iter().map(EventKind::type_name).collect();
    let data = kinds.iter().map(event_data).collect::<StoreResult<_>>()?;
    Ok(EventArrays { events, sequences, types, data })
}

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
        let EventArrays { events, sequences, types, data } = event_arrays(run_id, first_sequence, kinds, now)?;
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

    /// One statement, one round trip: the run, then (from what it returned) its message and its
    /// events. The message's foreign key to the run is checked at the statement's end, when it is
    /// there; the events name the run this statement returned (their table has no foreign key:
    /// migration `0013_run_events_unchecked`).
    async fn insert_start(&mut self, rows: &NewRows<'_>) -> StoreResult<Option<Vec<Event>>> {
        static SQL: LazyLock<String> = LazyLock::new(|| {
            format!(
                "WITH r AS ({}) RETURNING id, conversation_id, created_at), \
                 m AS (INSERT INTO messages (id, conversation_id, run_id, role, content, tool_call_id, created_at) \
                       SELECT $18, r.conversation_id, r.id, $19, $20, NULL, r.created_at FROM r WHERE $18::text IS NOT NULL), \
                 e AS (INSERT INTO run_events (run_id, sequence, type, data, created_at) \
                       SELECT r.id, e.sequence, e.type, e.data::jsonb, r.created_at \
                       FROM r, unnest($21::bigint[], $22::text[], $23::text[]) AS e (sequence, type, data)) \
                 SELECT 1",
                INSERT_RUN.text(Dialect::Postgres).trim_end_matches(')'),
            )
        });
        let run = rows.run;
        let checkpoint = Self::encode("checkpoint", &run.checkpoint)?;
        let EventArrays { events, sequences, types, data } = event_arrays(&run.id, 1, rows.events, run.created_at)?;
        let message = rows.message;
        let query = bind(sqlx::query(SQL.as_str()), &run_args(run, rows.pending, &checkpoint))
            .bind(message.map(|m| m.id.as_str()))
            .bind(message.map(|m| m.role.as_str()))
            .bind(message.map(|m| m.content.as_str()))
            .bind(&sequences)
            .bind(&types)
            .bind(&data);
        match query.execute(&mut *self.0).await.map_err(failure) {
            Ok(_) => Ok(Some(events)),
            Err(e) if refused_as_active(&e, rows.one_active_run) => Ok(None),
            Err(e) => Err(e.insert("run")),
        }
    }
}

/// What [`start_at_once`] did.
pub enum AtOnce {
    Started(Box<StartedRun>),
    /// The conversation has a run that is not over (active, or waiting): this one.
    Blocked(RunId),
    /// The conversation's row changed since the statement's snapshot (a start, an enqueue or a
    /// promotion committed meanwhile, or one was in flight): nothing was written; start again the
    /// locking way.
    Raced,
}

/// A message that does not wait, started in one statement, with no transaction of its own (the
/// statement is one): the conversation's version bumped, its blocking runs checked, the run, the
/// message and the first events written — four round trips less than `BEGIN`, the lock, the check,
/// the rows and `COMMIT`.
///
/// **Why it is as safe as the lock.** The locking way bumps the version first, so the check after
/// it sees every start, enqueue and promotion that committed before. One statement sees the
/// database as of its start, but its `UPDATE` of the conversation is conditional on the row being
/// the one it saw (`xmin`, re-checked on the newest row if it had to wait for it); every start,
/// enqueue and promotion writes that row, so any of them committed since the snapshot makes the
/// statement write nothing, and the caller starts again the locking way. A run that ended since
/// only makes the check stale in the safe direction, as it can be for the locking way too.
pub async fn start_at_once(
    conn: &mut PgConnection,
    new: &NewRun,
    run_id: RunId,
    message_id: MessageId,
) -> StoreResult<AtOnce> {
    static SQL: LazyLock<String> = LazyLock::new(|| {
        let blocking = BLOCKING_RUN.text(Dialect::Postgres).replace("$1", "$2");
        format!(
            "WITH seen AS (SELECT xmin FROM conversations WHERE id = $2), \
             blocking AS ({blocking} AS id), \
             v AS (UPDATE conversations c SET version = c.version + 1 FROM seen, blocking \
                   WHERE c.id = $2 AND c.xmin = seen.xmin AND blocking.id IS NULL RETURNING c.version), \
             r AS (INSERT INTO runs (id, conversation_id, user_message_id, user_id, agent_id, status, reason, \
                   cancel_on_disconnect, cancel_requested, next_sequence, lease_owner, lease_expires_at, checkpoint, \
                   created_at, updated_at, pending_content, worker) \
                   SELECT $1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, \
                   jsonb_set($13, '{{conversationVersion}}', to_jsonb(v.version)), $14, $15, $16, $17 FROM v \
                   RETURNING id, conversation_id, created_at), \
             m AS (INSERT INTO messages (id, conversation_id, run_id, role, content, tool_call_id, created_at) \
                   SELECT $18, r.conversation_id, r.id, $19, $20, NULL, r.created_at FROM r), \
             e AS (INSERT INTO run_events (run_id, sequence, type, data, created_at) \
                   SELECT r.id, e.sequence, e.type, e.data::jsonb, r.created_at \
                   FROM r, unnest($21::bigint[], $22::text[], $23::text[]) AS e (sequence, type, data)) \
             SELECT EXISTS (SELECT 1 FROM seen), (SELECT id FROM blocking), (SELECT version FROM v), \
             (SELECT role FROM users WHERE id = $4)"
        )
    });
    // the version is the statement's: 0 until it is known
    let (mut run, message) = new_run_rows::<PgTx<'_>>(new, run_id, message_id, 0, false, new.events.len())?;
    let checkpoint = PgTx::encode("checkpoint", &run.checkpoint)?;
    let EventArrays { events, sequences, types, data } = event_arrays(&run.id, 1, &new.events, run.created_at)?;
    let row = bind(sqlx::query(SQL.as_str()), &run_args(&run, None, &checkpoint))
        .bind(message.id.as_str())
        .bind(message.role.as_str())
        .bind(message.content.as_str())
        .bind(&sequences)
        .bind(&types)
        .bind(&data)
        .fetch_one(&mut *conn)
        .await;
    let row = match row.map_err(failure) {
        Ok(row) => row,
        // a run made active by someone the snapshot did not see: the locking way says who
        Err(e) if refused_as_active(&e, super::ONE_ACTIVE_RUN) => return Ok(AtOnce::Raced),
        Err(e) => return Err(e.insert("run")),
    };
    let read = |e: sqlx::Error| StoreError::Backend(format!("start a run: {e}"));
    let found: bool = row.try_get(0).map_err(read)?;
    let blocking: Option<String> = row.try_get(1).map_err(read)?;
    let version: Option<i64> = row.try_get(2).map_err(read)?;
    let role: Option<String> = row.try_get(3).map_err(read)?;
    if !found {
        return Err(StoreError::NotFound("conversation"));
    }
    if let Some(blocking) = blocking {
        let id = blocking.parse().map_err(|_| StoreError::Backend("column runs.id: not a run id".into()))?;
        return Ok(AtOnce::Blocked(id));
    }
    let Some(version) = version else { return Ok(AtOnce::Raced) };
    run.checkpoint = Checkpoint::start(version);
    let user_role = Some(stored_role(role)?);
    Ok(AtOnce::Started(Box::new(StartedRun { message, run, events, user_role })))
}
