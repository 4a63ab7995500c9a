//! What every kind of tool builds the same way: the name, the policies by role, the confirmation
//! card, the timeout and size limit, the headers and variables it resolves, and keeping their
//! values out of messages.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use keel_core::mask;
use keel_core::tool::{ActionDescription, Policy, ToolError, ToolSpec};
use keel_core::UserRole;
use reqwest::header::{HeaderMap, HeaderName, HeaderValue};
use serde_json::Value;

use crate::config::{CommonConfig, ConfirmConfig, PolicyConfig, ToolConfigError};
use crate::http::DEFAULT_MAX_RESPONSE_BYTES;
use crate::template::{arg_text, Template};

/// How much of one argument a card shows.
const CARD_ARG_CHARS: usize = 120;
const CARD_TITLE_CHARS: usize = 200;
const CARD_TEXT_CHARS: usize = 1000;

/// The same rule as the registry's, checked here so the error names the field.
pub(crate) fn check_name(name: &str) -> Result<(), ToolConfigError> {
    let ok = !name.is_empty()
        && name.len() <= 64
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
    if ok {
        Ok(())
    } else {
        Err(ToolConfigError::new("name", "must be 1 to 64 of A-Z, a-z, 0-9, _ and -"))
    }
}

fn role_names() -> String {
    UserRole::ALL.iter().map(|r| r.as_str()).collect::<Vec<_>>().join(", ")
}

fn parse_policy(field: &str, word: &str) -> Result<Policy, ToolConfigError> {
    Policy::parse(word).ok_or_else(|| {
        ToolConfigError::new(field, format!("{:?} is not a policy; use allow, ask or deny", mask::truncate(word, 40)))
    })
}

/// The policy of each role. Absent: [`ToolSpec::new`]'s (read-only: allowed; side effects: ask,
/// viewers denied). A table lists roles; a role it does not list is denied.
pub(crate) fn policies(
    config: Option<&PolicyConfig>,
    side_effect: bool,
) -> Result<BTreeMap<UserRole, Policy>, ToolConfigError> {
    match config {
        None => Ok(ToolSpec::new("", "", Value::Null, side_effect).policies),
        Some(PolicyConfig::All(word)) => {
            let policy = parse_policy("policy", word)?;
            Ok(UserRole::ALL.iter().map(|r| (*r, policy)).collect())
        }
        Some(PolicyConfig::ByRole(table)) => {
            let mut out = BTreeMap::new();
            for (role_name, word) in table {
                let field = format!("policy.{}", mask::truncate(role_name, 40));
                let role = UserRole::parse(role_name).ok_or_else(|| {
                    ToolConfigError::new(&field, format!("unknown role; the roles are {}", role_names()))
                })?;
                out.insert(role, parse_policy(&field, word)?);
            }
            Ok(out)
        }
    }
}

/// The confirmation card's templates, checked against the argument schema's properties.
#[derive(Debug, Clone)]
pub(crate) struct Card {
    title: Option<Template>,
    risk: Option<Template>,
    description: Option<Template>,
}

impl Card {
    pub(crate) fn parse(config: &ConfirmConfig, properties: &BTreeSet<String>) -> Result<Self, ToolConfigError> {
        let one = |field: &str, text: &Option<String>| -> Result<Option<Template>, ToolConfigError> {
            let Some(text) = text else { return Ok(None) };
            let t = Template::parse(text).map_err(|m| ToolConfigError::new(field, m))?;
            t.check_args(properties).map_err(|m| ToolConfigError::new(field, m))?;
            Ok(Some(t))
        };
        Ok(Self {
            title: one("confirm.title", &config.title)?,
            risk: one("confirm.risk", &config.risk)?,
            description: one("confirm.description", &config.description)?,
        })
    }

    /// The card for `args`: each template filled, or its default (`default_risk` is the kind's).
    pub(crate) fn describe(
        &self,
        common: &CommonConfig,
        args: &Value,
        default_risk: impl FnOnce() -> String,
    ) -> ActionDescription {
        let fill = |t: &Template, max: usize| {
            let text = t
                .render::<std::convert::Infallible>(|name| {
                    // A secret-named argument is hidden whole; any other is masked as text.
                    Ok(mask::truncate(&mask::mask_fact(name, &arg_text(args, name)), CARD_ARG_CHARS))
                })
                .unwrap_or_else(|never| match never {});
            mask::truncate(&text, max)
        };
        ActionDescription {
            title: match &self.title {
                Some(t) => fill(t, CARD_TITLE_CHARS),
                None => format!("Run {}?", common.name),
            },
            risk: match &self.risk {
                Some(t) => fill(t, CARD_TEXT_CHARS),
                None => default_risk(),
            },
            description: match &self.description {
                Some(t) => fill(t, CARD_TEXT_CHARS),
                None => mask::truncate(&format!("{} {}", common.name, mask::mask_value(args)), CARD_TEXT_CHARS),
            },
        }
    }
}

/// `${VAR}` in a header value, replaced by the variable's value; each value used is added to `secrets`.
pub(crate) fn interpolate(
    field: &str,
    template: &str,
    env: &dyn Fn(&str) -> Option<String>,
    secrets: &mut Vec<String>,
) -> Result<String, ToolConfigError> {
    let mut out = String::new();
    let mut rest = template;
    while let Some(start) = rest.find("${") {
        out.push_str(&rest[..start]);
        let after = &rest[start + 2..];
        let Some(end) = after.find('}') else {
            return Err(ToolConfigError::new(field, "a ${ is never closed; write ${VAR}"));
        };
        let var = &after[..end];
        let valid = var.bytes().next().is_some_and(|b| b.is_ascii_alphabetic() || b == b'_')
            && var.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_');
        if !valid {
            return Err(ToolConfigError::new(
                field,
                "${…} must name an environment variable: letters, digits and _, not starting with a digit",
            ));
        }
        match env(var) {
            Some(value) => {
                out.push_str(&value);
                secrets.push(value);
            }
            None => return Err(ToolConfigError::new(field, format!("the environment variable {var} is not set"))),
        }
        rest = &after[end + 1..];
    }
    out.push_str(rest);
    Ok(out)
}

/// The configured headers, resolved and marked sensitive; each variable's value and each whole
/// header value is added to `secrets`. A header in `reserved` is refused with `why`.
pub(crate) fn resolve_headers(
    configured: &BTreeMap<String, String>,
    reserved: &[&str],
    why: &str,
    env: &dyn Fn(&str) -> Option<String>,
    secrets: &mut Vec<String>,
) -> Result<HeaderMap, ToolConfigError> {
    let mut headers = HeaderMap::new();
    for (name, template) in configured {
        let field = format!("headers.{}", mask::truncate(name, 64));
        let header = HeaderName::from_bytes(name.trim().as_bytes())
            .map_err(|_| ToolConfigError::new(&field, "not a valid HTTP header name"))?;
        if reserved.contains(&header.as_str()) {
            return Err(ToolConfigError::new(&field, why));
        }
        if headers.contains_key(&header) {
            return Err(ToolConfigError::new(&field, "given twice (header names are case-insensitive)"));
        }
        let resolved = interpolate(&field, template, env, secrets)?;
        // The message says where the bad byte may come from, never what the value is.
        let mut value = HeaderValue::from_str(&resolved).map_err(|_| {
            ToolConfigError::new(
                &field,
                "not a valid header value once ${…} is replaced (a newline or control character?)",
            )
        })?;
        value.set_sensitive(true);
        headers.insert(header, value);
        secrets.push(resolved);
    }
    Ok(headers)
}

/// Shorter secret values are not scrubbed from messages (they would hide ordinary words).
const MIN_SCRUBBED_CHARS: usize = 4;

/// The secrets a tool keeps out of its messages, ready for [`scrub`]: very short values dropped
/// (they would blank out ordinary words), the longest first (a value that holds another is
/// replaced whole).
pub(crate) fn tidy_secrets(secrets: &mut Vec<String>) {
    secrets.retain(|s| s.trim().len() >= MIN_SCRUBBED_CHARS);
    secrets.sort_by(|a, b| b.len().cmp(&a.len()).then_with(|| a.cmp(b)));
    secrets.dedup();
}

/// `text` with every one of `secrets` replaced by `***`.
pub(crate) fn scrub(secrets: &[String], text: String) -> String {
    secrets
        .iter()
        .fold(text, |t, secret| if t.contains(secret.as_str()) { t.replace(secret.as_str(), "***") } else { t })
}

/// `e` with its message passed through `scrub`.
pub(crate) fn scrub_error(e: ToolError, scrub: impl Fn(String) -> String) -> ToolError {
    match e {
        ToolError::Invalid(m) => ToolError::Invalid(scrub(m)),
        ToolError::Precondition(m) => ToolError::Precondition(scrub(m)),
        ToolError::Failed(m) => ToolError::Failed(scrub(m)),
        ToolError::Unreachable(m) => ToolError::Unreachable(scrub(m)),
        ToolError::Timeout(m) => ToolError::Timeout(scrub(m)),
        ToolError::Status { status, message } => ToolError::Status { status, message: scrub(message) },
        ToolError::BadResponse(m) => ToolError::BadResponse(scrub(m)),
        ToolError::TooLarge { limit } => ToolError::TooLarge { limit },
        ToolError::OutcomeUnknown(m) => ToolError::OutcomeUnknown(scrub(m)),
    }
}

/// `timeout`: a duration such as `10s`, more than 0; absent, the engine's default.
pub(crate) fn parse_timeout(text: Option<&str>) -> Result<Duration, ToolConfigError> {
    let timeout = match text {
        None => keel_core::tool::DEFAULT_TOOL_TIMEOUT,
        Some(text) => humantime::parse_duration(text.trim()).map_err(|e| {
            ToolConfigError::new("timeout", format!("{e}; write a duration such as \"10s\" or \"500ms\""))
        })?,
    };
    if timeout.is_zero() {
        return Err(ToolConfigError::new("timeout", "must be more than 0"));
    }
    Ok(timeout)
}

/// `max_response_bytes`: more than 0; absent, [`DEFAULT_MAX_RESPONSE_BYTES`].
pub(crate) fn parse_max_response_bytes(n: Option<u64>) -> Result<usize, ToolConfigError> {
    match n {
        None => Ok(DEFAULT_MAX_RESPONSE_BYTES),
        Some(0) => Err(ToolConfigError::new("max_response_bytes", "must be more than 0")),
        Some(n) => usize::try_from(n).map_err(|_| ToolConfigError::new("max_response_bytes", "too large")),
    }
}
