//! Reading rows: every column read is checked, and anything unreadable is a `Backend` error naming
//! the table and column (never the value), not a panic.

use std::cell::Cell;
use std::str::FromStr;
use std::sync::Arc;

use keel_core::domain::{
    Conversation, Fact, FactSource, Interrupt, InterruptKind, InterruptStatus, Message, Role, Run, RunStatus,
    StreamTicket, Summary, TicketScope, Timestamp, ToolCall, ToolCallState, User, UserRole,
};
use keel_core::event::{Event, EventKind};
use keel_core::ids::{InvalidId, RunId};
use keel_core::mask::Masked;
use keel_core::store::{StoreError, StoreResult};
use rusqlite::types::FromSql;
use rusqlite::{Params, Row};
use serde::de::DeserializeOwned;
use serde_json::Value;

use super::db::db;
use super::kept::Conn;

/// The first row of a query, if any.
pub fn one<T, P: Params>(
    conn: &Conn<'_, '_>,
    op: &'static str,
    sql: &'static str,
    params: P,
    from: impl FnOnce(&Row<'_>) -> StoreResult<T>,
) -> StoreResult<Option<T>> {
    let mut statement = conn.prepare_kept(sql).map_err(db(op))?;
    let mut rows = statement.query(params).map_err(db(op))?;
    match rows.next().map_err(db(op))? {
        Some(row) => from(row).map(Some),
        None => Ok(None),
    }
}

/// Every row of a query.
pub fn many<T, P: Params>(
    conn: &Conn<'_, '_>,
    op: &'static str,
    sql: &'static str,
    params: P,
    mut from: impl FnMut(&Row<'_>) -> StoreResult<T>,
) -> StoreResult<Vec<T>> {
    let mut statement = conn.prepare_kept(sql).map_err(db(op))?;
    let mut rows = statement.query(params).map_err(db(op))?;
    let mut out = Vec::new();
    while let Some(row) = rows.next().map_err(db(op))? {
        out.push(from(row)?);
    }
    Ok(out)
}

/// Runs a statement; the number of rows it changed.
pub fn exec<P: Params>(conn: &Conn<'_, '_>, op: &'static str, sql: &'static str, params: P) -> StoreResult<usize> {
    exec_or(conn, sql, params, db(op))
}

/// [`exec`] with its own reading of a failure (a unique violation as a reused id, say).
pub fn exec_or<P: Params>(
    conn: &Conn<'_, '_>,
    sql: &'static str,
    params: P,
    fail: impl FnOnce(rusqlite::Error) -> StoreError,
) -> StoreResult<usize> {
    conn.prepare_kept(sql).and_then(|mut s| s.execute(params)).map_err(fail)
}

/// What went wrong with a stored JSON value, without quoting it: serde's messages can carry the
/// offending text, which may be anything a tool returned.
pub fn json_error(e: &serde_json::Error) -> String {
    let kind = match e.classify() {
        serde_json::error::Category::Io => "unreadable",
        serde_json::error::Category::Syntax | serde_json::error::Category::Eof => "not valid JSON",
        serde_json::error::Category::Data => "not the expected shape",
    };
    format!("{kind} (line {}, column {})", e.line(), e.column())
}

/// Reads the columns of one row, turning anything unreadable into `Backend` instead of a panic.
pub struct Cols<'a, 'r> {
    row: &'a Row<'r>,
    table: &'static str,
    /// Where the next column is looked for first: columns are mostly read in the order they are
    /// selected, so a lookup by name is one comparison, not a scan of every name (rusqlite's, which
    /// compares ignoring case, was ~4% of the server's instructions per run).
    next: Cell<usize>,
}

impl<'a, 'r> Cols<'a, 'r> {
    pub fn new(row: &'a Row<'r>, table: &'static str) -> Self {
        Self { row, table, next: Cell::new(0) }
    }

    /// The index of the column named exactly `col`, looked for from the one after the last found.
    fn index(&self, col: &str) -> Option<usize> {
        let statement = self.row.as_ref();
        let (count, hint) = (statement.column_count(), self.next.get());
        let found =
            (hint..count).chain(0..hint.min(count)).find(|&i| statement.column_name(i).is_ok_and(|name| name == col));
        if let Some(i) = found {
            self.next.set(i + 1);
        }
        found
    }

    pub fn bad(&self, col: &str, why: impl std::fmt::Display) -> StoreError {
        StoreError::Backend(format!("unreadable {}.{col}: {why}", self.table))
    }

    pub fn get<T: FromSql>(&self, col: &str) -> StoreResult<T> {
        match self.index(col) {
            Some(i) => self.row.get(i),
            // rusqlite's own lookup: names that differ in case, and its error for a missing one
            None => self.row.get(col),
        }
        .map_err(|e| self.bad(col, e))
    }

    pub fn id<T: FromStr<Err = InvalidId>>(&self, col: &str) -> StoreResult<T> {
        let s: String = self.get(col)?;
        s.parse().map_err(|e| self.bad(col, e))
    }

    pub fn opt_id<T: FromStr<Err = InvalidId>>(&self, col: &str) -> StoreResult<Option<T>> {
        let s: Option<String> = self.get(col)?;
        s.map(|s| s.parse().map_err(|e| self.bad(col, e))).transpose()
    }

    pub fn parse<T>(&self, col: &str, parse: fn(&str) -> Option<T>) -> StoreResult<T> {
        let s: String = self.get(col)?;
        parse(&s).ok_or_else(|| self.bad(col, format!("unknown value `{}`", s.chars().take(40).collect::<String>())))
    }

    pub fn ts(&self, col: &str) -> StoreResult<Timestamp> {
        let s: String = self.get(col)?;
        self.parse_ts(col, &s)
    }

    pub fn opt_ts(&self, col: &str) -> StoreResult<Option<Timestamp>> {
        let s: Option<String> = self.get(col)?;
        s.map(|s| self.parse_ts(col, &s)).transpose()
    }

    fn parse_ts(&self, col: &str, s: &str) -> StoreResult<Timestamp> {
        keel_core::rfc3339::parse(s).map_err(|e| self.bad(col, e))
    }

    pub fn json<T: DeserializeOwned>(&self, col: &str) -> StoreResult<T> {
        let s: String = self.get(col)?;
        serde_json::from_str(&s).map_err(|e| self.bad(col, json_error(&e)))
    }

    /// Text written through the masking gate ([`Masked`]).
    pub fn masked(&self, col: &str) -> StoreResult<Masked<String>> {
        self.get(col).map(Masked::from_store)
    }

    pub fn opt_masked(&self, col: &str) -> StoreResult<Option<Masked<String>>> {
        Ok(self.get::<Option<String>>(col)?.map(Masked::from_store))
    }

    /// JSON written through the masking gate ([`Masked`]).
    pub fn masked_json(&self, col: &str) -> StoreResult<Masked<Value>> {
        self.json(col).map(Masked::from_store)
    }

    pub fn opt_masked_json(&self, col: &str) -> StoreResult<Option<Masked<Value>>> {
        Ok(self.opt_json::<Value>(col)?.map(Masked::from_store))
    }

    pub fn opt_json<T: DeserializeOwned>(&self, col: &str) -> StoreResult<Option<T>> {
        let s: Option<String> = self.get(col)?;
        s.map(|s| serde_json::from_str(&s).map_err(|e| self.bad(col, json_error(&e)))).transpose()
    }
}

pub fn conversation_from(row: &Row<'_>) -> StoreResult<Conversation> {
    let c = Cols::new(row, "conversations");
    Ok(Conversation {
        id: c.id("id")?,
        user_id: c.get("user_id")?,
        title: c.masked("title")?,
        agent_id: c.get("agent_id")?,
        version: c.get("version")?,
        created_at: c.ts("created_at")?,
    })
}

pub fn user_from(row: &Row<'_>) -> StoreResult<User> {
    let c = Cols::new(row, "users");
    let active_keys: i64 = c.get("active_keys")?;
    Ok(User { id: c.get("id")?, role: c.parse("role", UserRole::parse)?, active_keys: active_keys as u64 })
}

pub fn stream_ticket_from(row: &Row<'_>) -> StoreResult<StreamTicket> {
    let c = Cols::new(row, "stream_tickets");
    Ok(StreamTicket {
        ticket_hash: c.get("ticket_hash")?,
        user_id: c.get("user_id")?,
        scope: c.parse("scope", TicketScope::parse)?,
        run_id: c.opt_id("run_id")?,
        expires_at: c.ts("expires_at")?,
        used_at: c.opt_ts("used_at")?,
    })
}

pub fn message_from(row: &Row<'_>) -> StoreResult<Message> {
    let c = Cols::new(row, "messages");
    Ok(Message {
        id: c.id("id")?,
        conversation_id: c.id("conversation_id")?,
        run_id: c.opt_id("run_id")?,
        role: c.parse("role", Role::parse)?,
        content: c.masked("content")?,
        tool_call_id: c.opt_id("tool_call_id")?,
        created_at: c.ts("created_at")?,
    })
}

pub fn fact_from(row: &Row<'_>) -> StoreResult<Fact> {
    let c = Cols::new(row, "facts");
    Ok(Fact {
        key: c.get("key")?,
        value: c.masked("value")?,
        source: c.parse("source", FactSource::parse)?,
        updated_at: c.ts("updated_at")?,
    })
}

pub fn summary_from(row: &Row<'_>) -> StoreResult<Summary> {
    let c = Cols::new(row, "summaries");
    Ok(Summary {
        conversation_id: c.id("conversation_id")?,
        through_message_id: c.id("through_message_id")?,
        text: c.masked("text")?,
    })
}

pub fn run_from(row: &Row<'_>) -> StoreResult<Run> {
    let c = Cols::new(row, "runs");
    Ok(Run {
        id: c.id("id")?,
        conversation_id: c.id("conversation_id")?,
        user_message_id: c.id("user_message_id")?,
        user_id: c.get("user_id")?,
        agent_id: c.get("agent_id")?,
        status: c.parse("status", RunStatus::parse)?,
        reason: c.get("reason")?,
        cancel_on_disconnect: c.get("cancel_on_disconnect")?,
        cancel_requested: c.get("cancel_requested")?,
        next_sequence: c.get("next_sequence")?,
        lease_owner: c.get("lease_owner")?,
        lease_expires_at: c.opt_ts("lease_expires_at")?,
        worker: c.get("worker")?,
        checkpoint: c.json("checkpoint")?,
        created_at: c.ts("created_at")?,
        updated_at: c.ts("updated_at")?,
        hidden_at: c.opt_ts("hidden_at")?,
    })
}

pub fn event_from(run_id: &RunId, row: &Row<'_>) -> StoreResult<Event> {
    let c = Cols::new(row, "run_events");
    let type_name: String = c.get("type")?;
    let data: String = c.get("data")?;
    let kind = EventKind::from_data_text(&type_name, &data).map_err(|e| c.bad("data", json_error(&e)))?;
    let event = Event::new(kind, run_id.clone(), c.get("sequence")?, c.ts("created_at")?);
    // Data stored in this version's form goes into frames as it is; any other is serialized again.
    Ok(match c.get::<i64>("data_format")? {
        keel_core::event::DATA_FORMAT => event.with_data_text(Arc::from(data)),
        _ => event,
    })
}

pub fn interrupt_from(row: &Row<'_>) -> StoreResult<Interrupt> {
    let c = Cols::new(row, "interrupts");
    Ok(Interrupt {
        id: c.id("id")?,
        run_id: c.id("run_id")?,
        kind: c.parse("kind", InterruptKind::parse)?,
        status: c.parse("status", InterruptStatus::parse)?,
        payload: c.masked_json("payload")?,
        call_ids: c.json("call_ids")?,
        created_at: c.ts("created_at")?,
        expires_at: c.ts("expires_at")?,
        decision: c.opt_masked_json("decision")?,
        note: c.opt_masked("note")?,
        resolved_by: c.get("resolved_by")?,
        resolved_at: c.opt_ts("resolved_at")?,
    })
}

pub fn tool_call_from(row: &Row<'_>) -> StoreResult<ToolCall> {
    let c = Cols::new(row, "tool_calls");
    Ok(ToolCall {
        id: c.id("id")?,
        run_id: c.id("run_id")?,
        name: c.get("name")?,
        args: c.masked_json("args")?,
        state: c.parse("state", ToolCallState::parse)?,
        result: c.opt_masked_json("result")?,
        summary: c.opt_masked("summary")?,
        attempts: c.get("attempts")?,
        started_at: c.opt_ts("started_at")?,
        finished_at: c.opt_ts("finished_at")?,
    })
}
