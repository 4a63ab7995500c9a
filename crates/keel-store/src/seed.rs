//! The demo fleet every backend seeds: the same instances and error log, so the OpsPilot story and
//! the conformance suite see one fleet whatever the store.

use chrono::Duration;
use keel_core::domain::Timestamp;
use keel_core::fleet::{ErrorLogEntry, FleetSeed, Instance};

/// Services with the prefix of their instance ids.
pub const SERVICES: &[(&str, &str)] = &[("payment-api", "pay"), ("order-api", "order"), ("inventory-api", "inv")];
/// Environments with their number of regular instances.
pub const ENVS: &[(&str, u32)] = &[("prod", 3), ("staging", 2)];
pub const RELEASE: &str = "v2.4.1";
pub const PREVIOUS_RELEASE: &str = "v2.4.0";
/// The instance the demo story is about: abnormal, the source of payment-api's recent errors.
pub const ABNORMAL_INSTANCE: &str = "pay-prod-2";
/// The user seeded as an operator (when absent).
pub const DEMO_USER: &str = "demo";

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
/// `seed.extra_abnormal` abnormal prod instances per service, `{prefix}-prod-a1`, `-a2`, ….
pub fn instances(seed: FleetSeed) -> Vec<Instance> {
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
    }
    out
}

/// Twelve 5xx errors of payment-api prod from `pay-prod-2` over the 14 minutes before `now`, five
/// older ones (two to three hours ago, outside a 15 minute window), and two recent order-api ones.
pub fn error_logs(now: Timestamp) -> Vec<ErrorLogEntry> {
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

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::Utc;

    #[test]
    fn the_seeded_fleet_has_one_abnormal_instance_plus_the_extra_ones() {
        let plain = instances(FleetSeed { extra_abnormal: 0 });
        assert_eq!(plain.len(), 15);
        let abnormal: Vec<_> = plain.iter().filter(|i| i.status == "abnormal").map(|i| i.id.as_str()).collect();
        assert_eq!(abnormal, vec!["pay-prod-2"]);
        let extra = instances(FleetSeed { extra_abnormal: 2 });
        assert_eq!(extra.len(), 21);
        assert!(extra.iter().any(|i| i.id == "inv-prod-a2" && i.status == "abnormal" && i.env == "prod"));
    }

    #[test]
    fn recent_errors_fit_in_fifteen_minutes_and_older_ones_do_not() {
        let now = Utc::now();
        let logs = error_logs(now);
        let window = now - Duration::minutes(15);
        let recent: Vec<_> = logs.iter().filter(|e| e.service == "payment-api" && e.at >= window).collect();
        assert_eq!(recent.len(), 12);
        assert!(recent.iter().all(|e| (500..600).contains(&e.status_code) && e.instance_id == "pay-prod-2"));
        assert!(recent.iter().all(|e| e.at >= now - Duration::minutes(14) && e.at < now));
        let older = logs.iter().filter(|e| e.service == "payment-api" && e.at < window).count();
        assert_eq!(older, 5);
    }
}
