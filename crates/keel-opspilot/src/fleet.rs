//! The simulated fleet: services, environments, instances with a status, a restart count and a
//! release, and an error log. It lives in tables of its own (`opspilot_…`) in Keel's database, so
//! several Keel instances on one Postgres share it, and it is queried filtered and limited in the
//! database, so its size does not matter to a run.
//!
//! Its side effects (a restart, a rollback) happen **once per idempotency key**: the effect and the
//! answer it gave are written in one transaction, keyed by the call's key, and a call that comes
//! again with the key gets the recorded answer without applying anything. That is what makes the
//! restart tool idempotent — the same contract an external HTTP service offers when it honours
//! `Idempotency-Key` — so the engine may retry it after a crash.

use async_trait::async_trait;
use chrono::{Duration, SecondsFormat};
use keel_core::domain::Timestamp;
use keel_core::store::StoreError;
use keel_store::rusqlite::{self, params, OptionalExtension};
use keel_store::sqlx::{self, Row};
use keel_store::{PostgresStore, SqliteStore};
use serde::{Deserialize, Serialize};

/// Services with the prefix of their instance ids.
pub const SERVICES: &[(&str, &str)] = &[("payment-api", "pay"), ("order-api", "order"), ("inventory-api", "inv")];
/// Environments with their number of regular instances.
pub const ENVS: &[(&str, u32)] = &[("prod", 3), ("staging", 2)];
pub const RELEASE: &str = "v2.4.1";
pub const PREVIOUS_RELEASE: &str = "v2.4.0";
/// The instance the demo story is about: abnormal, the source of payment-api's recent errors.
pub const ABNORMAL_INSTANCE: &str = "pay-prod-2";

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct Instance {
    pub id: String,
    pub service: String,
    pub env: String,
    /// `healthy` or `abnormal`.
    pub status: String,
    pub restart_count: i64,
    pub release: String,
    pub previous_release: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ErrorLogEntry {
    pub service: String,
    pub env: String,
    pub instance_id: String,
    pub status_code: i64,
    pub message: String,
    pub at: Timestamp,
}

/// How the fleet is seeded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct FleetSeed {
    /// Extra abnormal instances per service, on top of the one seeded `pay-prod-2`.
    pub extra_abnormal: u32,
    /// Extra healthy prod instances per service: a large fleet, for benchmarks.
    pub extra_healthy: u32,
}

/// One service in one environment.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, utoipa::ToSchema)]
pub struct ServiceSummary {
    pub service: String,
    pub env: String,
    pub instances: i64,
    pub abnormal: i64,
}

/// What the error log says of a service in an environment since some time.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ErrorStats {
    pub count: i64,
    /// (status code, how many), by code.
    pub by_status: Vec<(i64, i64)>,
    /// The instance with the most errors, and how many.
    pub top_instance: Option<(String, i64)>,
    /// The newest few.
    pub samples: Vec<ErrorLogEntry>,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FleetError {
    #[error("{0}")]
    NotFound(String),
    /// The resource is not in the state the action needs: nothing was changed.
    #[error("{0}")]
    Precondition(String),
    #[error("the fleet database failed: {0}")]
    Backend(String),
}

impl From<StoreError> for FleetError {
    fn from(e: StoreError) -> Self {
        FleetError::Backend(e.to_string())
    }
}

/// A restart, as applied (or as recorded for its key).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Restarted {
    pub instance_id: String,
    pub restart_count: i64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RolledBack {
    pub service: String,
    pub env: String,
    pub from: String,
    pub to: String,
    pub instances: i64,
}

#[async_trait]
pub trait Fleet: Send + Sync + 'static {
    /// Replaces the fleet and its error log with the seeded ones (and forgets applied effects).
    async fn seed(&self, seed: FleetSeed, now: Timestamp) -> Result<(), FleetError>;
    /// The first `limit` instances, by id.
    async fn instances(&self, limit: u32) -> Result<Vec<Instance>, FleetError>;
    async fn instance(&self, id: &str) -> Result<Option<Instance>, FleetError>;
    async fn services(&self) -> Result<Vec<ServiceSummary>, FleetError>;
    /// The abnormal instances of `service` in `env` that are not in `exclude`, by id, at most
    /// `limit`; and how many there are, counted up to `count_up_to` (a count that reaches it means
    /// "at least that many"): the work is bounded by the two, not by the fleet.
    async fn abnormal(
        &self,
        service: &str,
        env: &str,
        exclude: &[String],
        limit: u32,
        count_up_to: u32,
    ) -> Result<(Vec<Instance>, i64), FleetError>;
    /// The errors of `service` in `env` at or after `since`, with the newest `samples`.
    async fn errors(&self, service: &str, env: &str, since: Timestamp, samples: u32) -> Result<ErrorStats, FleetError>;
    /// The releases the instances of `service` in `env` are on: (release, previous), distinct.
    async fn releases(&self, service: &str, env: &str) -> Result<Vec<(String, Option<String>)>, FleetError>;
    /// `abnormal → healthy`, one more restart — once per `key`: a call with a key already used
    /// answers what the first call did and changes nothing.
    async fn restart(&self, instance_id: &str, key: &str) -> Result<Restarted, FleetError>;
    /// Every instance of `service` in `env` from `from_release` back to its previous one — once per
    /// `key`.
    async fn rollback(&self, service: &str, env: &str, from_release: &str, key: &str)
        -> Result<RolledBack, FleetError>;
}

fn instance(id: String, service: &str, env: &str, abnormal: bool) -> Instance {
    Instance {
        id,
        service: service.to_owned(),
        env: env.to_owned(),
        status: if abnormal { "abnormal" } else { "healthy" }.to_owned(),
        restart_count: 0,
        release: RELEASE.to_owned(),
        previous_release: Some(PREVIOUS_RELEASE.to_owned()),
    }
}

/// `{prefix}-{env}-{n}` for every service and environment, `pay-prod-2` abnormal, plus
/// `seed.extra_abnormal` abnormal prod instances per service, `{prefix}-prod-a1`, `-a2`, …, and
/// `seed.extra_healthy` healthy ones, `{prefix}-prod-h1`, ….
pub fn seeded_instances(seed: FleetSeed) -> Vec<Instance> {
    let mut out = Vec::new();
    for (service, prefix) in SERVICES {
        for (env, count) in ENVS {
            for n in 1..=*count {
                let id = format!("{prefix}-{env}-{n}");
                let abnormal = id == ABNORMAL_INSTANCE;
                out.push(instance(id, service, env, abnormal));
            }
        }
        for n in 1..=seed.extra_abnormal {
            out.push(instance(format!("{prefix}-prod-a{n}"), service, "prod", true));
        }
        for n in 1..=seed.extra_healthy {
            out.push(instance(format!("{prefix}-prod-h{n}"), service, "prod", false));
        }
    }
    out
}

/// Twelve 5xx errors of payment-api prod from `pay-prod-2` over the 14 minutes before `now`, five
/// older ones (two to three hours ago, outside a 15 minute window), and two recent order-api ones.
pub fn seeded_error_logs(now: Timestamp) -> Vec<ErrorLogEntry> {
    const RECENT: &[(i64, &str)] = &[
        (503, "connection pool exhausted (50/50 in use)"),
        (502, "upstream timeout after 30s: card-gateway"),
        (500, "internal error: ledger write failed"),
        (503, "connection pool exhausted (50/50 in use)"),
        (502, "upstream timeout after 30s: card-gateway"),
        (503, "service unavailable: readiness probe failing"),
        (500, "internal error: ledger write failed"),
        (503, "connection pool exhausted (50/50 in use)"),
        (502, "bad gateway: fraud-check reset the connection"),
        (503, "service unavailable: readiness probe failing"),
        (500, "internal error: transaction rolled back"),
        (503, "connection pool exhausted (50/50 in use)"),
    ];
    const OLDER: &[(&str, i64, &str)] = &[
        ("pay-prod-1", 502, "upstream timeout after 30s: card-gateway"),
        ("pay-prod-3", 500, "internal error: idempotency cache miss"),
        ("pay-prod-1", 503, "service unavailable: deploy in progress"),
        ("pay-prod-3", 502, "bad gateway: fraud-check reset the connection"),
        ("pay-prod-1", 500, "internal error: ledger write failed"),
    ];
    let entry = |service: &str, instance_id: &str, status_code: i64, message: &str, at: Timestamp| ErrorLogEntry {
        service: service.to_owned(),
        env: "prod".to_owned(),
        instance_id: instance_id.to_owned(),
        status_code,
        message: message.to_owned(),
        at,
    };
    let mut out = Vec::new();
    for (i, (code, message)) in (1i64..).zip(RECENT) {
        // 70 s apart: the oldest is 14 minutes before `now`
        out.push(entry("payment-api", ABNORMAL_INSTANCE, *code, message, now - Duration::seconds(70 * i)));
    }
    for (i, (instance_id, code, message)) in (0i64..).zip(OLDER) {
        let at = now - Duration::hours(2) - Duration::minutes(12 * i);
        out.push(entry("payment-api", instance_id, *code, message, at));
    }
    for minutes in [4, 9] {
        let message = "service unavailable: payment-api dependency failing";
        out.push(entry("order-api", "order-prod-1", 503, message, now - Duration::minutes(minutes)));
    }
    out
}

// ------------------------------------------------------------------ SQLite

const SQLITE_SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS opspilot_instances (
    id                TEXT PRIMARY KEY NOT NULL,
    service           TEXT NOT NULL,
    env               TEXT NOT NULL,
    status            TEXT NOT NULL,
    restart_count     INTEGER NOT NULL DEFAULT 0,
    release           TEXT NOT NULL,
    previous_release  TEXT
);
CREATE INDEX IF NOT EXISTS opspilot_instances_by_status ON opspilot_instances (service, env, status, id);
CREATE TABLE IF NOT EXISTS opspilot_error_logs (
    id           INTEGER PRIMARY KEY AUTOINCREMENT,
    service      TEXT NOT NULL,
    env          TEXT NOT NULL,
    instance_id  TEXT NOT NULL,
    status_code  INTEGER NOT NULL,
    message      TEXT NOT NULL,
    at           TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS opspilot_error_logs_by_service ON opspilot_error_logs (service, env, at);
CREATE TABLE IF NOT EXISTS opspilot_effects (
    key         TEXT PRIMARY KEY NOT NULL,
    answer      TEXT NOT NULL
);
";

/// Fixed-width RFC 3339, so that text comparison is time comparison.
fn ts(t: &Timestamp) -> String {
    t.to_rfc3339_opts(SecondsFormat::Nanos, true)
}

fn sql(what: &'static str) -> impl Fn(rusqlite::Error) -> StoreError {
    move |e| StoreError::Backend(format!("{what}: {e}"))
}

/// The columns [`instance_row`] reads, in its order (by position: a lookup by name compares every
/// column's name, a few hundred instructions a value).
macro_rules! instance_columns {
    () => {
        "id, service, env, status, restart_count, release, previous_release"
    };
}

fn instance_row(r: &rusqlite::Row<'_>) -> rusqlite::Result<Instance> {
    Ok(Instance {
        id: r.get(0)?,
        service: r.get(1)?,
        env: r.get(2)?,
        status: r.get(3)?,
        restart_count: r.get(4)?,
        release: r.get(5)?,
        previous_release: r.get(6)?,
    })
}

/// The fleet in Keel's SQLite database, through the store's own writer and readers.
#[derive(Debug, Clone)]
pub struct SqliteFleet(SqliteStore);

impl SqliteFleet {
    /// Creates the fleet's tables if they are missing.
    pub async fn open(store: &SqliteStore) -> Result<Self, FleetError> {
        store.write_with(|c| c.execute_batch(SQLITE_SCHEMA).map_err(sql("create the fleet's tables"))).await?;
        Ok(Self(store.clone()))
    }
}

#[async_trait]
impl Fleet for SqliteFleet {
    async fn seed(&self, seed: FleetSeed, now: Timestamp) -> Result<(), FleetError> {
        let instances = seeded_instances(seed);
        let logs = seeded_error_logs(now);
        self.0
            .write_with(move |c| {
                let fail = sql("seed the fleet");
                c.execute_batch(
                    "DELETE FROM opspilot_error_logs; DELETE FROM opspilot_instances; DELETE FROM opspilot_effects;",
                )
                .map_err(&fail)?;
                let mut insert = c
                    .prepare_cached(
                        "INSERT INTO opspilot_instances (id, service, env, status, restart_count, release, \
                         previous_release) VALUES (?, ?, ?, ?, ?, ?, ?)",
                    )
                    .map_err(&fail)?;
                for i in &instances {
                    insert
                        .execute(params![
                            i.id,
                            i.service,
                            i.env,
                            i.status,
                            i.restart_count,
                            i.release,
                            i.previous_release
                        ])
                        .map_err(&fail)?;
                }
                let mut insert = c
                    .prepare_cached(
                        "INSERT INTO opspilot_error_logs (service, env, instance_id, status_code, message, at) \
                         VALUES (?, ?, ?, ?, ?, ?)",
                    )
                    .map_err(&fail)?;
                for e in &logs {
                    insert
                        .execute(params![e.service, e.env, e.instance_id, e.status_code, e.message, ts(&e.at)])
                        .map_err(&fail)?;
                }
                Ok(())
            })
            .await?;
        Ok(())
    }

    async fn instances(&self, limit: u32) -> Result<Vec<Instance>, FleetError> {
        Ok(self
            .0
            .read_with(move |c| {
                let mut st = c
                    .prepare_cached(concat!(
                        "SELECT ",
                        instance_columns!(),
                        " FROM opspilot_instances ORDER BY id LIMIT ?"
                    ))
                    .map_err(sql("list instances"))?;
                let rows = st.query_map([limit], instance_row).map_err(sql("list instances"))?;
                rows.collect::<Result<Vec<_>, _>>().map_err(sql("list instances"))
            })
            .await?)
    }

    async fn instance(&self, id: &str) -> Result<Option<Instance>, FleetError> {
        let id = id.to_owned();
        Ok(self
            .0
            .read_brief_with(move |c| {
                c.prepare_cached(concat!("SELECT ", instance_columns!(), " FROM opspilot_instances WHERE id = ?"))
                    .and_then(|mut st| st.query_row([&id], instance_row).optional())
                    .map_err(sql("read an instance"))
            })
            .await?)
    }

    async fn services(&self) -> Result<Vec<ServiceSummary>, FleetError> {
        Ok(self
            .0
            .read_with(|c| {
                let mut st = c
                    .prepare_cached(
                        "SELECT service, env, COUNT(*) AS n, SUM(status = 'abnormal') AS abnormal \
                         FROM opspilot_instances GROUP BY service, env ORDER BY service, env",
                    )
                    .map_err(sql("list services"))?;
                let rows = st
                    .query_map([], |r| {
                        Ok(ServiceSummary {
                            service: r.get(0)?,
                            env: r.get(1)?,
                            instances: r.get(2)?,
                            abnormal: r.get(3)?,
                        })
                    })
                    .map_err(sql("list services"))?;
                rows.collect::<Result<Vec<_>, _>>().map_err(sql("list services"))
            })
            .await?)
    }

    async fn abnormal(
        &self,
        service: &str,
        env: &str,
        exclude: &[String],
        limit: u32,
        count_up_to: u32,
    ) -> Result<(Vec<Instance>, i64), FleetError> {
        let (service, env) = (service.to_owned(), env.to_owned());
        let exclude = serde_json::to_string(exclude).unwrap_or_else(|_| "[]".into());
        Ok(self
            .0
            .read_with(move |c| {
                let fail = sql("find abnormal instances");
                const WHERE: &str = "FROM opspilot_instances WHERE service = ?1 AND env = ?2 AND status = 'abnormal' \
                                     AND id NOT IN (SELECT value FROM json_each(?3))";
                let total: i64 = c
                    .prepare_cached(&format!("SELECT COUNT(*) FROM (SELECT 1 {WHERE} LIMIT ?4)"))
                    .and_then(|mut st| st.query_row(params![service, env, exclude, count_up_to], |r| r.get(0)))
                    .map_err(&fail)?;
                let mut st = c
                    .prepare_cached(&format!(
                        concat!("SELECT ", instance_columns!(), " {} ORDER BY id LIMIT ?4"),
                        WHERE
                    ))
                    .map_err(&fail)?;
                let rows = st.query_map(params![service, env, exclude, limit], instance_row).map_err(&fail)?;
                Ok((rows.collect::<Result<Vec<_>, _>>().map_err(&fail)?, total))
            })
            .await?)
    }

    async fn errors(&self, service: &str, env: &str, since: Timestamp, samples: u32) -> Result<ErrorStats, FleetError> {
        let (service, env, since) = (service.to_owned(), env.to_owned(), ts(&since));
        Ok(self
            .0
            .read_with(move |c| {
                let fail = sql("read the error log");
                const WHERE: &str = "FROM opspilot_error_logs WHERE service = ?1 AND env = ?2 AND at >= ?3";
                let by_status: Vec<(i64, i64)> = {
                    let mut st = c
                        .prepare_cached(&format!("SELECT status_code, COUNT(*) {WHERE} GROUP BY status_code ORDER BY status_code"))
                        .map_err(&fail)?;
                    let rows = st.query_map(params![service, env, since], |r| Ok((r.get(0)?, r.get(1)?))).map_err(&fail)?;
                    rows.collect::<Result<_, _>>().map_err(&fail)?
                };
                let top_instance = c
                    .prepare_cached(&format!(
                        "SELECT instance_id, COUNT(*) AS n {WHERE} GROUP BY instance_id ORDER BY n DESC, instance_id LIMIT 1"
                    ))
                    .and_then(|mut st| st.query_row(params![service, env, since], |r| Ok((r.get(0)?, r.get(1)?))).optional())
                    .map_err(&fail)?;
                let mut st =
                    c.prepare_cached(&format!("SELECT * {WHERE} ORDER BY at DESC, id DESC LIMIT ?4")).map_err(&fail)?;
                let rows = st
                    .query_map(params![service, env, since, samples], |r| {
                        let at: String = r.get("at")?;
                        Ok(ErrorLogEntry {
                            service: r.get("service")?,
                            env: r.get("env")?,
                            instance_id: r.get("instance_id")?,
                            status_code: r.get("status_code")?,
                            message: r.get("message")?,
                            at: chrono::DateTime::parse_from_rfc3339(&at)
                                .map(|t| t.with_timezone(&chrono::Utc))
                                .unwrap_or_default(),
                        })
                    })
                    .map_err(&fail)?;
                let samples = rows.collect::<Result<Vec<_>, _>>().map_err(&fail)?;
                Ok(ErrorStats { count: by_status.iter().map(|(_, n)| n).sum(), by_status, top_instance, samples })
            })
            .await?)
    }

    async fn releases(&self, service: &str, env: &str) -> Result<Vec<(String, Option<String>)>, FleetError> {
        let (service, env) = (service.to_owned(), env.to_owned());
        Ok(self
            .0
            .read_with(move |c| {
                let mut st = c
                    .prepare_cached(
                        "SELECT DISTINCT release, previous_release FROM opspilot_instances WHERE service = ? AND env = ? \
                         ORDER BY release",
                    )
                    .map_err(sql("read releases"))?;
                let rows = st.query_map(params![service, env], |r| Ok((r.get(0)?, r.get(1)?))).map_err(sql("read releases"))?;
                rows.collect::<Result<Vec<_>, _>>().map_err(sql("read releases"))
            })
            .await?)
    }

    async fn restart(&self, instance_id: &str, key: &str) -> Result<Restarted, FleetError> {
        let (instance_id, key) = (instance_id.to_owned(), key.to_owned());
        let answer = self
            .0
            .write_with(move |c| {
                let fail = sql("restart an instance");
                if let Some(answer) = recorded(c, &key)? {
                    return Ok(Ok(answer));
                }
                let count: Option<i64> = c
                    .prepare_cached(
                        "UPDATE opspilot_instances SET status = 'healthy', restart_count = restart_count + 1 \
                         WHERE id = ? AND status = 'abnormal' RETURNING restart_count",
                    )
                    .and_then(|mut st| st.query_row([&instance_id], |r| r.get(0)).optional())
                    .map_err(&fail)?;
                let Some(restart_count) = count else {
                    return Ok(Err(instance_id.clone()));
                };
                let answer = serde_json::to_string(&Restarted { instance_id: instance_id.clone(), restart_count })
                    .unwrap_or_default();
                c.prepare_cached("INSERT INTO opspilot_effects (key, answer) VALUES (?, ?)")
                    .and_then(|mut st| st.execute([&key, &answer]))
                    .map_err(&fail)?;
                Ok(Ok(answer))
            })
            .await?;
        match answer {
            Ok(answer) => serde_json::from_str(&answer).map_err(|e| FleetError::Backend(e.to_string())),
            Err(id) => Err(self.not_restartable(&id).await),
        }
    }

    async fn rollback(
        &self,
        service: &str,
        env: &str,
        from_release: &str,
        key: &str,
    ) -> Result<RolledBack, FleetError> {
        let (service, env, from, key) = (service.to_owned(), env.to_owned(), from_release.to_owned(), key.to_owned());
        let answer = self
            .0
            .write_with(move |c| {
                let fail = sql("roll back a release");
                if let Some(answer) = recorded(c, &key)? {
                    return Ok(Ok(answer));
                }
                let (total, ready): (i64, i64) = c
                    .prepare_cached(
                        "SELECT COUNT(*), COALESCE(SUM(release = ?1 AND previous_release IS NOT NULL), 0) \
                         FROM opspilot_instances WHERE service = ?2 AND env = ?3",
                    )
                    .and_then(|mut st| st.query_row(params![from, service, env], |r| Ok((r.get(0)?, r.get(1)?))))
                    .map_err(&fail)?;
                if total == 0 || ready != total {
                    return Ok(Err(format!(
                        "not every instance of {service} in {env} is on {from} with a release to go back to; nothing was rolled back"
                    )));
                }
                let to: String = c
                    .prepare_cached("SELECT previous_release FROM opspilot_instances WHERE service = ? AND env = ? LIMIT 1")
                    .and_then(|mut st| st.query_row(params![service, env], |r| r.get(0)))
                    .map_err(&fail)?;
                c.prepare_cached(
                    "UPDATE opspilot_instances SET release = previous_release, previous_release = ?, status = 'healthy' \
                     WHERE service = ? AND env = ?",
                )
                .and_then(|mut st| st.execute(params![from, service, env]))
                .map_err(&fail)?;
                let answer = serde_json::to_string(&RolledBack {
                    service: service.clone(),
                    env: env.clone(),
                    from: from.clone(),
                    to,
                    instances: total,
                })
                .unwrap_or_default();
                c.prepare_cached("INSERT INTO opspilot_effects (key, answer) VALUES (?, ?)")
                    .and_then(|mut st| st.execute([&key, &answer]))
                    .map_err(&fail)?;
                Ok(Ok(answer))
            })
            .await?;
        match answer {
            Ok(answer) => serde_json::from_str(&answer).map_err(|e| FleetError::Backend(e.to_string())),
            Err(why) => Err(FleetError::Precondition(why)),
        }
    }
}

impl SqliteFleet {
    async fn not_restartable(&self, id: &str) -> FleetError {
        match self.instance(id).await {
            Ok(Some(i)) => FleetError::Precondition(format!("{} is already {}; it was not restarted", i.id, i.status)),
            Ok(None) => FleetError::NotFound(format!("no instance {id}")),
            Err(e) => e,
        }
    }
}

/// The answer recorded for `key`, if an effect was applied under it.
fn recorded(c: &rusqlite::Connection, key: &str) -> Result<Option<String>, StoreError> {
    c.prepare_cached("SELECT answer FROM opspilot_effects WHERE key = ?")
        .and_then(|mut st| st.query_row([key], |r| r.get(0)).optional())
        .map_err(sql("read an applied effect"))
}

// ------------------------------------------------------------------ Postgres

const POSTGRES_SCHEMA: &[&str] = &[
    "CREATE TABLE IF NOT EXISTS opspilot_instances (
        id                text COLLATE \"C\" PRIMARY KEY,
        service           text NOT NULL,
        env               text NOT NULL,
        status            text NOT NULL,
        restart_count     bigint NOT NULL DEFAULT 0,
        release           text NOT NULL,
        previous_release  text
    )",
    "CREATE INDEX IF NOT EXISTS opspilot_instances_by_status ON opspilot_instances (service, env, status, id)",
    "CREATE TABLE IF NOT EXISTS opspilot_error_logs (
        id           bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
        service      text NOT NULL,
        env          text NOT NULL,
        instance_id  text NOT NULL,
        status_code  bigint NOT NULL,
        message      text NOT NULL,
        at           timestamptz NOT NULL
    )",
    "CREATE INDEX IF NOT EXISTS opspilot_error_logs_by_service ON opspilot_error_logs (service, env, at)",
    "CREATE TABLE IF NOT EXISTS opspilot_effects (key text COLLATE \"C\" PRIMARY KEY, answer jsonb NOT NULL)",
];

fn pg(what: &'static str) -> impl Fn(sqlx::Error) -> FleetError {
    move |e| FleetError::Backend(format!("{what}: {e}"))
}

fn pg_instance(r: &sqlx::postgres::PgRow) -> Result<Instance, sqlx::Error> {
    Ok(Instance {
        id: r.try_get("id")?,
        service: r.try_get("service")?,
        env: r.try_get("env")?,
        status: r.try_get("status")?,
        restart_count: r.try_get("restart_count")?,
        release: r.try_get("release")?,
        previous_release: r.try_get("previous_release")?,
    })
}

/// The fleet in Keel's Postgres database (in the store's schema), shared by every instance.
#[derive(Debug, Clone)]
pub struct PostgresFleet(PostgresStore);

impl PostgresFleet {
    /// The answer recorded under `key`, if an effect was applied under it.
    async fn recorded(&self, key: &str) -> Result<Option<serde_json::Value>, FleetError> {
        sqlx::query_scalar("SELECT answer FROM opspilot_effects WHERE key = $1")
            .bind(key)
            .fetch_optional(self.0.pool())
            .await
            .map_err(pg("read an applied effect"))
    }

    /// Creates the fleet's tables if they are missing (serialised with other instances doing the
    /// same by an advisory lock: concurrent `CREATE … IF NOT EXISTS` can collide).
    pub async fn open(store: &PostgresStore) -> Result<Self, FleetError> {
        let mut tx = store.pool().begin().await.map_err(pg("create the fleet's tables"))?;
        sqlx::query("SELECT pg_advisory_xact_lock(7316023)").execute(&mut *tx).await.map_err(pg("lock"))?;
        for statement in POSTGRES_SCHEMA {
            sqlx::query(statement).execute(&mut *tx).await.map_err(pg("create the fleet's tables"))?;
        }
        tx.commit().await.map_err(pg("create the fleet's tables"))?;
        Ok(Self(store.clone()))
    }
}

#[async_trait]
impl Fleet for PostgresFleet {
    async fn seed(&self, seed: FleetSeed, now: Timestamp) -> Result<(), FleetError> {
        let fail = pg("seed the fleet");
        let mut tx = self.0.pool().begin().await.map_err(&fail)?;
        // Seeds are serialised with each other: a second seed replaces the first instead of
        // colliding with it. Plain reads go on.
        sqlx::query("LOCK TABLE opspilot_instances, opspilot_error_logs, opspilot_effects IN EXCLUSIVE MODE")
            .execute(&mut *tx)
            .await
            .map_err(&fail)?;
        for table in
            ["DELETE FROM opspilot_error_logs", "DELETE FROM opspilot_instances", "DELETE FROM opspilot_effects"]
        {
            sqlx::query(table).execute(&mut *tx).await.map_err(&fail)?;
        }
        for i in seeded_instances(seed) {
            sqlx::query(
                "INSERT INTO opspilot_instances (id, service, env, status, restart_count, release, previous_release) \
                 VALUES ($1, $2, $3, $4, $5, $6, $7)",
            )
            .bind(&i.id)
            .bind(&i.service)
            .bind(&i.env)
            .bind(&i.status)
            .bind(i.restart_count)
            .bind(&i.release)
            .bind(&i.previous_release)
            .execute(&mut *tx)
            .await
            .map_err(&fail)?;
        }
        for e in seeded_error_logs(now) {
            sqlx::query(
                "INSERT INTO opspilot_error_logs (service, env, instance_id, status_code, message, at) \
                 VALUES ($1, $2, $3, $4, $5, $6)",
            )
            .bind(&e.service)
            .bind(&e.env)
            .bind(&e.instance_id)
            .bind(e.status_code)
            .bind(&e.message)
            .bind(e.at)
            .execute(&mut *tx)
            .await
            .map_err(&fail)?;
        }
        tx.commit().await.map_err(&fail)
    }

    async fn instances(&self, limit: u32) -> Result<Vec<Instance>, FleetError> {
        let rows = sqlx::query("SELECT * FROM opspilot_instances ORDER BY id LIMIT $1")
            .bind(i64::from(limit))
            .fetch_all(self.0.pool())
            .await
            .map_err(pg("list instances"))?;
        rows.iter().map(pg_instance).collect::<Result<_, _>>().map_err(pg("list instances"))
    }

    async fn instance(&self, id: &str) -> Result<Option<Instance>, FleetError> {
        let row = self
            .0
            .run_kept(async |conn| {
                sqlx::query("SELECT * FROM opspilot_instances WHERE id = $1").bind(id).fetch_optional(conn).await
            })
            .await
            .map_err(pg("read an instance"))?;
        row.as_ref().map(pg_instance).transpose().map_err(pg("read an instance"))
    }

    async fn services(&self) -> Result<Vec<ServiceSummary>, FleetError> {
        let rows = sqlx::query(
            "SELECT service, env, COUNT(*) AS n, COUNT(*) FILTER (WHERE status = 'abnormal') AS abnormal \
             FROM opspilot_instances GROUP BY service, env ORDER BY service, env",
        )
        .fetch_all(self.0.pool())
        .await
        .map_err(pg("list services"))?;
        rows.iter()
            .map(|r| {
                Ok(ServiceSummary {
                    service: r.try_get("service")?,
                    env: r.try_get("env")?,
                    instances: r.try_get("n")?,
                    abnormal: r.try_get("abnormal")?,
                })
            })
            .collect::<Result<_, sqlx::Error>>()
            .map_err(pg("list services"))
    }

    async fn abnormal(
        &self,
        service: &str,
        env: &str,
        exclude: &[String],
        limit: u32,
        count_up_to: u32,
    ) -> Result<(Vec<Instance>, i64), FleetError> {
        let fail = pg("find abnormal instances");
        const WHERE: &str =
            "FROM opspilot_instances WHERE service = $1 AND env = $2 AND status = 'abnormal' AND NOT (id = ANY($3))";
        let total: i64 = sqlx::query_scalar(&format!("SELECT COUNT(*) FROM (SELECT 1 {WHERE} LIMIT $4) counted"))
            .bind(service)
            .bind(env)
            .bind(exclude)
            .bind(i64::from(count_up_to))
            .fetch_one(self.0.pool())
            .await
            .map_err(&fail)?;
        let rows = sqlx::query(&format!("SELECT * {WHERE} ORDER BY id LIMIT $4"))
            .bind(service)
            .bind(env)
            .bind(exclude)
            .bind(i64::from(limit))
            .fetch_all(self.0.pool())
            .await
            .map_err(&fail)?;
        Ok((rows.iter().map(pg_instance).collect::<Result<_, _>>().map_err(&fail)?, total))
    }

    async fn errors(&self, service: &str, env: &str, since: Timestamp, samples: u32) -> Result<ErrorStats, FleetError> {
        let fail = pg("read the error log");
        const WHERE: &str = "FROM opspilot_error_logs WHERE service = $1 AND env = $2 AND at >= $3";
        let by_status: Vec<(i64, i64)> =
            sqlx::query_as(&format!("SELECT status_code, COUNT(*) {WHERE} GROUP BY status_code ORDER BY status_code"))
                .bind(service)
                .bind(env)
                .bind(since)
                .fetch_all(self.0.pool())
                .await
                .map_err(&fail)?;
        let top_instance: Option<(String, i64)> = sqlx::query_as(&format!(
            "SELECT instance_id, COUNT(*) AS n {WHERE} GROUP BY instance_id ORDER BY n DESC, instance_id LIMIT 1"
        ))
        .bind(service)
        .bind(env)
        .bind(since)
        .fetch_optional(self.0.pool())
        .await
        .map_err(&fail)?;
        let rows = sqlx::query(&format!("SELECT * {WHERE} ORDER BY at DESC, id DESC LIMIT $4"))
            .bind(service)
            .bind(env)
            .bind(since)
            .bind(i64::from(samples))
            .fetch_all(self.0.pool())
            .await
            .map_err(&fail)?;
        let samples = rows
            .iter()
            .map(|r| {
                Ok(ErrorLogEntry {
                    service: r.try_get("service")?,
                    env: r.try_get("env")?,
                    instance_id: r.try_get("instance_id")?,
                    status_code: r.try_get("status_code")?,
                    message: r.try_get("message")?,
                    at: r.try_get("at")?,
                })
            })
            .collect::<Result<Vec<_>, sqlx::Error>>()
            .map_err(&fail)?;
        Ok(ErrorStats { count: by_status.iter().map(|(_, n)| n).sum(), by_status, top_instance, samples })
    }

    async fn releases(&self, service: &str, env: &str) -> Result<Vec<(String, Option<String>)>, FleetError> {
        sqlx::query_as(
            "SELECT DISTINCT release, previous_release FROM opspilot_instances WHERE service = $1 AND env = $2 \
             ORDER BY release",
        )
        .bind(service)
        .bind(env)
        .fetch_all(self.0.pool())
        .await
        .map_err(pg("read releases"))
    }

    async fn restart(&self, instance_id: &str, key: &str) -> Result<Restarted, FleetError> {
        let fail = pg("restart an instance");
        // One statement: the restart and its record under the key, unless the key has one. Of two
        // executions of one key at once, the second waits for the instance's row, finds it restarted
        // (no longer abnormal), writes nothing, and reads the first's record below: one effect per
        // key, even between instances, in one round trip.
        let (prior, recorded): (Option<serde_json::Value>, Option<serde_json::Value>) = self
            .0
            .run_kept(async |conn| {
                sqlx::query_as(
                    "WITH prior AS (SELECT answer FROM opspilot_effects WHERE key = $2), \
                     done AS (UPDATE opspilot_instances SET status = 'healthy', restart_count = restart_count + 1 \
                              WHERE id = $1 AND status = 'abnormal' AND NOT EXISTS (SELECT 1 FROM prior) \
                              RETURNING id, restart_count), \
                     recorded AS (INSERT INTO opspilot_effects (key, answer) \
                                  SELECT $2, jsonb_build_object('instanceId', id, 'restartCount', restart_count) FROM done \
                                  RETURNING answer) \
                     SELECT (SELECT answer FROM prior), (SELECT answer FROM recorded)",
                )
                .bind(instance_id)
                .bind(key)
                .fetch_one(conn)
                .await
            })
            .await
            .map_err(&fail)?;
        let answer = match prior.or(recorded) {
            Some(answer) => answer,
            // Not restarted here: another execution of the key may have just recorded it.
            None => match self.recorded(key).await? {
                Some(answer) => answer,
                None => {
                    return Err(match self.instance(instance_id).await? {
                        Some(i) => {
                            FleetError::Precondition(format!("{} is already {}; it was not restarted", i.id, i.status))
                        }
                        None => FleetError::NotFound(format!("no instance {instance_id}")),
                    })
                }
            },
        };
        serde_json::from_value(answer).map_err(|e| FleetError::Backend(e.to_string()))
    }

    async fn rollback(
        &self,
        service: &str,
        env: &str,
        from_release: &str,
        key: &str,
    ) -> Result<RolledBack, FleetError> {
        let fail = pg("roll back a release");
        let mut tx = self.0.pool().begin().await.map_err(&fail)?;
        sqlx::query("SELECT pg_advisory_xact_lock(hashtext($1))").bind(key).execute(&mut *tx).await.map_err(&fail)?;
        if let Some(answer) = pg_recorded(&mut tx, key).await? {
            return serde_json::from_value(answer).map_err(|e| FleetError::Backend(e.to_string()));
        }
        // Lock the service's instances, in id order, so that the check holds until the update.
        let rows = sqlx::query(
            "SELECT release, previous_release FROM opspilot_instances WHERE service = $1 AND env = $2 \
             ORDER BY id FOR UPDATE",
        )
        .bind(service)
        .bind(env)
        .fetch_all(&mut *tx)
        .await
        .map_err(&fail)?;
        let ready = rows.iter().all(|r| {
            r.try_get::<String, _>("release").is_ok_and(|v| v == from_release)
                && r.try_get::<Option<String>, _>("previous_release").is_ok_and(|p| p.is_some())
        });
        if rows.is_empty() || !ready {
            return Err(FleetError::Precondition(format!(
                "not every instance of {service} in {env} is on {from_release} with a release to go back to; nothing was rolled back"
            )));
        }
        let to: String = rows[0].try_get("previous_release").map_err(&fail)?;
        sqlx::query(
            "UPDATE opspilot_instances SET release = previous_release, previous_release = $1, status = 'healthy' \
             WHERE service = $2 AND env = $3",
        )
        .bind(from_release)
        .bind(service)
        .bind(env)
        .execute(&mut *tx)
        .await
        .map_err(&fail)?;
        let answer = RolledBack {
            service: service.to_owned(),
            env: env.to_owned(),
            from: from_release.to_owned(),
            to,
            instances: rows.len() as i64,
        };
        sqlx::query("INSERT INTO opspilot_effects (key, answer) VALUES ($1, $2)")
            .bind(key)
            .bind(serde_json::to_value(&answer).unwrap_or_default())
            .execute(&mut *tx)
            .await
            .map_err(&fail)?;
        tx.commit().await.map_err(&fail)?;
        Ok(answer)
    }
}

async fn pg_recorded(
    tx: &mut sqlx::Transaction<'_, sqlx::Postgres>,
    key: &str,
) -> Result<Option<serde_json::Value>, FleetError> {
    sqlx::query_scalar("SELECT answer FROM opspilot_effects WHERE key = $1")
        .bind(key)
        .fetch_optional(&mut **tx)
        .await
        .map_err(pg("read an applied effect"))
}
