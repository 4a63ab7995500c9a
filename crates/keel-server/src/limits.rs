//! Per-user limits that keep one caller from taking the server: a request rate (token bucket) and a
//! cap on open streams. Both are per instance: behind a load balancer each instance allows this
//! much, so the cluster-wide figure is this times the instances.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::http::StatusCode;

use crate::error::ApiError;

/// A token bucket per user: `burst` requests at once, refilled at `per_second`.
#[derive(Debug)]
pub struct RateLimiter {
    per_second: f64,
    burst: f64,
    buckets: Mutex<HashMap<String, Bucket>>,
}

#[derive(Debug, Clone, Copy)]
struct Bucket {
    tokens: f64,
    at: Instant,
}

impl RateLimiter {
    /// `per_second == 0` turns the limit off.
    pub fn new(per_second: f64, burst: u32) -> Self {
        Self { per_second, burst: f64::from(burst.max(1)), buckets: Mutex::new(HashMap::new()) }
    }

    /// Takes one token for `user`, or says how long until one is there.
    pub fn check(&self, user: &str) -> Result<(), Duration> {
        self.check_at(user, Instant::now())
    }

    fn check_at(&self, user: &str, now: Instant) -> Result<(), Duration> {
        if self.per_second <= 0.0 {
            return Ok(());
        }
        let mut buckets = self.buckets.lock().unwrap_or_else(|p| p.into_inner());
        let bucket = buckets.entry(user.to_owned()).or_insert(Bucket { tokens: self.burst, at: now });
        let elapsed = now.saturating_duration_since(bucket.at).as_secs_f64();
        bucket.tokens = (bucket.tokens + elapsed * self.per_second).min(self.burst);
        bucket.at = now;
        if bucket.tokens >= 1.0 {
            bucket.tokens -= 1.0;
            Ok(())
        } else {
            Err(Duration::from_secs_f64((1.0 - bucket.tokens) / self.per_second))
        }
    }
}

/// Open streams (SSE responses, WebSocket connections) per user.
#[derive(Debug, Clone)]
pub struct StreamLimiter {
    max_per_user: usize,
    open: Arc<Mutex<HashMap<String, usize>>>,
}

/// One open stream; dropping it frees the slot.
#[derive(Debug)]
pub struct StreamPermit {
    user: String,
    open: Arc<Mutex<HashMap<String, usize>>>,
}

impl StreamLimiter {
    /// `max_per_user == 0` turns the cap off (streams are still counted).
    pub fn new(max_per_user: usize) -> Self {
        Self { max_per_user, open: Arc::new(Mutex::new(HashMap::new())) }
    }

    pub fn acquire(&self, user: &str) -> Result<StreamPermit, ApiError> {
        let mut open = self.open.lock().unwrap_or_else(|p| p.into_inner());
        let count = open.entry(user.to_owned()).or_insert(0);
        if self.max_per_user > 0 && *count >= self.max_per_user {
            return Err(ApiError::new(
                StatusCode::TOO_MANY_REQUESTS,
                "TOO_MANY_STREAMS",
                format!("at most {} open streams per user; close one first", self.max_per_user),
            )
            .retry_after(1));
        }
        *count += 1;
        Ok(StreamPermit { user: user.to_owned(), open: self.open.clone() })
    }

    /// Streams `user` has open now.
    pub fn open(&self, user: &str) -> usize {
        self.open.lock().unwrap_or_else(|p| p.into_inner()).get(user).copied().unwrap_or(0)
    }
}

impl Drop for StreamPermit {
    fn drop(&mut self) {
        let mut open = self.open.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(count) = open.get_mut(&self.user) {
            *count = count.saturating_sub(1);
            if *count == 0 {
                open.remove(&self.user);
            }
        }
    }
}

/// The deepest nesting of arrays and objects in a JSON text, counted without parsing it (strings
/// and their escapes are skipped), so a hostile body is refused before serde recurses into it.
pub fn json_depth(body: &[u8]) -> usize {
    let (mut depth, mut deepest, mut in_string, mut escaped) = (0usize, 0usize, false, false);
    for &b in body {
        if in_string {
            match (escaped, b) {
                (true, _) => escaped = false,
                (false, b'\\') => escaped = true,
                (false, b'"') => in_string = false,
                _ => {}
            }
            continue;
        }
        match b {
            b'"' => in_string = true,
            b'[' | b'{' => {
                depth += 1;
                deepest = deepest.max(depth);
            }
            b']' | b'}' => depth = depth.saturating_sub(1),
            _ => {}
        }
    }
    deepest
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bucket_allows_its_burst_then_refills() {
        let limiter = RateLimiter::new(2.0, 3);
        let t0 = Instant::now();
        for _ in 0..3 {
            limiter.check_at("alice", t0).expect("within the burst");
        }
        let wait = limiter.check_at("alice", t0).expect_err("burst spent");
        assert!(wait > Duration::from_millis(400) && wait <= Duration::from_millis(500), "{wait:?}");
        // another user has a bucket of their own
        limiter.check_at("bob", t0).expect("bob's own bucket");
        // half a second later one token is back, not two
        limiter.check_at("alice", t0 + Duration::from_millis(500)).expect("refilled");
        assert!(limiter.check_at("alice", t0 + Duration::from_millis(500)).is_err());
        // the bucket never holds more than the burst
        let later = t0 + Duration::from_secs(3600);
        for _ in 0..3 {
            limiter.check_at("alice", later).expect("full again");
        }
        assert!(limiter.check_at("alice", later).is_err());
    }

    #[test]
    fn a_zero_rate_is_no_limit() {
        let limiter = RateLimiter::new(0.0, 1);
        let t0 = Instant::now();
        for _ in 0..1000 {
            limiter.check_at("alice", t0).expect("no limit");
        }
    }

    #[test]
    fn streams_are_capped_per_user_and_freed_on_drop() {
        let limiter = StreamLimiter::new(2);
        let a = limiter.acquire("alice").expect("1");
        let b = limiter.acquire("alice").expect("2");
        assert_eq!(limiter.acquire("alice").unwrap_err().code, "TOO_MANY_STREAMS");
        let _c = limiter.acquire("bob").expect("bob's own cap");
        drop(a);
        let _d = limiter.acquire("alice").expect("a slot was freed");
        drop(b);
        assert_eq!(limiter.open("alice"), 1);
    }

    #[test]
    fn depth_counts_nesting_outside_strings() {
        assert_eq!(json_depth(b"1"), 0);
        assert_eq!(json_depth(br#"{"a": [1, {"b": 2}]}"#), 3);
        assert_eq!(json_depth(br#"{"a": "[[[[{{{{"}"#), 1);
        assert_eq!(json_depth(br#"{"a": "\"[[[["}"#), 1);
        assert_eq!(json_depth(br#"["\\", [[]]]"#), 3);
        assert_eq!(json_depth("[".repeat(10_000).as_bytes()), 10_000);
    }
}
