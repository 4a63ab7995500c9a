//! Group commit on Postgres: the commits that arrive while a group is in flight are written by a
//! committer task in one transaction, a statement per table for the whole group, not per commit.
//!
//! **Why.** With `synchronous_commit = on` every `COMMIT` waits for a WAL flush, and every statement
//! is a round trip; a commit used to be a transaction of its own with one statement per kind of
//! record (five to ten round trips and a flush). A group is about as many round trips and one flush,
//! whatever its size: `BEGIN`, the run rows locked and read, then one `UPDATE` of the run rows, one
//! `INSERT` of the events (and of the messages, tool calls, … when any commit of the group has
//! some), `COMMIT`.
//!
//! **The fence, in Rust.** The group's run rows are locked first, in id order (`SELECT … ORDER BY id
//! FOR NO KEY UPDATE`), so two groups, in one process or two, take them in the same order and never
//! deadlock on them; the rows read are then current until the transaction ends. Each commit's fence
//! (lease owner, status) and status move are checked against those rows in Rust, exactly as the
//! conditional `UPDATE` of a lone commit checks them: a commit its fence refuses is answered with the
//! same error and left out of the group's statements, at no cost to the others. The same read says
//! whether runs wait behind each run (one probe of the index of waiting runs), so a commit that
//! ends its run answers [`Committed::waiting_behind`] as a lone commit does, and the engine reads
//! nothing more after a run's end when nothing waits.
//!
//! **Refusals past the fence.** The other checks (a tool call or an interrupt not in the state the
//! commit expects, a reused id, an idempotency key holding an answer, a record of another run) are
//! rare; when one fails, the group's transaction is rolled back and its commits are written one by
//! one, each in its own transaction by the lone-commit path ([`super::commit_alone`]), which gives
//! each commit its exact answer: the refused commit fails alone and the others commit. (A savepoint
//! per commit cannot help here: one statement writes the records of every commit of the group.)
//!
//! A group holds commits of distinct runs, so no commit of the group depends on another's effect
//! on the same row: applying the group table by table is the same as applying its commits one after
//! the other. A commit for a run already in the group waits for the next group.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, LazyLock};
use std::time::Duration;

use chrono::{DateTime, Utc};
use keel_core::domain::{lease_holder, InterruptStatus, RunStatus, ToolCall};
use keel_core::event::Event;
use keel_core::ids::ConversationId;
use keel_core::mask::Masked;
use keel_core::store::{Commit, Committed, Fence, StoreError, StoreResult, ToolCallChange, ToolCallUpdate};
use serde_json::Value;
use sqlx::postgres::PgArguments;
use sqlx::query::Query;
use sqlx::{Connection, PgConnection, PgPool, Postgres, Row};
use tokio::sync::{mpsc, oneshot, Mutex, MutexGuard};

use super::kept::Kept;
use super::{db, json, micros, Cols};

/// The most commits one group takes: one transaction, and the wait of its first caller, stay short.
pub const MAX_GROUP: usize = 64;

/// What the store counts of its commits, since it was connected.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CommitStats {
    /// Commits answered (written or refused).
    pub commits: u64,
    /// Group transactions begun: each ends in one `COMMIT` (or a rollback, see `regrouped`).
    pub groups: u64,
    /// Groups rolled back because a commit was refused past its fence, and written again one commit
    /// per transaction.
    pub regrouped: u64,
}

#[derive(Default)]
struct Counters {
    commits: AtomicU64,
    groups: AtomicU64,
    regrouped: AtomicU64,
}

struct Job {
    commit: Commit,
    reply: oneshot::Sender<StoreResult<Committed>>,
}

enum Msg {
    Commit(Box<Job>),
    /// Ends one committer after the commits queued before it.
    Close(oneshot::Sender<()>),
}

/// The committers' queue. Cloning the store shares it.
pub struct Committer {
    queue: mpsc::Sender<Msg>,
    /// The committers' own connections, used again without sqlx's test on release ([`Kept`]).
    kept: Arc<Kept>,
    committers: usize,
    capacity: usize,
    counters: Arc<Counters>,
}

impl std::fmt::Debug for Committer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Committer").field("committers", &self.committers).field("capacity", &self.capacity).finish()
    }
}

impl Committer {
    /// Starts `committers` tasks (at least one) on the current runtime, sharing a queue of
    /// `capacity` commits.
    ///
    /// The committers write on connections of their own: a pool of `committers` connections, with
    /// `pool`'s options, opened as they are first needed. A group's statement text depends on the
    /// kinds of records it holds (a dozen combinations), and PostgreSQL plans a prepared statement
    /// afresh at each of its first five executions on a connection before it settles on a plan it
    /// keeps: on the readers' dozen connections that took ~0.6 ms of planning a group for thousands
    /// of groups, on the committers' own it takes it for a few dozen.
    ///
    /// Every statement a committer sends finds its rows by key (`unnest` of the rows' keys, `= ANY`
    /// of the runs' ids), so its connections are set up by [`super::kept::by_key`]: each
    /// statement's first plan is kept, and reads the keys' indexes. A plan made while a table is
    /// small would otherwise read all of `runs`, `tool_calls` or `idempotency_keys` at every group,
    /// however large they grow (docs/benchmarks.md, "Tenth session"). Nor does a group wait for a
    /// connection behind the readers, or a reader behind the groups.
    pub fn start(pool: PgPool, committers: usize, capacity: usize, hold: Duration) -> Self {
        let committers = committers.max(1);
        let kept = Arc::new(Kept::new(super::kept::by_key(&pool, committers)));
        let (queue, receiver) = mpsc::channel(capacity.max(1));
        let receiver = Arc::new(Mutex::new(receiver));
        let counters = Arc::new(Counters::default());
        for _ in 0..committers {
            tokio::spawn(run(kept.clone(), receiver.clone(), counters.clone(), hold));
        }
        Self { queue, kept, committers, capacity, counters }
    }

    /// Queues `commit` and waits for its answer. With the queue full, [`StoreError::Overloaded`] at
    /// once, and nothing is written. A caller that stops waiting does not withdraw its commit.
    pub async fn commit(&self, commit: Commit) -> StoreResult<Committed> {
        let (reply, answer) = oneshot::channel();
        self.queue.try_send(Msg::Commit(Box::new(Job { commit, reply }))).map_err(|e| match e {
            mpsc::error::TrySendError::Full(_) => StoreError::Overloaded,
            mpsc::error::TrySendError::Closed(_) => closed(),
        })?;
        answer.await.map_err(|_| closed())?
    }

    /// Commits waiting for a committer (not those in a group being written).
    pub fn queued(&self) -> usize {
        self.capacity.max(1) - self.queue.capacity()
    }

    pub fn stats(&self) -> CommitStats {
        CommitStats {
            commits: self.counters.commits.load(Ordering::Relaxed),
            groups: self.counters.groups.load(Ordering::Relaxed),
            regrouped: self.counters.regrouped.load(Ordering::Relaxed),
        }
    }

    /// Writes the commits queued before this call, then ends the committers. Later commits are
    /// errors.
    pub async fn close(&self) {
        let mut acks = Vec::with_capacity(self.committers);
        for _ in 0..self.committers {
            let (ack, acked) = oneshot::channel();
            // past the queue's bound (a close is never refused); an error: closed already
            if self.queue.send(Msg::Close(ack)).await.is_err() {
                break;
            }
            acks.push(acked);
        }
        for acked in acks {
            let _ = acked.await;
        }
        self.kept.close().await;
    }
}

fn closed() -> StoreError {
    StoreError::Backend("commit: the store is closed".into())
}

/// One committer: takes the commits queued at that moment (at most [`MAX_GROUP`], of distinct runs),
/// writes them as one group, answers them. Ends at its [`Msg::Close`], or when every handle is gone.
async fn run(conns: Arc<Kept>, receiver: Arc<Mutex<mpsc::Receiver<Msg>>>, counters: Arc<Counters>, hold: Duration) {
    let mut carried: Option<Job> = None;
    loop {
        let mut group: Vec<Job> = Vec::with_capacity(MAX_GROUP);
        let mut close = None;
        group.extend(carried.take());
        // With a commit carried over, no waiting for the queue: another committer may hold it
        // while it waits for the next commit, or while it writes its group, and the carried one
        // would wait as long.
        let mut queue = match group.is_empty() {
            true => Some(receiver.lock().await),
            false => receiver.try_lock().ok(),
        };
        if let Some(queue) = queue.as_mut() {
            if group.is_empty() {
                match queue.recv().await {
                    Some(Msg::Commit(job)) => group.push(*job),
                    Some(Msg::Close(ack)) => close = Some(ack),
                    None => return,
                }
            }
            while close.is_none() && group.len() < MAX_GROUP {
                match queue.try_recv() {
                    Ok(Msg::Commit(job)) => {
                        if group.iter().any(|j| j.commit.run_id == job.commit.run_id) {
                            carried = Some(*job);
                            break;
                        }
                        group.push(*job);
                    }
                    Ok(Msg::Close(ack)) => close = Some(ack),
                    Err(_) => break,
                }
            }
        }
        if !group.is_empty() {
            write_group(&conns, group, &counters, &mut queue, hold).await;
        }
        drop(queue);
        if let Some(ack) = close {
            if let Some(job) = carried.take() {
                write_group(&conns, vec![job], &counters, &mut None, hold).await;
            }
            let _ = ack.send(());
            return;
        }
    }
}

/// Why a group's transaction did not commit.
enum GroupFailure {
    /// A commit was refused past its fence (or a statement failed): write the commits one by one.
    Regroup,
    /// The `COMMIT` itself failed: whether it took effect is unknown, so nothing is written again.
    Commit(StoreError),
}

/// The queue, held by the committer that took its group from it until that group's `COMMIT` is
/// sent (or its one statement, on the lone path), or for at most
/// [`super::PostgresOptions::hold_queue_at_most`]: see [`write_group`].
type Turn<'q> = Option<MutexGuard<'q, mpsc::Receiver<Msg>>>;

/// Writes `group` and answers its commits. `turn` is let go once nothing is left of the group but
/// its `COMMIT`: another committer then takes the commits that came meanwhile as the next group,
/// whose statements go while this one's `COMMIT` waits for the WAL to reach the disk. Let go any
/// sooner, that committer would take the few commits that came during this one's draining, and
/// groups would be smaller than they need to be, each with its four round trips and its flush
/// (docs/benchmarks.md, "Twelfth session"). Held longer than `hold`, it is let go all the same, so
/// a group that waits for a lock does not stop the others.
async fn write_group(conns: &Kept, group: Vec<Job>, counters: &Counters, turn: &mut Turn<'_>, hold: Duration) {
    counters.groups.fetch_add(1, Ordering::Relaxed);
    counters.commits.fetch_add(group.len() as u64, Ordering::Relaxed);
    let commits: Vec<&Commit> = group.iter().map(|j| &j.commit).collect();
    // A commit alone that is its fence's one statement (its events, its status and checkpoint) is
    // cheaper the lone way: that statement, one round trip. Any more (its messages, calls,
    // interrupts, facts, answer, or the look for waiting runs at a run's end) is a statement each
    // there, and one in all here: `BEGIN`, the lock, one statement, `COMMIT`.
    let written = match commits.as_slice() {
        [commit] if fence_alone(commit) => {
            drop(turn.take());
            Ok(vec![super::commit_alone(conns, commit).await])
        }
        _ => write(conns, &commits, turn, hold).await,
    };
    drop(turn.take());
    let answers = match written {
        Ok(answers) => answers,
        Err(GroupFailure::Commit(e)) => {
            let why = match e {
                StoreError::Backend(why) => why,
                other => other.to_string(),
            };
            commits.iter().map(|_| Err(StoreError::Backend(why.clone()))).collect()
        }
        Err(GroupFailure::Regroup) => {
            counters.regrouped.fetch_add(1, Ordering::Relaxed);
            let mut answers = Vec::with_capacity(commits.len());
            for commit in &commits {
                answers.push(super::commit_alone(conns, commit).await);
            }
            answers
        }
    };
    for (job, answer) in group.into_iter().zip(answers) {
        // a caller that stopped waiting has nobody to tell
        let _ = job.reply.send(answer);
    }
}

/// The commit is written by its fence's statement alone on the lone path (which then needs no
/// transaction around it: [`super::commit_alone`]).
pub(super) fn fence_alone(c: &Commit) -> bool {
    c.text.is_empty()
        && c.messages.is_empty()
        && c.discard_messages.is_empty()
        && c.tool_calls.is_empty()
        && c.new_interrupts.is_empty()
        && c.interrupt_changes.is_empty()
        && c.facts.is_empty()
        && c.summary.is_none()
        && c.idempotency.is_none()
        && !c.run.as_ref().is_some_and(|change| change.to.is_terminal())
}

/// A commit's call changes as one row per call, as the changes one after the other would leave
/// them: the calls it inserts with its moves of them applied ([`ToolCallChange::apply_to`]), and
/// each other call's moves joined into one ([`ToolCallUpdate::then`]: a commit that joined two
/// steps moves a call twice, an answer's `allowed`, then the attempt's `executing`). `None`: a move
/// that does not start where its call is, which the lone path refuses with its exact answer.
fn fold_calls(changes: &[ToolCallChange]) -> Option<(Vec<ToolCall>, Vec<ToolCallUpdate>)> {
    let mut inserted: Vec<ToolCall> = Vec::new();
    let mut moved: Vec<ToolCallUpdate> = Vec::new();
    for change in changes {
        match change {
            ToolCallChange::Insert(call) => inserted.push(call.clone()),
            ToolCallChange::Update(u) => {
                if let Some(call) = inserted.iter().find(|call| call.id == u.id) {
                    if call.state != u.from {
                        return None;
                    }
                    change.apply_to(&mut inserted);
                } else if let Some(earlier) = moved.iter_mut().find(|m| m.id == u.id) {
                    if !earlier.then(u) {
                        return None;
                    }
                } else {
                    moved.push(u.clone());
                }
            }
        }
    }
    Some((inserted, moved))
}

/// The run row as the group's lock read it.
struct RunRow {
    status: RunStatus,
    conversation_id: ConversationId,
    next_sequence: i64,
    cancel_requested: bool,
    lease_owner: Option<String>,
    lease_expires_at: Option<DateTime<Utc>>,
    reason: Option<String>,
    /// Runs of its conversation wait their turn (read with the lock, as a lone commit's end reads
    /// it in its transaction): a commit that ends the run says so, and the engine looks for the
    /// next one only then.
    waiting_behind: bool,
}

async fn write(
    conns: &Kept,
    commits: &[&Commit],
    turn: &mut Turn<'_>,
    hold: Duration,
) -> Result<Vec<StoreResult<Committed>>, GroupFailure> {
    conns
        .run_judged(
            async |conn| {
                let mut tx = conn.begin().await.map_err(|e| GroupFailure::Commit(db("begin a transaction")(e)))?;
                let applied = {
                    let applying = apply(&mut tx, commits);
                    tokio::pin!(applying);
                    tokio::select! {
                        applied = &mut applying => applied,
                        // a group held up (a run row another transaction holds) holds up no other
                        _ = tokio::time::sleep(hold) => {
                            drop(turn.take());
                            applying.await
                        }
                    }
                };
                drop(turn.take());
                match applied {
                    Ok((answers, writes)) => {
                        if writes {
                            tx.commit().await.map_err(|e| GroupFailure::Commit(db("commit")(e)))?;
                        } else {
                            // every commit refused by its fence: nothing to write
                            tx.rollback().await.map_err(|e| GroupFailure::Commit(db("roll back")(e)))?;
                        }
                        Ok(answers)
                    }
                    Err(failure) => {
                        // at once, not when the connection is next used: the run rows stay locked
                        // until then, and the commits are about to be written again one by one
                        tx.rollback().await.map_err(|e| GroupFailure::Commit(db("roll back")(e)))?;
                        Err(failure)
                    }
                }
            },
            // written, or rolled back at the database's word: the connection is in sync
            |out| !matches!(out, Err(GroupFailure::Commit(_))),
            |e| GroupFailure::Commit(db("begin a transaction")(e)),
        )
        .await
}

/// Locks and reads the group's run rows, checks each commit's fence, writes the commits that pass:
/// their answers, and whether anything was written.
async fn apply(
    conn: &mut PgConnection,
    commits: &[&Commit],
) -> Result<(Vec<StoreResult<Committed>>, bool), GroupFailure> {
    let mut ids: Vec<&str> = commits.iter().map(|c| c.run_id.as_str()).collect();
    ids.sort_unstable();
    let rows = sqlx::query(
        "SELECT id, status, conversation_id, next_sequence, cancel_requested, lease_owner, lease_expires_at, reason, \
         EXISTS (SELECT 1 FROM runs w WHERE w.conversation_id = runs.conversation_id AND w.status = 'waiting') \
             AS waiting_behind \
         FROM runs WHERE id = ANY($1) ORDER BY id FOR NO KEY UPDATE OF runs",
    )
    .bind(&ids)
    .fetch_all(&mut *conn)
    .await
    .map_err(|e| GroupFailure::Commit(db("lock the runs")(e)))?;
    let mut runs = HashMap::with_capacity(rows.len());
    for row in &rows {
        let c = Cols::new(row, "runs");
        let read = || -> StoreResult<(String, RunRow)> {
            Ok((
                c.get("id")?,
                RunRow {
                    status: c.parse("status", RunStatus::parse)?,
                    conversation_id: c.id("conversation_id")?,
                    next_sequence: c.get("next_sequence")?,
                    cancel_requested: c.get("cancel_requested")?,
                    lease_owner: c.get("lease_owner")?,
                    lease_expires_at: c.opt_ts("lease_expires_at")?,
                    reason: c.get("reason")?,
                    waiting_behind: c.get("waiting_behind")?,
                },
            ))
        };
        // an unreadable row: each commit gets its own answer from the lone path
        let (id, run) = read().map_err(|_| GroupFailure::Regroup)?;
        runs.insert(id, run);
    }

    let mut answers = Vec::with_capacity(commits.len());
    let mut batch = Batch::default();
    for c in commits {
        let answer = match runs.get(c.run_id.as_str()) {
            None => Err(StoreError::NotFound("run")),
            Some(run) => match fence(c, run) {
                Err(refusal) => Err(refusal),
                Ok(()) => {
                    if !batch.add(c, run).map_err(|_| GroupFailure::Regroup)? {
                        return Err(GroupFailure::Regroup);
                    }
                    Ok(committed(c, run))
                }
            },
        };
        answers.push(answer);
    }
    let writes = !batch.runs.ids.is_empty();
    if writes {
        batch.execute(conn).await?;
    }
    Ok((answers, writes))
}

/// The fence and the status move of a lone commit's conditional `UPDATE` (and its refusal's
/// wording), checked against the locked row.
fn fence(c: &Commit, run: &RunRow) -> StoreResult<()> {
    crate::fence::check(c, run.status, run.lease_owner.as_deref())
}

fn committed(c: &Commit, run: &RunRow) -> Committed {
    let now = micros(c.now);
    let events = (run.next_sequence..)
        .zip(&c.events)
        .map(|(sequence, kind)| Event::new(kind.clone(), c.run_id.clone(), sequence, now))
        .collect();
    let waiting_behind = run.waiting_behind && c.run.as_ref().is_some_and(|change| change.to.is_terminal());
    Committed { events, cancel_requested: run.cancel_requested, waiting_behind }
}

/// Column arrays of one multi-row statement: `UNNEST` of one array per column.
#[derive(Default)]
struct RunUpdates {
    ids: Vec<String>,
    status: Vec<&'static str>,
    reason: Vec<Option<String>>,
    lease_owner: Vec<Option<String>>,
    lease_expires_at: Vec<Option<DateTime<Utc>>>,
    next_sequence: Vec<i64>,
    updated_at: Vec<DateTime<Utc>>,
    checkpoint: Vec<Option<Value>>,
    /// The instance that takes the run (an acquiring fence); `None` keeps the row's.
    worker: Vec<Option<String>>,
}

#[derive(Default)]
struct Texts {
    ids: Vec<String>,
    conversation_ids: Vec<String>,
    run_ids: Vec<String>,
    texts: Vec<String>,
    created_at: Vec<DateTime<Utc>>,
}

#[derive(Default)]
struct Messages {
    ids: Vec<String>,
    conversation_ids: Vec<String>,
    run_ids: Vec<Option<String>>,
    roles: Vec<&'static str>,
    contents: Vec<String>,
    tool_call_ids: Vec<Option<String>>,
    created_at: Vec<DateTime<Utc>>,
}

#[derive(Default)]
struct Discards {
    ids: Vec<String>,
    run_ids: Vec<String>,
}

#[derive(Default)]
struct CallInserts {
    ids: Vec<String>,
    run_ids: Vec<String>,
    conversation_ids: Vec<String>,
    names: Vec<String>,
    args: Vec<Value>,
    states: Vec<&'static str>,
    results: Vec<Option<Value>>,
    summaries: Vec<Option<String>>,
    started_at: Vec<Option<DateTime<Utc>>>,
    finished_at: Vec<Option<DateTime<Utc>>>,
    attempts: Vec<i32>,
}

#[derive(Default)]
struct CallUpdates {
    ids: Vec<String>,
    run_ids: Vec<String>,
    from: Vec<&'static str>,
    to: Vec<&'static str>,
    args: Vec<Option<Value>>,
    results: Vec<Option<Value>>,
    summaries: Vec<Option<String>>,
    started_at: Vec<Option<DateTime<Utc>>>,
    finished_at: Vec<Option<DateTime<Utc>>>,
    attempts: Vec<Option<i32>>,
}

#[derive(Default)]
struct InterruptInserts {
    ids: Vec<String>,
    run_ids: Vec<String>,
    kinds: Vec<&'static str>,
    statuses: Vec<&'static str>,
    payloads: Vec<Value>,
    call_ids: Vec<Value>,
    created_at: Vec<DateTime<Utc>>,
    expires_at: Vec<DateTime<Utc>>,
    decisions: Vec<Option<Value>>,
    resolved_by: Vec<Option<String>>,
    resolved_at: Vec<Option<DateTime<Utc>>>,
    notes: Vec<Option<String>>,
}

#[derive(Default)]
struct InterruptChanges {
    ids: Vec<String>,
    run_ids: Vec<String>,
    to: Vec<&'static str>,
    decisions: Vec<Option<Value>>,
    resolved_by: Vec<Option<String>>,
    notes: Vec<Option<String>>,
    now: Vec<DateTime<Utc>>,
    resolving: Vec<bool>,
}

#[derive(Default)]
struct Events {
    run_ids: Vec<String>,
    sequences: Vec<i64>,
    types: Vec<&'static str>,
    /// JSON text, cast by the statement (no `Value` built to be serialized again).
    data: Vec<String>,
    created_at: Vec<DateTime<Utc>>,
}

#[derive(Default)]
struct Answers {
    user_ids: Vec<String>,
    keys: Vec<String>,
    request_hashes: Vec<String>,
    statuses: Vec<i64>,
    responses: Vec<Value>,
    expires_at: Vec<DateTime<Utc>>,
    /// The latest of the commits' instants: a key expired by then is free (the group is written
    /// after every one of them).
    now: Option<DateTime<Utc>>,
}

/// Everything the group writes, a column array per table column.
#[derive(Default)]
struct Batch {
    runs: RunUpdates,
    texts: Texts,
    messages: Messages,
    discards: Discards,
    call_inserts: CallInserts,
    /// The calls' updates, one row per call: a call moved twice by one commit (a commit that
    /// joined two steps: an answer's `allowed`, then the attempt's `executing`) is one move from
    /// the first state to the last, with the later values over the earlier ones, as the two
    /// updates one after the other would leave it. One statement matches each row once.
    call_updates: CallUpdates,
    interrupt_inserts: InterruptInserts,
    interrupt_changes: InterruptChanges,
    /// (conversation, key) → (value, source, updated_at): the last write of a key wins, as it
    /// would one commit after the other.
    facts: HashMap<(String, String), (String, &'static str, DateTime<Utc>)>,
    /// conversation → (through message, text)
    summaries: HashMap<String, (String, String)>,
    events: Events,
    answers: Answers,
}

impl Batch {
    /// Adds a commit whose fence passed. `Ok(false)`: a check past the fence refuses it (the lone
    /// path gives its answer).
    fn add(&mut self, c: &Commit, run: &RunRow) -> StoreResult<bool> {
        let now = micros(c.now);
        let conversation = run.conversation_id.as_str();
        let run_id = c.run_id.as_str();

        // records handed to the commit must belong to its run and conversation; transitions must be
        // allowed
        let owned = c
            .messages
            .iter()
            .all(|m| m.conversation_id == run.conversation_id && m.run_id.as_ref().is_none_or(|r| *r == c.run_id))
            && c.tool_calls.iter().all(|change| match change {
                ToolCallChange::Insert(call) => call.run_id == c.run_id,
                ToolCallChange::Update(u) => u.from.can_transition_to(u.to),
            })
            && c.new_interrupts.iter().all(|i| i.run_id == c.run_id)
            && c.interrupt_changes.iter().all(|change| InterruptStatus::Pending.can_transition_to(change.to))
            && c.summary.as_ref().is_none_or(|s| s.conversation_id == run.conversation_id);
        if !owned {
            return Ok(false);
        }

        // the run row: fence, status move, checkpoint in one row of one UPDATE
        let n = i64::try_from(c.events.len()).map_err(|_| StoreError::Backend("too many events".into()))?;
        let (mut lease_owner, mut lease_expires_at) = (run.lease_owner.clone(), run.lease_expires_at);
        let mut worker = None;
        match &c.fence {
            // renewed by a status move only, as the one-commit fence does (`Fence::Lease`)
            Fence::Lease { lease_until, .. } if c.run.is_some() => lease_expires_at = Some(*lease_until),
            Fence::Lease { .. } => {}
            Fence::Acquire { owner, lease_until, .. } => {
                lease_owner = Some(owner.clone());
                lease_expires_at = Some(*lease_until);
                worker = Some(lease_holder(owner).to_owned());
            }
            Fence::Unowned { .. } => {}
        }
        let (mut status, mut reason) = (run.status, run.reason.clone());
        if let Some(change) = &c.run {
            status = change.to;
            reason = change.reason.clone();
            // a paused or finished run has no worker
            if change.to == RunStatus::Interrupted || change.to.is_terminal() {
                lease_owner = None;
                lease_expires_at = None;
            }
        }
        let r = &mut self.runs;
        r.ids.push(run_id.to_owned());
        r.status.push(status.as_str());
        r.reason.push(reason);
        r.lease_owner.push(lease_owner);
        r.lease_expires_at.push(lease_expires_at);
        r.next_sequence.push(run.next_sequence + n);
        r.updated_at.push(c.now);
        r.checkpoint.push(c.checkpoint.as_ref().map(|cp| json("checkpoint", cp)).transpose()?);
        r.worker.push(worker);

        for t in &c.text {
            // one row per message in one statement: appends to one message are joined first
            if let Some(i) = (0..self.texts.ids.len())
                .rev()
                .find(|&i| self.texts.ids[i] == t.message_id.as_str() && self.texts.run_ids[i] == run_id)
            {
                self.texts.texts[i].push_str(&t.text);
                continue;
            }
            self.texts.ids.push(t.message_id.as_str().to_owned());
            self.texts.conversation_ids.push(conversation.to_owned());
            self.texts.run_ids.push(run_id.to_owned());
            self.texts.texts.push(t.text.clone());
            self.texts.created_at.push(now);
        }
        for m in &c.messages {
            let ms = &mut self.messages;
            ms.ids.push(m.id.as_str().to_owned());
            ms.conversation_ids.push(m.conversation_id.as_str().to_owned());
            ms.run_ids.push(m.run_id.as_ref().map(|r| r.as_str().to_owned()));
            ms.roles.push(m.role.as_str());
            ms.contents.push(m.content.as_str().to_owned());
            ms.tool_call_ids.push(m.tool_call_id.as_ref().map(|id| id.as_str().to_owned()));
            ms.created_at.push(m.created_at);
        }
        for id in &c.discard_messages {
            self.discards.ids.push(id.as_str().to_owned());
            self.discards.run_ids.push(run_id.to_owned());
        }
        // one row per call (see `fold_calls`); a move that does not start where its call is: refused
        let Some((inserted, moved)) = fold_calls(&c.tool_calls) else { return Ok(false) };
        for call in inserted {
            let ci = &mut self.call_inserts;
            ci.ids.push(call.id.as_str().to_owned());
            ci.run_ids.push(call.run_id.as_str().to_owned());
            ci.conversation_ids.push(conversation.to_owned());
            ci.names.push(call.name);
            ci.args.push(call.args.into_inner());
            ci.states.push(call.state.as_str());
            ci.results.push(call.result.map(Masked::into_inner));
            ci.summaries.push(call.summary.map(Masked::into_inner));
            ci.started_at.push(call.started_at);
            ci.finished_at.push(call.finished_at);
            ci.attempts.push(call.attempts as i32);
        }
        for u in moved {
            let cu = &mut self.call_updates;
            cu.ids.push(u.id.as_str().to_owned());
            cu.run_ids.push(run_id.to_owned());
            cu.from.push(u.from.as_str());
            cu.to.push(u.to.as_str());
            cu.args.push(u.args.map(Masked::into_inner));
            cu.results.push(u.result.map(Masked::into_inner));
            cu.summaries.push(u.summary.map(Masked::into_inner));
            cu.started_at.push(u.started_at);
            cu.finished_at.push(u.finished_at);
            cu.attempts.push(u.attempts.map(|n| n as i32));
        }
        for i in &c.new_interrupts {
            let ii = &mut self.interrupt_inserts;
            ii.ids.push(i.id.as_str().to_owned());
            ii.run_ids.push(i.run_id.as_str().to_owned());
            ii.kinds.push(i.kind.as_str());
            ii.statuses.push(i.status.as_str());
            ii.payloads.push(i.payload.inner().clone());
            ii.call_ids.push(json("interrupt call ids", &i.call_ids)?);
            ii.created_at.push(i.created_at);
            ii.expires_at.push(i.expires_at);
            ii.decisions.push(i.decision.as_ref().map(|d| d.inner().clone()));
            ii.resolved_by.push(i.resolved_by.clone());
            ii.resolved_at.push(i.resolved_at);
            ii.notes.push(i.note.as_ref().map(|n| n.as_str().to_owned()));
        }
        for change in &c.interrupt_changes {
            let ic = &mut self.interrupt_changes;
            ic.ids.push(change.id.as_str().to_owned());
            ic.run_ids.push(run_id.to_owned());
            ic.to.push(change.to.as_str());
            ic.decisions.push(change.decision.as_ref().map(|d| d.inner().clone()));
            ic.resolved_by.push(change.resolved_by.clone());
            ic.notes.push(change.note.as_ref().map(|n| n.as_str().to_owned()));
            ic.now.push(c.now);
            ic.resolving.push(change.to == InterruptStatus::Resolved);
        }
        for f in &c.facts {
            self.facts.insert(
                (conversation.to_owned(), f.key.clone()),
                (f.value.as_str().to_owned(), f.source.as_str(), f.updated_at),
            );
        }
        if let Some(s) = &c.summary {
            self.summaries.insert(
                conversation.to_owned(),
                (s.through_message_id.as_str().to_owned(), s.text.as_str().to_owned()),
            );
        }
        for (sequence, kind) in (run.next_sequence..).zip(&c.events) {
            let e = &mut self.events;
            e.run_ids.push(run_id.to_owned());
            e.sequences.push(sequence);
            e.types.push(kind.type_name());
            e.data.push(crate::pipeline::event_data(kind)?);
            e.created_at.push(now);
        }
        if let Some(answer) = &c.idempotency {
            let a = &mut self.answers;
            a.user_ids.push(answer.user_id.clone());
            a.keys.push(answer.key.clone());
            a.request_hashes.push(answer.request_hash.clone());
            a.statuses.push(i64::from(answer.status));
            a.responses.push(answer.response.clone());
            a.expires_at.push(answer.expires_at);
            a.now = a.now.max(Some(c.now));
        }
        Ok(true)
    }

    /// The group's statements, in the order a lone commit makes them, sent as few as they can be:
    /// see [`stages`]. A statement that fails, or a conditional one that matches fewer rows than it
    /// was given, refuses a commit: `Regroup`.
    async fn execute(self, conn: &mut PgConnection) -> Result<(), GroupFailure> {
        // in key order, so two groups lock the rows of one conversation in the same order
        let mut facts: Vec<_> = self.facts.iter().collect();
        facts.sort_unstable_by(|a, b| a.0.cmp(b.0));
        let mut fact_columns = (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for ((conversation, key), (value, source, updated_at)) in facts {
            fact_columns.0.push(conversation.as_str());
            fact_columns.1.push(key.as_str());
            fact_columns.2.push(value.as_str());
            fact_columns.3.push(*source);
            fact_columns.4.push(*updated_at);
        }
        let mut summaries: Vec<_> = self.summaries.iter().collect();
        summaries.sort_unstable_by(|a, b| a.0.cmp(b.0));
        let mut summary_columns = (Vec::new(), Vec::new(), Vec::new());
        for (conversation, (through, text)) in summaries {
            summary_columns.0.push(conversation.as_str());
            summary_columns.1.push(through.as_str());
            summary_columns.2.push(text.as_str());
        }

        let mut parts: Vec<Part<'_>> = Vec::new();
        let r = &self.runs;
        parts.push(Part::new(RUNS, UPDATE_RUNS, None, r.ids.iter(), move |q| {
            q.bind(&r.ids)
                .bind(&r.status)
                .bind(&r.reason)
                .bind(&r.lease_owner)
                .bind(&r.lease_expires_at)
                .bind(&r.next_sequence)
                .bind(&r.updated_at)
                .bind(&r.checkpoint)
                .bind(&r.worker)
        }));
        let t = &self.texts;
        if !t.ids.is_empty() {
            parts.push(Part::new(MESSAGES, APPEND_TEXTS, Some(t.ids.len()), t.run_ids.iter(), move |q| {
                q.bind(&t.ids).bind(&t.conversation_ids).bind(&t.run_ids).bind(&t.texts).bind(&t.created_at)
            }));
        }
        let m = &self.messages;
        if !m.ids.is_empty() {
            parts.push(Part::new(MESSAGES, INSERT_MESSAGES, None, m.run_ids.iter().flatten(), move |q| {
                q.bind(&m.ids)
                    .bind(&m.conversation_ids)
                    .bind(&m.run_ids)
                    .bind(&m.roles)
                    .bind(&m.contents)
                    .bind(&m.tool_call_ids)
                    .bind(&m.created_at)
            }));
        }
        let d = &self.discards;
        if !d.ids.is_empty() {
            // a message that never got its first text was never created: nothing to delete is fine
            parts.push(Part::new(MESSAGES, DISCARD_MESSAGES, None, d.run_ids.iter(), move |q| {
                q.bind(&d.ids).bind(&d.run_ids)
            }));
        }
        let ci = &self.call_inserts;
        if !ci.ids.is_empty() {
            parts.push(Part::new(TOOL_CALLS, INSERT_CALLS, None, ci.run_ids.iter(), move |q| {
                q.bind(&ci.ids)
                    .bind(&ci.run_ids)
                    .bind(&ci.conversation_ids)
                    .bind(&ci.names)
                    .bind(&ci.args)
                    .bind(&ci.states)
                    .bind(&ci.results)
                    .bind(&ci.summaries)
                    .bind(&ci.started_at)
                    .bind(&ci.finished_at)
                    .bind(&ci.attempts)
            }));
        }
        let cu = &self.call_updates;
        if !cu.ids.is_empty() {
            // one row per call
            parts.push(Part::new(TOOL_CALLS, UPDATE_CALLS, Some(cu.ids.len()), cu.run_ids.iter(), move |q| {
                q.bind(&cu.ids)
                    .bind(&cu.run_ids)
                    .bind(&cu.from)
                    .bind(&cu.to)
                    .bind(&cu.args)
                    .bind(&cu.results)
                    .bind(&cu.summaries)
                    .bind(&cu.started_at)
                    .bind(&cu.finished_at)
                    .bind(&cu.attempts)
            }));
        }
        let ii = &self.interrupt_inserts;
        if !ii.ids.is_empty() {
            parts.push(Part::new(INTERRUPTS, INSERT_INTERRUPTS, None, ii.run_ids.iter(), move |q| {
                q.bind(&ii.ids)
                    .bind(&ii.run_ids)
                    .bind(&ii.kinds)
                    .bind(&ii.statuses)
                    .bind(&ii.payloads)
                    .bind(&ii.call_ids)
                    .bind(&ii.created_at)
                    .bind(&ii.expires_at)
                    .bind(&ii.decisions)
                    .bind(&ii.resolved_by)
                    .bind(&ii.resolved_at)
                    .bind(&ii.notes)
            }));
        }
        let ic = &self.interrupt_changes;
        if !ic.ids.is_empty() {
            // an interrupt past its expiry may still expire or be cancelled, never be resolved
            parts.push(Part::new(INTERRUPTS, CHANGE_INTERRUPTS, Some(ic.ids.len()), ic.run_ids.iter(), move |q| {
                q.bind(&ic.ids)
                    .bind(&ic.run_ids)
                    .bind(&ic.to)
                    .bind(&ic.decisions)
                    .bind(&ic.resolved_by)
                    .bind(&ic.notes)
                    .bind(&ic.now)
                    .bind(&ic.resolving)
            }));
        }
        if !fact_columns.0.is_empty() {
            let f = &fact_columns;
            parts.push(Part::new(FACTS, UPSERT_FACTS, None, no_runs(), move |q| {
                q.bind(&f.0).bind(&f.1).bind(&f.2).bind(&f.3).bind(&f.4)
            }));
        }
        if !summary_columns.0.is_empty() {
            let c = &summary_columns;
            parts.push(Part::new(SUMMARIES, UPSERT_SUMMARIES, None, no_runs(), move |q| {
                q.bind(&c.0).bind(&c.1).bind(&c.2)
            }));
        }
        let e = &self.events;
        if !e.run_ids.is_empty() {
            parts.push(Part::new(RUN_EVENTS, INSERT_EVENTS, None, no_runs(), move |q| {
                q.bind(&e.run_ids).bind(&e.sequences).bind(&e.types).bind(&e.data).bind(&e.created_at)
            }));
        }
        let a = &self.answers;
        if !a.keys.is_empty() {
            parts.push(Part::new(IDEMPOTENCY_KEYS, STORE_ANSWERS, Some(a.keys.len()), no_runs(), move |q| {
                q.bind(&a.user_ids)
                    .bind(&a.keys)
                    .bind(&a.request_hashes)
                    .bind(&a.statuses)
                    .bind(&a.responses)
                    .bind(&a.expires_at)
                    .bind(a.now)
            }));
        }

        for stage in stages(parts) {
            run_stage(conn, stage).await?;
        }
        Ok(())
    }
}

const RUNS: &str = "runs";
const MESSAGES: &str = "messages";
const TOOL_CALLS: &str = "tool_calls";
const INTERRUPTS: &str = "interrupts";
const FACTS: &str = "facts";
const SUMMARIES: &str = "summaries";
const RUN_EVENTS: &str = "run_events";
const IDEMPOTENCY_KEYS: &str = "idempotency_keys";

const UPDATE_RUNS: &str = "UPDATE runs SET status = u.status, reason = u.reason, lease_owner = u.lease_owner, \
     lease_expires_at = u.lease_expires_at, next_sequence = u.next_sequence, updated_at = u.updated_at, \
     checkpoint = COALESCE(u.checkpoint, runs.checkpoint), worker = COALESCE(u.worker, runs.worker) \
     FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::timestamptz[], $6::bigint[], \
                 $7::timestamptz[], $8::jsonb[], $9::text[]) \
          AS u (id, status, reason, lease_owner, lease_expires_at, next_sequence, updated_at, checkpoint, worker) \
     WHERE runs.id = u.id";
const APPEND_TEXTS: &str =
    "INSERT INTO messages (id, conversation_id, run_id, role, content, tool_call_id, created_at) \
     SELECT t.id, t.conversation_id, t.run_id, 'assistant', t.content, NULL, t.created_at \
     FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::timestamptz[]) \
          AS t (id, conversation_id, run_id, content, created_at) \
     ON CONFLICT (id) DO UPDATE SET content = messages.content || excluded.content \
     WHERE messages.run_id = excluded.run_id AND messages.role = 'assistant'";
const INSERT_MESSAGES: &str =
    "INSERT INTO messages (id, conversation_id, run_id, role, content, tool_call_id, created_at) \
     SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::text[], $6::text[], $7::timestamptz[])";
const DISCARD_MESSAGES: &str = "DELETE FROM messages USING unnest($1::text[], $2::text[]) AS d (id, run_id) \
     WHERE messages.id = d.id AND messages.run_id = d.run_id AND messages.role = 'assistant'";
const INSERT_CALLS: &str = "INSERT INTO tool_calls (id, run_id, conversation_id, name, args, state, result, summary, \
     started_at, finished_at, attempts) \
     SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::jsonb[], $6::text[], \
                          $7::jsonb[], $8::text[], $9::timestamptz[], $10::timestamptz[], $11::int4[])";
const UPDATE_CALLS: &str = "UPDATE tool_calls SET state = u.to_state, args = COALESCE(u.args, tool_calls.args), \
     result = COALESCE(u.result, tool_calls.result), summary = COALESCE(u.summary, tool_calls.summary), \
     started_at = COALESCE(u.started_at, tool_calls.started_at), \
     finished_at = COALESCE(u.finished_at, tool_calls.finished_at), \
     attempts = COALESCE(u.attempts, tool_calls.attempts) \
     FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::jsonb[], $6::jsonb[], $7::text[], \
                 $8::timestamptz[], $9::timestamptz[], $10::int4[]) \
          AS u (id, run_id, from_state, to_state, args, result, summary, started_at, finished_at, attempts) \
     WHERE tool_calls.id = u.id AND tool_calls.run_id = u.run_id AND tool_calls.state = u.from_state";
const INSERT_INTERRUPTS: &str = "INSERT INTO interrupts (id, run_id, kind, status, payload, call_ids, created_at, \
     expires_at, decision, resolved_by, resolved_at, note) \
     SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::jsonb[], $6::jsonb[], \
                          $7::timestamptz[], $8::timestamptz[], $9::jsonb[], $10::text[], \
                          $11::timestamptz[], $12::text[])";
const CHANGE_INTERRUPTS: &str = "UPDATE interrupts SET status = u.to_status, \
     decision = COALESCE(u.decision, interrupts.decision), \
     resolved_by = COALESCE(u.resolved_by, interrupts.resolved_by), resolved_at = u.now, \
     note = COALESCE(u.note, interrupts.note) \
     FROM unnest($1::text[], $2::text[], $3::text[], $4::jsonb[], $5::text[], $6::text[], \
                 $7::timestamptz[], $8::bool[]) \
          AS u (id, run_id, to_status, decision, resolved_by, note, now, resolving) \
     WHERE interrupts.id = u.id AND interrupts.run_id = u.run_id AND interrupts.status = 'pending' \
       AND (NOT u.resolving OR interrupts.expires_at > u.now)";
const UPSERT_FACTS: &str = "INSERT INTO facts (conversation_id, key, value, source, updated_at) \
     SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::timestamptz[]) \
     ON CONFLICT (conversation_id, key) DO UPDATE SET value = excluded.value, source = excluded.source, \
     updated_at = excluded.updated_at";
const UPSERT_SUMMARIES: &str = "INSERT INTO summaries (conversation_id, through_message_id, text) \
     SELECT * FROM unnest($1::text[], $2::text[], $3::text[]) \
     ON CONFLICT (conversation_id) DO UPDATE SET through_message_id = excluded.through_message_id, \
     text = excluded.text";
const INSERT_EVENTS: &str = "INSERT INTO run_events (run_id, sequence, type, data, created_at) \
     SELECT e.run_id, e.sequence, e.type, e.data::jsonb, e.created_at \
     FROM unnest($1::text[], $2::bigint[], $3::text[], $4::text[], $5::timestamptz[]) \
          AS e (run_id, sequence, type, data, created_at)";
/// As a lone commit's (`pipeline::STORE_ANSWER`): a free key taken, the same request's in-flight key
/// completed, a key holding an answer left alone (fewer rows than answers: the group is refused).
const STORE_ANSWERS: &str = "INSERT INTO idempotency_keys AS k \
     (user_id, key, request_hash, state, status, response, expires_at) \
     SELECT u.user_id, u.key, u.request_hash, 'done', u.status, u.response, u.expires_at \
     FROM unnest($1::text[], $2::text[], $3::text[], $4::bigint[], $5::jsonb[], $6::timestamptz[]) \
          AS u (user_id, key, request_hash, status, response, expires_at) \
     ON CONFLICT (user_id, key) DO UPDATE SET request_hash = excluded.request_hash, state = 'done', \
     status = excluded.status, response = excluded.response, expires_at = excluded.expires_at \
     WHERE k.expires_at <= $7::timestamptz \
        OR (k.state = 'in_flight' AND k.request_hash = excluded.request_hash)";

type PgQuery<'q> = Query<'q, Postgres, PgArguments>;

/// One multi-row statement of a group: the table it writes, its text (parameters `$1`, `$2`, …),
/// what binds them, how many rows it must change when it is conditional, and the runs
/// whose rows it writes.
struct Part<'q> {
    table: &'static str,
    sql: &'static str,
    expect: Option<usize>,
    runs: HashSet<&'q str>,
    bind: Box<dyn FnOnce(PgQuery<'q>) -> PgQuery<'q> + Send + 'q>,
}

impl<'q> Part<'q> {
    fn new<S: AsRef<str> + 'q>(
        table: &'static str,
        sql: &'static str,
        expect: Option<usize>,
        runs: impl Iterator<Item = &'q S>,
        bind: impl FnOnce(PgQuery<'q>) -> PgQuery<'q> + Send + 'q,
    ) -> Self {
        Self { table, sql, expect, runs: runs.map(AsRef::as_ref).collect(), bind: Box::new(bind) }
    }
}

fn no_runs() -> std::iter::Empty<&'static String> {
    std::iter::empty()
}

/// The parts in stages, each sent as one statement, in order. A part joins the last stage unless
/// a part of it writes the same table for one of the same runs: then it starts the next one. Within
/// a stage, parts write different rows, and the rows of one conversation's messages come in order
/// (their `seq`), so one statement of them all — its parts run with one snapshot, in an order
/// PostgreSQL chooses — writes what they would one after the other. The usual group is one stage:
/// with `BEGIN`, the lock and `COMMIT`, four round trips, not one per table.
fn stages(parts: Vec<Part<'_>>) -> Vec<Vec<Part<'_>>> {
    let mut stages: Vec<Vec<Part<'_>>> = Vec::new();
    for part in parts {
        let joins = stages
            .last()
            .is_some_and(|stage| !stage.iter().any(|p| p.table == part.table && !p.runs.is_disjoint(&part.runs)));
        match stages.last_mut() {
            Some(stage) if joins => stage.push(part),
            _ => stages.push(vec![part]),
        }
    }
    stages
}

/// `sql` with its parameters `$n` renumbered `$(n + offset)`, and the highest `n` it had.
fn shifted(sql: &str, offset: usize) -> (String, usize) {
    let mut out = String::with_capacity(sql.len() + 16);
    let mut highest = 0;
    let mut rest = sql;
    while let Some(at) = rest.find('$') {
        out.push_str(&rest[..=at]);
        rest = &rest[at + 1..];
        let digits = rest.find(|c: char| !c.is_ascii_digit()).unwrap_or(rest.len());
        if let Ok(n) = rest[..digits].parse::<usize>() {
            out.push_str(&(n + offset).to_string());
            highest = highest.max(n);
        }
        rest = &rest[digits..];
    }
    out.push_str(rest);
    (out, highest)
}

/// One stage's statement, several parts as the data-modifying `WITH` clauses of one statement,
/// which answers how many rows each conditional one changed. Made once per combination of parts
/// (a handful: the kinds of commits there are) and kept for the process's life, so the statement
/// is the same text, prepared once per connection.
fn stage_sql(stage: &[Part<'_>]) -> &'static str {
    type Shape = Vec<(usize, bool)>;
    static MADE: LazyLock<std::sync::Mutex<HashMap<Shape, &'static str>>> = LazyLock::new(Default::default);
    let shape: Shape = stage.iter().map(|p| (p.sql.as_ptr() as usize, p.expect.is_some())).collect();
    let mut made = MADE.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(sql) = made.get(&shape) {
        return sql;
    }
    let sql: &'static str = Box::leak(combined(stage).into_boxed_str());
    made.insert(shape, sql);
    sql
}

fn combined(stage: &[Part<'_>]) -> String {
    let mut sql = String::from("WITH ");
    let mut counts = Vec::new();
    let mut offset = 0;
    for (i, part) in stage.iter().enumerate() {
        if i > 0 {
            sql.push_str(", ");
        }
        let (text, params) = shifted(part.sql, offset);
        sql.push_str(&format!("p{i} AS ({text}"));
        if part.expect.is_some() {
            sql.push_str(" RETURNING 1");
            counts.push(format!("(SELECT count(*) FROM p{i})"));
        }
        sql.push(')');
        offset += params;
    }
    if counts.is_empty() {
        counts.push("0".into());
    }
    sql.push_str(" SELECT ");
    sql.push_str(&counts.join(", "));
    sql
}

async fn run_stage(conn: &mut PgConnection, stage: Vec<Part<'_>>) -> Result<(), GroupFailure> {
    let regroup = |_| GroupFailure::Regroup;
    if let [_] = stage.as_slice() {
        let part = stage.into_iter().next().ok_or(GroupFailure::Regroup)?;
        let done = (part.bind)(sqlx::query(part.sql)).execute(&mut *conn).await.map_err(regroup)?;
        if let Some(expected) = part.expect {
            all_matched(done.rows_affected(), expected)?;
        }
        return Ok(());
    }
    let sql = stage_sql(&stage);
    let mut expected = Vec::new();
    let mut query = sqlx::query(sql);
    for part in stage {
        expected.extend(part.expect);
        query = (part.bind)(query);
    }
    let row = query.fetch_one(&mut *conn).await.map_err(regroup)?;
    for (i, expected) in expected.into_iter().enumerate() {
        let matched: i64 = row.try_get(i).map_err(regroup)?;
        all_matched(u64::try_from(matched).unwrap_or_default(), expected)?;
    }
    Ok(())
}

fn all_matched(matched: u64, given: usize) -> Result<(), GroupFailure> {
    if matched == given as u64 {
        Ok(())
    } else {
        Err(GroupFailure::Regroup)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn part<'q>(table: &'static str, sql: &'static str, expect: Option<usize>, runs: &'q [String]) -> Part<'q> {
        Part::new(table, sql, expect, runs.iter(), |q| q)
    }

    #[test]
    fn parameters_are_renumbered_past_the_ones_before() {
        assert_eq!(
            shifted("a = $1 AND b = $10::text[] AND c = $2", 3),
            ("a = $4 AND b = $13::text[] AND c = $5".into(), 10)
        );
        assert_eq!(shifted("no parameters", 7), ("no parameters".into(), 0));
    }

    #[test]
    fn a_stage_takes_parts_that_write_other_rows() {
        let (a, b) = (vec!["run_a".to_owned()], vec!["run_b".to_owned()]);
        // other tables, or one table for other runs: one stage
        let parts = vec![
            part(RUNS, "UPDATE runs SET x = $1", None, &a),
            part(MESSAGES, "INSERT INTO messages VALUES ($1)", Some(1), &a),
            part(MESSAGES, "INSERT INTO messages VALUES ($1, $2)", None, &b),
            part(RUN_EVENTS, "INSERT INTO run_events VALUES ($1)", None, &[]),
        ];
        let staged = super::stages(parts);
        assert_eq!(staged.len(), 1);
        assert_eq!(
            combined(&staged[0]),
            "WITH p0 AS (UPDATE runs SET x = $1), p1 AS (INSERT INTO messages VALUES ($2) RETURNING 1), \
             p2 AS (INSERT INTO messages VALUES ($3, $4)), p3 AS (INSERT INTO run_events VALUES ($5)) \
             SELECT (SELECT count(*) FROM p1)"
        );
        // one table for one run twice: the second waits for the next stage, and what follows it too
        let parts = vec![
            part(TOOL_CALLS, "INSERT INTO tool_calls VALUES ($1)", None, &a),
            part(TOOL_CALLS, "UPDATE tool_calls SET y = $1", Some(1), &a),
            part(RUN_EVENTS, "INSERT INTO run_events VALUES ($1)", None, &[]),
        ];
        let staged = super::stages(parts);
        let tables: Vec<Vec<&str>> = staged.iter().map(|s| s.iter().map(|p| p.sql).collect()).collect();
        assert_eq!(
            tables,
            [
                vec!["INSERT INTO tool_calls VALUES ($1)"],
                vec!["UPDATE tool_calls SET y = $1", "INSERT INTO run_events VALUES ($1)"]
            ]
        );
        assert_eq!(
            combined(&staged[1][..1]),
            "WITH p0 AS (UPDATE tool_calls SET y = $1 RETURNING 1) SELECT (SELECT count(*) FROM p0)"
        );
        // nothing conditional: the statement still answers a row
        assert!(combined(&staged[0]).ends_with(" SELECT 0"));
    }
}
