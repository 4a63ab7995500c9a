//! Prefixed, typed identifiers.
//!
//! Every id carries its kind in its text (`run_…`, `int_…`), so a wrong id in the wrong place fails
//! to compile and is recognisable in logs and URLs.

use std::fmt;

use serde::{Deserialize, Serialize};

/// The error returned when a string is not an id of the expected kind. It does not repeat the
/// string: a client's mistake (a key pasted where an id goes) must not come back in an error.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("not a valid {kind} id (expected `{prefix}` followed by 1 to 64 of [A-Za-z0-9_-])")]
pub struct InvalidId {
    pub kind: &'static str,
    pub prefix: &'static str,
}

macro_rules! typed_id {
    ($(#[$doc:meta])* $name:ident, $prefix:literal, $kind:literal) => {
        $(#[$doc])*
        #[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
        #[serde(try_from = "String", into = "String")]
        pub struct $name(String);

        impl $name {
            pub const PREFIX: &'static str = $prefix;

            /// A new, random, time-ordered id.
            pub fn new() -> Self {
                Self(format!("{}{}", $prefix, uuid::Uuid::now_v7().simple()))
            }

            /// Parses an id, checking its prefix and alphabet.
            pub fn parse(value: &str) -> Result<Self, InvalidId> {
                let rest = value.strip_prefix($prefix);
                match rest {
                    Some(rest)
                        if !rest.is_empty()
                            && rest.len() <= 64
                            && rest.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-') =>
                    {
                        Ok(Self(value.to_owned()))
                    }
                    _ => Err(InvalidId { kind: $kind, prefix: $prefix }),
                }
            }

            pub fn as_str(&self) -> &str {
                &self.0
            }
        }

        impl Default for $name {
            fn default() -> Self {
                Self::new()
            }
        }

        impl TryFrom<String> for $name {
            type Error = InvalidId;
            fn try_from(value: String) -> Result<Self, Self::Error> {
                Self::parse(&value)
            }
        }

        impl From<$name> for String {
            fn from(id: $name) -> String {
                id.0
            }
        }

        impl std::str::FromStr for $name {
            type Err = InvalidId;
            fn from_str(s: &str) -> Result<Self, Self::Err> {
                Self::parse(s)
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }

        impl fmt::Debug for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }

        /// A string with the prefix, the alphabet and the length [`Self::parse`] checks.
        #[cfg(feature = "openapi")]
        impl utoipa::PartialSchema for $name {
            fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
                utoipa::openapi::ObjectBuilder::new()
                    .schema_type(utoipa::openapi::schema::Type::String)
                    .pattern(Some(concat!("^", $prefix, "[A-Za-z0-9_-]{1,64}$")))
                    .description(Some(concat!("A ", $kind, " id: `", $prefix, "…`.")))
                    .into()
            }
        }

        #[cfg(feature = "openapi")]
        impl utoipa::ToSchema for $name {}
    };
}

typed_id!(
    /// A conversation: `conv_…`.
    ConversationId, "conv_", "conversation"
);
typed_id!(
    /// A message: `msg_…`.
    MessageId, "msg_", "message"
);
typed_id!(
    /// A run: `run_…`.
    RunId, "run_", "run"
);
typed_id!(
    /// An interrupt: `int_…`.
    InterruptId, "int_", "interrupt"
);
typed_id!(
    /// A tool call: `call_…`. Stable from the model's request through approval to the result, and
    /// handed to side-effecting tools as their operation id.
    CallId, "call_", "tool call"
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_carry_their_prefix_and_round_trip() {
        let id = RunId::new();
        assert!(id.as_str().starts_with("run_"));
        assert_eq!(RunId::parse(id.as_str()).unwrap(), id);
        let json = serde_json::to_string(&id).unwrap();
        assert_eq!(serde_json::from_str::<RunId>(&json).unwrap(), id);
    }

    #[test]
    fn wrong_prefix_or_alphabet_is_refused() {
        assert!(RunId::parse("conv_abc").is_err());
        assert!(RunId::parse("run_").is_err());
        assert!(RunId::parse("run_a b").is_err());
        assert!(RunId::parse("run_../../etc").is_err());
        assert!(serde_json::from_str::<InterruptId>("\"run_x\"").is_err());
    }
}
