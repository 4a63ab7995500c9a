//! Limits that keep one caller from taking the server: a request rate per client address, checked
//! before authentication; a request rate per user (token bucket) and a cap on open streams per user.
//! All are per instance: behind a load balancer each instance allows this much, so the
//! cluster-wide figure is this times the instances.

use std::collections::hash_map::RandomState;
use std::collections::HashMap;
use std::hash::BuildHasher;
use std::net::{IpAddr, Ipv6Addr, SocketAddr};
use std::num::NonZeroU32;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::extract::{ConnectInfo, Request, State};
use axum::http::{HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use governor::clock::{Clock, DefaultClock};
use governor::{DefaultKeyedRateLimiter, Quota};

use crate::error::ApiError;
use crate::state::AppState;

/// Requests per client address, before anything else about the request is looked at: a flood of
/// made-up keys from one address is answered 429 without a key lookup in the store. A GCRA
/// limiter (governor) keyed by the address — an IPv6 address by its /64, the block a single host
/// is usually given.
///
/// The key set is bounded. Every [`AddressLimiter::MAINTAIN_EVERY`] checks, the addresses whose
/// state is that of a new one (no request within the last burst's worth of time) are forgotten.
/// While `max_keys` addresses are remembered anyway — requests from that many addresses within
/// seconds — requests are counted in one of [`AddressLimiter::FOLDS`] shared buckets chosen by a
/// keyed hash of the address instead, until the set shrinks again: the set never holds more than
/// `max_keys + FOLDS` keys, whatever addresses arrive.
pub struct AddressLimiter {
    limiter: Option<DefaultKeyedRateLimiter<ClientKey>>,
    max_keys: usize,
    checks: AtomicU64,
    clock: DefaultClock,
    fold: RandomState,
}

/// What the per-address limiter counts a request under.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum ClientKey {
    Address(IpAddr),
    /// A shared bucket, while the set is full.
    Folded(u16),
}

impl std::fmt::Debug for AddressLimiter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AddressLimiter").field("keys", &self.keys()).field("max_keys", &self.max_keys).finish()
    }
}

impl AddressLimiter {
    /// Checks between two clean-ups of the key set.
    pub const MAINTAIN_EVERY: u64 = 4096;
    /// The shared buckets of a full set.
    pub const FOLDS: u16 = 1024;
    /// The addresses remembered at most (~5 MiB), besides the shared buckets.
    pub const MAX_KEYS: usize = 65_536;

    /// `per_second == 0` turns the limit off.
    pub fn new(per_second: f64, burst: u32, max_keys: usize) -> Self {
        let limiter = (per_second > 0.0).then(|| {
            let burst = NonZeroU32::new(burst.max(1)).unwrap_or(NonZeroU32::MIN);
            // One request every 1/rate seconds.
            let period = Duration::from_secs_f64(1.0 / per_second).max(Duration::from_nanos(1));
            let quota = Quota::with_period(period).unwrap_or_else(|| Quota::per_second(NonZeroU32::MAX));
            DefaultKeyedRateLimiter::dashmap(quota.allow_burst(burst))
        });
        Self {
            limiter,
            max_keys: max_keys.max(1),
            checks: AtomicU64::new(0),
            clock: DefaultClock::default(),
            fold: RandomState::new(),
        }
    }

    /// Takes one request for `address`, or says how long until one is allowed.
    pub fn check(&self, address: IpAddr) -> Result<(), Duration> {
        let Some(limiter) = &self.limiter else { return Ok(()) };
        if (self.checks.fetch_add(1, Ordering::Relaxed) + 1).is_multiple_of(Self::MAINTAIN_EVERY) {
            limiter.retain_recent();
            limiter.shrink_to_fit();
        }
        let address = bucket_of(address);
        let key = if limiter.len() < self.max_keys {
            ClientKey::Address(address)
        } else {
            ClientKey::Folded((self.fold.hash_one(address) % u64::from(Self::FOLDS)) as u16)
        };
        limiter.check_key(&key).map_err(|not_until| not_until.wait_time_from(self.clock.now()))
    }

    /// Keys remembered now.
    pub fn keys(&self) -> usize {
        self.limiter.as_ref().map_or(0, |l| l.len())
    }
}

/// The address a limit applies to: an IPv4 address itself, an IPv6 address by its /64 (an IPv4
/// address mapped into IPv6 by the IPv4 address).
fn bucket_of(address: IpAddr) -> IpAddr {
    match address {
        IpAddr::V4(_) => address,
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => {
                let s = v6.segments();
                IpAddr::V6(Ipv6Addr::new(s[0], s[1], s[2], s[3], 0, 0, 0, 0))
            }
        },
    }
}

/// Addresses, or blocks of them (`10.0.0.0/8`, `fd00::/8`), of the reverse proxies in front of the
/// server: a request from one of them is counted under the client address its `X-Forwarded-For`
/// names (see [`client_address`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TrustedProxies(Vec<(IpAddr, u8)>);

impl TrustedProxies {
    /// Parses `203.0.113.7`, `10.0.0.0/8`, `::1`, `fd00::/8`; an error says what is wrong.
    pub fn parse(list: &[String]) -> Result<Self, String> {
        let mut blocks = Vec::with_capacity(list.len());
        for text in list {
            let (address, prefix) = match text.split_once('/') {
                Some((address, prefix)) => (address, Some(prefix)),
                None => (text.as_str(), None),
            };
            let address: IpAddr = address
                .trim()
                .parse()
                .map_err(|_| format!("{text:?} is not an IP address or a block such as 10.0.0.0/8"))?;
            let max = if address.is_ipv4() { 32 } else { 128 };
            let prefix = match prefix {
                None => max,
                Some(p) => match p.trim().parse::<u8>() {
                    Ok(p) if p <= max => p,
                    _ => return Err(format!("{text:?}: the prefix length must be 0 to {max}")),
                },
            };
            blocks.push((address, prefix));
        }
        Ok(Self(blocks))
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    fn contains(&self, address: IpAddr) -> bool {
        let address = canonical(address);
        self.0.iter().any(|&(block, prefix)| match (canonical(block), address) {
            (IpAddr::V4(b), IpAddr::V4(a)) => prefix_eq(&b.octets(), &a.octets(), prefix),
            (IpAddr::V6(b), IpAddr::V6(a)) => prefix_eq(&b.octets(), &a.octets(), prefix),
            _ => false,
        })
    }
}

/// An IPv4 address mapped into IPv6 as the IPv4 address.
fn canonical(address: IpAddr) -> IpAddr {
    match address {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(address, IpAddr::V4),
        v4 => v4,
    }
}

fn prefix_eq(a: &[u8], b: &[u8], prefix: u8) -> bool {
    let (bytes, bits) = (usize::from(prefix / 8), prefix % 8);
    a[..bytes] == b[..bytes] && (bits == 0 || (a[bytes] ^ b[bytes]) >> (8 - bits) == 0)
}

/// The address a request is counted under: its peer's, unless the peer is a trusted proxy — then
/// the right-most address of `X-Forwarded-For` that is not itself a trusted proxy (each proxy
/// appends the address it got the request from, so the ones left of it are the client's to make
/// up). A missing or unreadable header, or one of trusted proxies only, leaves the peer's.
pub fn client_address(peer: IpAddr, forwarded_for: Option<&HeaderValue>, trusted: &TrustedProxies) -> IpAddr {
    if trusted.is_empty() || !trusted.contains(peer) {
        return peer;
    }
    let Some(list) = forwarded_for.and_then(|v| v.to_str().ok()) else { return peer };
    for hop in list.rsplit(',') {
        match hop.trim().parse::<IpAddr>() {
            Ok(address) if trusted.contains(address) => continue,
            Ok(address) => return address,
            // not an address: whatever is left of it can't be told from what a client wrote
            Err(_) => return peer,
        }
    }
    peer
}

/// The middleware of the per-address limit, outside routing and authentication. A request that
/// came in without a peer address (built in-process, as tests do) is not limited.
pub async fn limit_address(State(state): State<AppState>, request: Request, next: Next) -> Response {
    if let Some(ConnectInfo(peer)) = request.extensions().get::<ConnectInfo<SocketAddr>>() {
        let forwarded = request.headers().get("x-forwarded-for");
        let client = client_address(peer.ip(), forwarded, &state.config.trusted_proxies);
        if let Err(wait) = state.limits.address.check(client) {
            state.metrics.rate_limited("address");
            let seconds = wait.as_secs_f64().ceil().max(1.0) as u64;
            return ApiError::new(
                StatusCode::TOO_MANY_REQUESTS,
                "RATE_LIMITED",
                format!("too many requests from this address; retry in {seconds} s"),
            )
            .retry_after(seconds)
            .into_response();
        }
    }
    next.run(request).await
}

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

    fn proxies(list: &[&str]) -> TrustedProxies {
        TrustedProxies::parse(&list.iter().map(|s| s.to_string()).collect::<Vec<_>>()).unwrap()
    }

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn trusted_proxies_parse_addresses_and_blocks_and_refuse_the_rest() {
        let p = proxies(&["10.0.0.0/8", "192.168.1.7", "fd00::/8", "::1"]);
        for inside in ["10.1.2.3", "192.168.1.7", "fd12::1", "::1", "::ffff:10.9.9.9"] {
            assert!(p.contains(ip(inside)), "{inside}");
        }
        for outside in ["11.0.0.1", "192.168.1.8", "fe80::1", "127.0.0.1"] {
            assert!(!p.contains(ip(outside)), "{outside}");
        }
        assert!(proxies(&["172.16.0.0/12"]).contains(ip("172.31.255.255")));
        assert!(!proxies(&["172.16.0.0/12"]).contains(ip("172.32.0.0")));
        assert!(proxies(&["0.0.0.0/0"]).contains(ip("8.8.8.8")));
        for bad in ["proxy.example", "10.0.0.0/33", "::/129", "10.0.0.0/x", ""] {
            let err = TrustedProxies::parse(&[bad.to_string()]).unwrap_err();
            assert!(err.contains(&format!("{bad:?}")), "{err}");
        }
    }

    #[test]
    fn the_client_address_comes_from_x_forwarded_for_only_through_a_trusted_proxy() {
        let trusted = proxies(&["10.0.0.0/8"]);
        let header = |v: &str| HeaderValue::from_str(v).unwrap();
        // a trusted proxy: the right-most hop that is not a proxy
        assert_eq!(client_address(ip("10.0.0.1"), Some(&header("203.0.113.9")), &trusted), ip("203.0.113.9"));
        assert_eq!(
            client_address(ip("10.0.0.1"), Some(&header("6.6.6.6, 203.0.113.9, 10.0.0.2")), &trusted),
            ip("203.0.113.9"),
            "what the client wrote left of the first proxy's entry is not believed"
        );
        // no header, garbage, only proxies: the peer
        assert_eq!(client_address(ip("10.0.0.1"), None, &trusted), ip("10.0.0.1"));
        assert_eq!(client_address(ip("10.0.0.1"), Some(&header("not-an-ip")), &trusted), ip("10.0.0.1"));
        assert_eq!(client_address(ip("10.0.0.1"), Some(&header("10.0.0.3, 10.0.0.2")), &trusted), ip("10.0.0.1"));
        // an untrusted peer's header is ignored (anyone can send one)
        assert_eq!(client_address(ip("198.51.100.4"), Some(&header("203.0.113.9")), &trusted), ip("198.51.100.4"));
        assert_eq!(
            client_address(ip("10.0.0.1"), Some(&header("203.0.113.9")), &TrustedProxies::default()),
            ip("10.0.0.1")
        );
    }

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
    fn an_address_has_its_burst_and_an_ipv6_host_is_its_64() {
        let limiter = AddressLimiter::new(1.0, 3, AddressLimiter::MAX_KEYS);
        let a: IpAddr = "192.0.2.1".parse().unwrap();
        for _ in 0..3 {
            limiter.check(a).expect("within the burst");
        }
        let wait = limiter.check(a).expect_err("burst spent");
        assert!(wait > Duration::ZERO && wait <= Duration::from_secs(1), "{wait:?}");
        limiter.check("192.0.2.2".parse().unwrap()).expect("another address");
        // One /64 is one client; the next /64 another.
        for _ in 0..3 {
            limiter.check("2001:db8:0:1::1".parse().unwrap()).expect("within the burst");
        }
        assert!(limiter.check("2001:db8:0:1:ffff::2".parse().unwrap()).is_err(), "the same /64");
        limiter.check("2001:db8:0:2::1".parse().unwrap()).expect("another /64");
        // An IPv4 address mapped into IPv6 is the IPv4 address.
        assert!(limiter.check("::ffff:192.0.2.1".parse().unwrap()).is_err());
        assert_eq!(limiter.keys(), 4);
        // Off: no state at all.
        let off = AddressLimiter::new(0.0, 1, 10);
        for _ in 0..100 {
            off.check(a).expect("no limit");
        }
        assert_eq!(off.keys(), 0);
    }

    #[test]
    fn the_key_set_is_bounded_whatever_addresses_arrive() {
        let max_keys = 100;
        let limiter = AddressLimiter::new(1.0, 1, max_keys);
        for i in 0..50_000u32 {
            let _ = limiter.check(IpAddr::V4(std::net::Ipv4Addr::from(0x0a00_0000 + i)));
            assert!(limiter.keys() <= max_keys + usize::from(AddressLimiter::FOLDS), "{} keys", limiter.keys());
        }
        // A flood of new addresses shares the folded buckets: most of it is refused.
        let refused = (0..10_000u32)
            .filter(|i| limiter.check(IpAddr::V4(std::net::Ipv4Addr::from(0x0b00_0000 + i))).is_err())
            .count();
        assert!(refused > 8_000, "{refused}");
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
