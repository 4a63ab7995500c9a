//! Masking of secrets before anything is stored, streamed, logged or shown.
//!
//! Two kinds of input: JSON (tool results, arguments, decisions), where the values of secret-looking
//! keys are replaced whole and every string is masked as text; and free text (summaries, errors,
//! facts), where these are replaced by `***`:
//!
//! - the word after `Bearer` (and after `Authorization: Basic`);
//! - the value of a secret-looking key: `password=…`, `token: …`, `"api_key": "…"`, `Password=…;`
//!   in a connection string, `?token=…` in a URL;
//! - the credentials of a URL (`postgres://user:pw@host` → `postgres://***@host`);
//! - tokens recognisable by their shape: `sk-…`/`sk_…` keys, AWS access key ids (`AKIA…`, `ASIA…`),
//!   GitHub, GitLab and Slack tokens, JWTs;
//! - a whole text with a private key block in it.
//!
//! It is a safety net, not a guarantee: a secret in plain words ("the password is hunter2") passes.

use std::borrow::Cow;

use serde_json::Value;

const SECRET_KEYS: &[&str] = &[
    "password",
    "passwd",
    "passphrase",
    "secret",
    "apikey",
    "api_key",
    "authorization",
    "private_key",
    "credential",
    "access_key",
    "connection_string",
    "connectionstring",
];

/// Prefixes of tokens whose shape gives them away, and how many characters must follow.
const TOKEN_PREFIXES: &[(&str, usize)] = &[
    ("ghp_", 16),
    ("gho_", 16),
    ("ghu_", 16),
    ("ghs_", 16),
    ("ghr_", 16),
    ("github_pat_", 16),
    ("glpat-", 16),
    ("xoxb-", 10),
    ("xoxp-", 10),
    ("xoxa-", 10),
    ("xoxr-", 10),
    ("xoxs-", 10),
    ("rk_live_", 10),
    ("rk_test_", 10),
    ("whsec_", 16),
    // Keel's own API keys and stream tickets.
    ("keel_", 32),
    ("kst_", 32),
];

const MASK: &str = "***";

/// Whether a key (a JSON field, a `key=value` name) names a secret.
pub fn is_secret_key(key: &str) -> bool {
    contains_secret_word(key) || names_a_token(key)
}

/// The first letters of [`SECRET_KEYS`]: where one of them can start.
const SECRET_KEY_FIRSTS: [bool; 256] = {
    let mut firsts = [false; 256];
    let mut i = 0;
    while i < SECRET_KEYS.len() {
        firsts[SECRET_KEYS[i].as_bytes()[0] as usize] = true;
        i += 1;
    }
    firsts
};

/// One of [`SECRET_KEYS`] in `key`, ignoring ASCII case and reading `-` as `_`. Byte by byte, with
/// no copy of the key, and the words compared only where one can start: it runs for every word of
/// every masked text.
fn contains_secret_word(key: &str) -> bool {
    let fold = |b: u8| if b == b'-' { b'_' } else { b.to_ascii_lowercase() };
    let key = key.as_bytes();
    (0..key.len()).any(|at| {
        let first = fold(key[at]);
        SECRET_KEY_FIRSTS[first as usize]
            && SECRET_KEYS.iter().any(|word| {
                let word = word.as_bytes();
                word[0] == first
                    && key.len() - at >= word.len()
                    && key[at..at + word.len()].iter().zip(word).all(|(a, b)| fold(*a) == *b)
            })
    })
}

/// `token`, `access_token`, `refreshToken`, `csrftoken`: a word of the key ends in "token". Not
/// `max_tokens` or `tokenizer`, which count or name tokens of text. Words break at any character
/// that is not an ASCII letter or digit, and before the upper case letter of `camelCase`. Byte by
/// byte: a byte of a multi-byte character is not an ASCII letter or digit, as the character is not.
fn names_a_token(key: &str) -> bool {
    let ends_in_token = |word: &[u8]| word.len() >= 5 && word[word.len() - 5..].eq_ignore_ascii_case(b"token");
    let key = key.as_bytes();
    let mut start = 0;
    let mut after_lower = false;
    for (at, &c) in key.iter().enumerate() {
        let alphanumeric = c.is_ascii_alphanumeric();
        if !alphanumeric || (c.is_ascii_uppercase() && after_lower) {
            if ends_in_token(&key[start..at]) {
                return true;
            }
            // an upper case letter starts the next word; anything else is between words
            start = if alphanumeric { at } else { at + 1 };
        }
        after_lower = c.is_ascii_lowercase() || c.is_ascii_digit();
    }
    ends_in_token(&key[start..])
}

/// Replaces the values of secret-looking keys and secret-looking strings with `"***"`.
pub fn mask_value(value: &Value) -> Value {
    let mut masked = value.clone();
    mask_value_in_place(&mut masked);
    masked
}

/// [`mask_value`] on the value itself: only the strings that change are replaced.
fn mask_value_in_place(value: &mut Value) {
    match value {
        Value::Object(obj) => {
            for (k, v) in obj.iter_mut() {
                if is_secret_key(k) {
                    *v = Value::String(MASK.into());
                } else {
                    mask_value_in_place(v);
                }
            }
        }
        Value::Array(items) => items.iter_mut().for_each(mask_value_in_place),
        Value::String(s) => {
            if let Cow::Owned(masked) = mask_text_cow(s) {
                *s = masked;
            }
        }
        _ => {}
    }
}

/// A fact's value: all of it when the key names a secret, else as text.
pub fn mask_fact(key: &str, value: &str) -> String {
    if is_secret_key(key) {
        MASK.to_owned()
    } else {
        mask_text(value)
    }
}

/// Masks secrets in free text (see the module documentation).
pub fn mask_text(text: &str) -> String {
    mask_text_cow(text).into_owned()
}

/// [`mask_text`], borrowed when nothing is masked (most texts): then nothing is copied.
fn mask_text_cow(text: &str) -> Cow<'_, str> {
    // NUL can't be stored by every backend, and nothing needs it.
    if text.contains('\0') {
        return Cow::Owned(mask_text_cow(&text.replace('\0', "")).into_owned());
    }
    if text.contains("-----BEGIN") && text.contains("PRIVATE KEY") {
        return Cow::Owned(MASK.into());
    }
    let mut out = Edits { text, edited: None, copied: 0 };
    // The next word is a secret: after `Bearer`, or after `password:` with the value apart.
    let mut mask_next = false;
    // The word before, when it could be a secret key on its own, so that `=` or `:` may follow
    // apart. Whether it names a secret is asked only when one does: most words are followed by
    // neither, and the check reads the whole word.
    let mut key_before: Option<&str> = None;
    for (at, piece) in pieces(text) {
        if piece.starts_with(char::is_whitespace) {
            continue;
        }
        let (lead, core, _) = unwrap(piece);
        if core.is_empty() {
            continue;
        }
        let core_at = at + lead.len();
        if mask_next {
            // `Authorization: Bearer xyz`: the scheme stays, the word after it goes.
            if !is_auth_scheme(core) {
                mask_next = false;
                out.replace(core_at, core.len(), MASK);
            }
            continue;
        }
        if core.eq_ignore_ascii_case("bearer") {
            mask_next = true;
            continue;
        }
        // `password = hunter2`, `"password" : "hunter2"`, `password =hunter2`.
        if let Some(key) = key_before.take() {
            if core == "=" || core == ":" {
                if is_secret_key(key) {
                    mask_next = true;
                    continue;
                }
            } else if let Some(value) = core.strip_prefix(['=', ':']).filter(|v| !v.is_empty()) {
                if is_secret_key(key) {
                    out.replace(core_at + 1, value.len(), MASK);
                    continue;
                }
            }
        }
        key_before = (!core.contains(['=', ':'])).then_some(core);
        let (masked, wants_next) = mask_word(core);
        mask_next = wants_next;
        if let Cow::Owned(masked) = masked {
            out.replace(core_at, core.len(), &masked);
        }
    }
    out.finish()
}

/// A text with some of its ranges replaced, copied only once the first one is.
struct Edits<'a> {
    text: &'a str,
    edited: Option<String>,
    /// How much of `text` is in `edited` (or stands for itself).
    copied: usize,
}

impl<'a> Edits<'a> {
    /// Replaces `len` bytes at `at` (at or after what was replaced before) with `with`.
    fn replace(&mut self, at: usize, len: usize, with: &str) {
        let edited = self.edited.get_or_insert_with(|| String::with_capacity(self.text.len()));
        edited.push_str(&self.text[self.copied..at]);
        edited.push_str(with);
        self.copied = at + len;
    }

    fn finish(self) -> Cow<'a, str> {
        match self.edited {
            None => Cow::Borrowed(self.text),
            Some(mut edited) => {
                edited.push_str(&self.text[self.copied..]);
                Cow::Owned(edited)
            }
        }
    }
}

/// Runs of whitespace and runs of anything else, in order, each with where it starts.
fn pieces(text: &str) -> impl Iterator<Item = (usize, &str)> {
    let mut chars = text.char_indices().peekable();
    std::iter::from_fn(move || {
        let (start, first) = chars.next()?;
        let space = first.is_whitespace();
        let mut end = text.len();
        while let Some(&(i, c)) = chars.peek() {
            if c.is_whitespace() != space {
                end = i;
                break;
            }
            chars.next();
        }
        Some((start, &text[start..end]))
    })
}

/// Splits quotes and brackets around a word off it (`"abc",` → `"`, `abc`, `",`). `:` and `=` stay
/// on the word, where they mark a key.
fn unwrap(word: &str) -> (&str, &str, &str) {
    let core_start = word.find(|c: char| !"\"'([{<`".contains(c)).unwrap_or(word.len());
    let rest = &word[core_start..];
    let core_len = rest.trim_end_matches(|c: char| "\"'.,;!?)]}>`".contains(c)).len();
    (&word[..core_start], &rest[..core_len], &rest[core_len..])
}

fn is_auth_scheme(word: &str) -> bool {
    ["bearer", "basic", "token", "digest"].iter().any(|s| word.eq_ignore_ascii_case(s))
}

/// Masks one word; says whether the word after it is a secret too (`password:` ends the word).
/// A word with nothing to mask comes back borrowed, as most words do.
fn mask_word(word: &str) -> (Cow<'_, str>, bool) {
    let word = mask_url_credentials(word);
    if !word.contains([';', '&', '?', ',']) {
        let (masked, next) = mask_segment(&word);
        let changed = match masked {
            Cow::Borrowed(_) => None,
            Cow::Owned(masked) => Some(masked),
        };
        return (changed.map_or(word, Cow::Owned), next);
    }
    // Connection strings and query strings: `Server=db;Password=x`, `?a=1&token=x`, compact JSON.
    let mut out = String::with_capacity(word.len());
    let mut changed = false;
    let mut rest = &word[..];
    loop {
        let end = rest.find([';', '&', '?', ',']).unwrap_or(rest.len());
        let (masked, next) = mask_segment(&rest[..end]);
        changed |= matches!(masked, Cow::Owned(_));
        out.push_str(&masked);
        if end == rest.len() {
            return (if changed { Cow::Owned(out) } else { word }, next);
        }
        out.push_str(&rest[end..end + 1]);
        rest = &rest[end + 1..];
    }
}

/// Borrowed: the segment as it is; owned: masked.
fn mask_segment(segment: &str) -> (Cow<'_, str>, bool) {
    if segment.is_empty() {
        return (Cow::Borrowed(segment), false);
    }
    // `key=value` or `key:value`, but not `scheme://`.
    let sep = segment.char_indices().find(|&(i, c)| c == '=' || (c == ':' && !segment[i + 1..].starts_with("//")));
    if let Some((i, _)) = sep {
        let key = segment[..i].trim_matches(|c: char| "\"'{[( ".contains(c));
        let value = &segment[i + 1..];
        if !key.is_empty() && is_secret_key(key) {
            let inner = value.trim_matches(|c: char| "\"'}])".contains(c));
            if inner.is_empty() {
                return (Cow::Borrowed(segment), true);
            }
            let lead_len = value.len() - value.trim_start_matches(|c: char| "\"'".contains(c)).len();
            let trail_len = value.len() - value.trim_end_matches(|c: char| "\"'}])".contains(c)).len();
            return (
                Cow::Owned(format!(
                    "{}{}{MASK}{}",
                    &segment[..=i],
                    &value[..lead_len],
                    &value[value.len() - trail_len..]
                )),
                false,
            );
        }
        if is_secret_token(value.trim_matches(|c: char| "\"'}])".contains(c))) {
            return (Cow::Owned(format!("{}{MASK}", &segment[..=i])), false);
        }
        return (Cow::Borrowed(segment), false);
    }
    if is_secret_token(segment) {
        return (Cow::Owned(MASK.to_owned()), false);
    }
    (Cow::Borrowed(segment), false)
}

/// A token recognisable by its shape.
fn is_secret_token(word: &str) -> bool {
    // The shortest is `sk-` and six more: most words are shorter, and need no look at their letters.
    if word.len() < 9 {
        return false;
    }
    let word_chars = |s: &str| s.chars().all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_');
    for prefix in ["sk-", "sk_"] {
        if let Some(rest) = word.strip_prefix(prefix) {
            if rest.len() >= 6 && word_chars(rest) && rest.chars().any(|c| c.is_ascii_digit()) {
                return true;
            }
        }
    }
    if word.len() == 20
        && (word.starts_with("AKIA") || word.starts_with("ASIA"))
        && word.chars().all(|c| c.is_ascii_uppercase() || c.is_ascii_digit())
    {
        return true;
    }
    if TOKEN_PREFIXES.iter().any(|(p, n)| word.strip_prefix(p).is_some_and(|rest| rest.len() >= *n && word_chars(rest)))
    {
        return true;
    }
    // A JWT: three base64url parts, the first a JSON object (`{"` → `eyJ`).
    word.starts_with("eyJ")
        && word.len() >= 20
        && word.split('.').count() == 3
        && word.chars().all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_' || c == '.')
}

/// `scheme://user:pw@host…` → `scheme://***@host…`.
fn mask_url_credentials(word: &str) -> Cow<'_, str> {
    // a byte search first: most words have no `:` at all
    if !word.contains(':') {
        return Cow::Borrowed(word);
    }
    if let Some(scheme_end) = word.find("://") {
        let rest = &word[scheme_end + 3..];
        let authority = &rest[..rest.find('/').unwrap_or(rest.len())];
        if let Some(at) = authority.rfind('@') {
            if authority[..at].contains(':') {
                return Cow::Owned(format!("{}://{MASK}@{}", &word[..scheme_end], &rest[at + 1..]));
            }
        }
    }
    Cow::Borrowed(word)
}

/// A value that went through the masker: the only form in which user- or tool-supplied text (a
/// title, a message, a tool's arguments and result, a decision and its note, a fact, a summary)
/// reaches the store, an event or a response.
///
/// The store's write methods take `Masked` values, so a new route or tool cannot forget to mask:
/// every way to make one masks, but [`Masked::from_store`], which wraps what the store reads back
/// (masked on its way in). Deserializing masks too, so a `Masked` field of a request body is masked
/// as it is parsed. Masking is idempotent: a masked value masks to itself.
#[derive(Clone, PartialEq, Eq, Hash, Default, PartialOrd, Ord, serde::Serialize)]
#[serde(transparent)]
pub struct Masked<T>(T);

/// What [`Masked`] can hold: text, masked with [`mask_text`], and JSON, with [`mask_value`].
pub trait Maskable: Sized {
    fn masked(self) -> Self;
}

impl Maskable for String {
    fn masked(self) -> Self {
        mask_text(&self)
    }
}

impl Maskable for Value {
    fn masked(mut self) -> Self {
        mask_value_in_place(&mut self);
        self
    }
}

impl<T: Maskable> Masked<T> {
    /// Masks `raw`.
    pub fn new(raw: T) -> Self {
        Masked(raw.masked())
    }

    /// A value the store read back: it was masked when it was written (or is the model's own text,
    /// which only ever saw masked input). Only the stores call this.
    pub fn from_store(stored: T) -> Self {
        Masked(stored)
    }

    pub fn into_inner(self) -> T {
        self.0
    }

    pub fn inner(&self) -> &T {
        &self.0
    }

    /// Applies `f` to the masked value and masks the result again.
    pub fn map(self, f: impl FnOnce(T) -> T) -> Self {
        Masked::new(f(self.0))
    }
}

impl Masked<Value> {
    /// The JSON as text: masked values serialize to masked text.
    pub fn to_text(&self) -> Masked<String> {
        // serde_json into a buffer: `Display` would go through a formatter for every piece. A
        // `Value` always serializes (its keys are strings).
        Masked(serde_json::to_string(&self.0).unwrap_or_default())
    }
}

impl Masked<String> {
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// A fact's value: all of it when the key names a secret (see [`mask_fact`]).
    pub fn fact(key: &str, value: &str) -> Self {
        Masked(mask_fact(key, value))
    }

    /// Masked, then cut to at most `max` characters.
    pub fn truncated(raw: &str, max: usize) -> Self {
        Masked(truncate(&mask_text(raw), max))
    }
}

impl<T> std::ops::Deref for Masked<T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.0
    }
}

impl<T: std::fmt::Debug> std::fmt::Debug for Masked<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

impl std::fmt::Display for Masked<String> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::fmt::Display for Masked<Value> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

impl From<&str> for Masked<String> {
    fn from(raw: &str) -> Self {
        Masked(mask_text(raw))
    }
}

impl From<String> for Masked<String> {
    fn from(raw: String) -> Self {
        Masked::new(raw)
    }
}

impl From<&String> for Masked<String> {
    fn from(raw: &String) -> Self {
        Masked(mask_text(raw))
    }
}

impl From<Value> for Masked<Value> {
    fn from(raw: Value) -> Self {
        Masked::new(raw)
    }
}

impl From<&Value> for Masked<Value> {
    fn from(raw: &Value) -> Self {
        Masked(mask_value(raw))
    }
}

impl PartialEq<str> for Masked<String> {
    fn eq(&self, other: &str) -> bool {
        self.0 == other
    }
}

impl PartialEq<&str> for Masked<String> {
    fn eq(&self, other: &&str) -> bool {
        self.0 == *other
    }
}

impl PartialEq<String> for Masked<String> {
    fn eq(&self, other: &String) -> bool {
        &self.0 == other
    }
}

impl PartialEq<Masked<String>> for &str {
    fn eq(&self, other: &Masked<String>) -> bool {
        *self == other.0
    }
}

impl PartialEq<Masked<String>> for str {
    fn eq(&self, other: &Masked<String>) -> bool {
        self == other.0
    }
}

impl PartialEq<Masked<String>> for String {
    fn eq(&self, other: &Masked<String>) -> bool {
        *self == other.0
    }
}

impl PartialEq<Masked<Value>> for Value {
    fn eq(&self, other: &Masked<Value>) -> bool {
        *self == other.0
    }
}

impl PartialEq<Value> for Masked<Value> {
    fn eq(&self, other: &Value) -> bool {
        &self.0 == other
    }
}

impl<'de, T: Maskable + serde::Deserialize<'de>> serde::Deserialize<'de> for Masked<T> {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        T::deserialize(deserializer).map(Masked::new)
    }
}

#[cfg(feature = "openapi")]
impl<T: utoipa::PartialSchema> utoipa::PartialSchema for Masked<T> {
    fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
        T::schema()
    }
}

#[cfg(feature = "openapi")]
impl<T: utoipa::ToSchema> utoipa::ToSchema for Masked<T> {
    fn name() -> std::borrow::Cow<'static, str> {
        T::name()
    }
}

/// Whether `text` holds something the masker would hide. Identifiers a client chooses (thread ids,
/// idempotency keys, call ids) are refused when they do, rather than stored or echoed.
pub fn looks_secret(text: &str) -> bool {
    mask_text(text) != text
}

/// Cuts `text` to at most `max` characters, marking the cut.
pub fn truncate(text: &str, max: usize) -> String {
    if text.chars().count() <= max {
        text.to_owned()
    } else {
        let mut s: String = text.chars().take(max.saturating_sub(1)).collect();
        s.push('…');
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// The key check as first written, with copies: the byte-wise one must agree with it.
    fn is_secret_key_plainly(key: &str) -> bool {
        let lower = key.to_ascii_lowercase().replace('-', "_");
        let mut words = Vec::new();
        let mut word = String::new();
        let mut after_lower = false;
        for c in key.chars() {
            if !c.is_ascii_alphanumeric() || (c.is_ascii_uppercase() && after_lower) {
                words.push(std::mem::take(&mut word));
            }
            after_lower = c.is_ascii_lowercase() || c.is_ascii_digit();
            if c.is_ascii_alphanumeric() {
                word.push(c.to_ascii_lowercase());
            }
        }
        words.push(word);
        SECRET_KEYS.iter().any(|s| lower.contains(s)) || words.iter().any(|w| w.ends_with("token"))
    }

    /// The text masker as first written: a copy of every text, a check of every word as a key.
    fn mask_text_plainly(text: &str) -> String {
        // NUL can't be stored by every backend, and nothing needs it.
        let stripped;
        let text = if text.contains('\0') {
            stripped = text.replace('\0', "");
            stripped.as_str()
        } else {
            text
        };
        if text.contains("-----BEGIN") && text.contains("PRIVATE KEY") {
            return MASK.into();
        }
        let mut out = String::with_capacity(text.len());
        // The next word is a secret: after `Bearer`, or after `password:` with the value apart.
        let mut mask_next = false;
        // The word before was a secret key on its own, so `=` or `:` may follow apart.
        let mut after_key = false;
        for piece in pieces_plainly(text) {
            if piece.starts_with(char::is_whitespace) {
                out.push_str(piece);
                continue;
            }
            let (lead, core, trail) = unwrap(piece);
            if core.is_empty() {
                out.push_str(piece);
                continue;
            }
            if mask_next {
                // `Authorization: Bearer xyz`: the scheme stays, the word after it goes.
                if is_auth_scheme(core) {
                    out.push_str(piece);
                } else {
                    mask_next = false;
                    out.push_str(lead);
                    out.push_str(MASK);
                    out.push_str(trail);
                }
                continue;
            }
            if core.eq_ignore_ascii_case("bearer") {
                mask_next = true;
                out.push_str(piece);
                continue;
            }
            // `password = hunter2`, `"password" : "hunter2"`, `password =hunter2`.
            if std::mem::take(&mut after_key) {
                if core == "=" || core == ":" {
                    mask_next = true;
                    out.push_str(piece);
                    continue;
                }
                if let Some(value) = core.strip_prefix(['=', ':']).filter(|v| !v.is_empty()) {
                    out.push_str(lead);
                    out.push_str(&core[..core.len() - value.len()]);
                    out.push_str(MASK);
                    out.push_str(trail);
                    continue;
                }
            }
            after_key = !core.contains(['=', ':']) && is_secret_key(core);
            let (masked, wants_next) = mask_word(core);
            mask_next = wants_next;
            out.push_str(lead);
            out.push_str(&masked);
            out.push_str(trail);
        }
        out
    }

    fn pieces_plainly(text: &str) -> Vec<&str> {
        let mut out = Vec::new();
        let mut start = 0;
        let mut in_space = None;
        for (i, c) in text.char_indices() {
            let space = c.is_whitespace();
            if in_space.is_some_and(|s| s != space) {
                out.push(&text[start..i]);
                start = i;
            }
            in_space = Some(space);
        }
        if start < text.len() {
            out.push(&text[start..]);
        }
        out
    }

    proptest::proptest! {
        #[test]
        fn the_key_check_agrees_with_its_plain_definition(
            key in "([a-zA-Z0-9_\\- .:é]|Token|TOKEN|token|Api-Key|PASS-word|secret|Access_Key){0,8}"
        ) {
            proptest::prop_assert_eq!(is_secret_key(&key), is_secret_key_plainly(&key), "{:?}", key);
        }

        #[test]
        fn the_text_masker_agrees_with_its_plain_definition(
            words in proptest::collection::vec(
                "(password|Password|api_key|TOKEN|token|sk-live-12345678|sk_4bcdefg1|x=1|key=|secret:|pw=s3cret;|=|:|=v|:v|\
                 Bearer|bearer|Basic|Authorization:|abc|[a-zA-Z]{1,6}|https://u:p@h/x|https://h/x|a,b|p?token=x&y=1|\
                 AKIAIOSFODNN7EXAMPLE|ghp_0123456789abcdefXYZ|eyJhbGciOi.eyJzdWIi.c2lnbmF0dXJl|\\(\"|\",|错误|é)",
                0..14),
            // ASCII whitespace, Unicode whitespace (no-break, em, next-line), or none: words joined
            spaces in proptest::collection::vec("( |  |\n|\t| \r\n|\u{0B}|\u{0C}|\u{A0}|\u{2003}|\u{85}|)", 14),
        ) {
            let mut text = String::new();
            for (word, space) in words.iter().zip(&spaces) {
                text.push_str(word);
                text.push_str(space);
            }
            let text = text.trim_end_matches(' ');
            let masked = mask_text_cow(text);
            let plainly = mask_text_plainly(text);
            proptest::prop_assert_eq!(masked.as_ref(), plainly.as_str(), "{:?}", text);
            proptest::prop_assert_eq!(matches!(masked, Cow::Borrowed(_)), masked == text, "{:?}", text);
        }

        #[test]
        fn masking_json_in_place_is_masking_its_text(
            words in proptest::collection::vec("(password|token|sk-live-12345678|x=1|Bearer|abc|[a-z]{1,6}|https://u:p@h/x|: |=)", 0..12)
        ) {
            let text = words.join(" ");
            let value = json!({"note": text, "list": [text], "n": 1});
            let masked = Masked::new(value.clone()).into_inner();
            proptest::prop_assert_eq!(&masked["note"], &json!(mask_text(&text)));
            proptest::prop_assert_eq!(&masked["list"][0], &json!(mask_text(&text)));
            proptest::prop_assert_eq!(masked, mask_value(&value));
        }
    }

    #[test]
    fn secrets_are_masked() {
        let v = mask_value(&json!({"orderId": "ord-2", "apiKey": "sk-1", "nested": {"db_password": "x"},
            "url": "postgres://u:p@db/x", "note": "use Bearer abc.def now", "list": ["AKIAIOSFODNN7EXAMPLE"]}));
        assert_eq!(v["orderId"], "ord-2");
        assert_eq!(v["apiKey"], "***");
        assert_eq!(v["nested"]["db_password"], "***");
        assert_eq!(v["url"], "postgres://***@db/x");
        assert_eq!(v["note"], "use Bearer *** now");
        assert_eq!(v["list"][0], "***");
        assert_eq!(mask_text("-----BEGIN RSA PRIVATE KEY-----\nabc"), "***");
    }

    #[test]
    fn key_value_pairs_in_free_text() {
        let cases = [
            ("login with password=hunter2 ok", "login with password=*** ok"),
            ("password: hunter2", "password: ***"),
            ("Password:hunter2.", "Password:***."),
            (r#"{"password": "hunter2", "user": "bob"}"#, r#"{"password": "***", "user": "bob"}"#),
            (r#"{"user":"bob","password":"hunter2"}"#, r#"{"user":"bob","password":"***"}"#),
            ("Server=db;User Id=admin;Password=s3cr3t;", "Server=db;User Id=admin;Password=***;"),
            ("GET /x?page=2&access_token=abc123 200", "GET /x?page=2&access_token=*** 200"),
            ("API_KEY=abcdef export", "API_KEY=*** export"),
            ("client-secret = xyz", "client-secret = ***"),
            ("password =xyz", "password =***"),
            (r#"{"password" : "hunter2"}"#, r#"{"password" : "***"}"#),
            ("the token expired at noon", "the token expired at noon"),
            ("Authorization: Basic dXNlcjpwYXNz", "Authorization: Basic ***"),
            ("authorization: Bearer sk-live-123", "authorization: Bearer ***"),
            ("Bearer", "Bearer"),
        ];
        for (input, want) in cases {
            assert_eq!(mask_text(input), want, "{input}");
        }
    }

    #[test]
    fn urls_keep_everything_but_the_credentials() {
        let cases = [
            ("connect postgres://admin:pw@db/x now", "connect postgres://***@db/x now"),
            ("(mysql://root:p@ss@10.0.0.1:3306/app)", "(mysql://***@10.0.0.1:3306/app)"),
            ("DATABASE_URL=postgres://u:p;w@db/x", "DATABASE_URL=postgres://***@db/x"),
            ("https://host:8443/a/@b", "https://host:8443/a/@b"),
            ("ssh://git@github.com/x", "ssh://git@github.com/x"),
            ("https://api.example.com/v1?token=abc&x=1", "https://api.example.com/v1?token=***&x=1"),
            ("at 12:30:00 the status was OK", "at 12:30:00 the status was OK"),
        ];
        for (input, want) in cases {
            assert_eq!(mask_text(input), want, "{input}");
        }
    }

    #[test]
    fn tokens_by_their_shape() {
        let cases = [
            ("key sk-live-123 here", "key *** here"),
            ("sk-proj-AbC123dEf456", "***"),
            ("\"sk_live_51HxYz\",", "\"***\","),
            ("aws AKIAIOSFODNN7EXAMPLE", "aws ***"),
            ("ASIAY34FZKBOKMUTVV7A.", "***."),
            ("ghp_0123456789abcdefABCD", "***"),
            ("xoxb-1234-5678-abcdef", "***"),
            ("eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxIn0.sig_nature", "***"),
            ("key=sk-live-123456", "key=***"),
            (&format!("my key keel_{}", "0a".repeat(32)), "my key ***"),
            (&format!("?ticket=kst_{}", "f1".repeat(32)), "?ticket=***"),
            // Not tokens.
            ("keel_core and kst_x", "keel_core and kst_x"),
            ("sk-learn and ord-2", "sk-learn and ord-2"),
            ("AKIA is a prefix", "AKIA is a prefix"),
            ("tokenizer-free text with v1.2.3", "tokenizer-free text with v1.2.3"),
        ];
        for (input, want) in cases {
            assert_eq!(mask_text(input), want, "{input}");
        }
    }

    #[test]
    fn whitespace_and_multibyte_text_survive() {
        let text = "line one\n\tline two  错误日志 password=错误\n";
        assert_eq!(mask_text(text), "line one\n\tline two  错误日志 password=***\n");
        assert_eq!(mask_text(""), "");
        assert_eq!(mask_text("   "), "   ");
    }

    #[test]
    fn facts_with_secret_keys_are_masked_whole() {
        assert_eq!(mask_fact("db_password", "hunter2"), "***");
        assert_eq!(mask_fact("dsn", "postgres://admin:pw@db/x"), "postgres://***@db/x");
        assert_eq!(mask_fact("order", "ord-2"), "ord-2");
    }

    #[test]
    fn token_keys_but_not_token_counts() {
        for secret in ["token", "access_token", "refreshToken", "X-Auth-Token", "csrftoken", "API_TOKEN"] {
            assert!(is_secret_key(secret), "{secret}");
        }
        for plain in ["max_tokens", "maxTokens", "tokenizer", "tokens_used", "orderId"] {
            assert!(!is_secret_key(plain), "{plain}");
        }
    }

    #[test]
    fn masked_values_mask_on_every_way_in() {
        let planted = "call sk-proj-AbC123dEf456 with password=hunter2";
        let text: Masked<String> = planted.into();
        assert_eq!(text, "call *** with password=***");
        let parsed: Masked<String> = serde_json::from_value(json!(planted)).unwrap();
        assert_eq!(parsed, text);
        let json: Masked<Value> = json!({"note": planted, "apiKey": "x"}).into();
        assert_eq!(json.inner(), &json!({"note": "call *** with password=***", "apiKey": "***"}));
        assert_eq!(serde_json::to_value(&text).unwrap(), json!("call *** with password=***"));
        assert!(looks_secret(planted));
        assert!(!looks_secret("approve-int_0192"));
    }

    #[test]
    fn masking_is_idempotent() {
        for text in [
            "password=hunter2 and Bearer abc and sk-live-123456 at postgres://u:p@db/x",
            r#"{"password": "x", "token": "y"}"#,
            "AKIAIOSFODNN7EXAMPLE ghp_0123456789abcdefABCD",
        ] {
            let once = mask_text(text);
            assert_eq!(mask_text(&once), once, "{text}");
        }
    }

    #[test]
    fn truncate_marks_the_cut() {
        assert_eq!(truncate("abcdef", 4), "abc…");
        assert_eq!(truncate("错误日志", 10), "错误日志");
    }

    #[test]
    fn nul_characters_are_dropped() {
        assert_eq!(mask_text("a\0b"), "ab");
        assert_eq!(mask_value(&serde_json::json!({"x": "p\0q"}))["x"], "pq");
    }
}
