//! What every kind of tool builds the same way: the name, the policies by role and the
//! confirmation card.

use std::collections::{BTreeMap, BTreeSet};

use keel_core::mask;
use keel_core::tool::{ActionDescription, Policy, ToolSpec};
use keel_core::UserRole;
use serde_json::Value;

use crate::config::{CommonConfig, ConfirmConfig, PolicyConfig, ToolConfigError};
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
