//! What a client is told about a JSON body (or WebSocket frame) that does not fit: the field, the
//! expected type or rule, and the position — never the value it sent.
//!
//! serde's messages quote the offending input (`invalid type: string "sk-…", expected a boolean`,
//! `unknown variant `…``), so a secret pasted into the wrong field would come straight back in the
//! error body, and from there into any log or proxy that records error bodies. Every message is
//! rebuilt here from serde's categories, with the path taken by `serde_path_to_error`.

use serde::de::DeserializeOwned;
use serde_json::Value;

/// Decodes `value` as `T`; on failure, a message that names the field and the rule, not the value.
pub fn from_value<T: DeserializeOwned>(value: Value) -> Result<T, String> {
    serde_path_to_error::deserialize::<_, T>(value).map_err(|e| {
        let path = path_text(e.path());
        let what = describe(&e.inner().to_string());
        if path.is_empty() || path == "." {
            what
        } else {
            format!("{path}: {what}")
        }
    })
}

/// A syntax error (the body is not JSON at all): serde_json's messages name the position and what
/// it expected there, never the text around it.
pub fn syntax(e: &serde_json::Error) -> String {
    format!("{} at line {} column {}", syntax_kind(e), e.line(), e.column())
}

fn syntax_kind(e: &serde_json::Error) -> String {
    // "expected value at line 1 column 5" → "expected value"; the position is added back above.
    let text = e.to_string();
    match text.rfind(" at line ") {
        Some(i) => text[..i].to_owned(),
        None => text,
    }
}

/// `messages[2].content`, with any key that looks like a secret (a client may send any key) shown
/// as `?`.
fn path_text(path: &serde_path_to_error::Path) -> String {
    use serde_path_to_error::Segment;
    let mut out = String::new();
    for segment in path.iter() {
        match segment {
            Segment::Seq { index } => out.push_str(&format!("[{index}]")),
            Segment::Map { key } | Segment::Enum { variant: key } => push_key(&mut out, key),
            Segment::Unknown => push_key(&mut out, "?"),
        }
    }
    out
}

fn push_key(out: &mut String, key: &str) {
    if !out.is_empty() {
        out.push('.');
    }
    let shown = key.len() <= 64
        && key.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
        && !keel_core::mask::looks_secret(key);
    out.push_str(if shown { key } else { "?" });
}

/// serde's data-error messages with the input taken out. The shapes are serde's `de::Error`
/// defaults; anything else (a custom message from one of Keel's own types) is kept only if it
/// quotes nothing.
fn describe(message: &str) -> String {
    // serde_json appends " at line L column C" to data errors too.
    let (message, position) = match message.rfind(" at line ") {
        Some(i) => (&message[..i], &message[i..]),
        None => (message, ""),
    };
    let described = if let Some(rest) = message.strip_prefix("invalid type: ") {
        match rest.split_once(", expected ") {
            Some((unexpected, expected)) => format!("invalid type {}, expected {expected}", kind(unexpected)),
            None => "invalid type".to_owned(),
        }
    } else if let Some(rest) = message.strip_prefix("invalid value: ") {
        match rest.split_once(", expected ") {
            Some((unexpected, expected)) => format!("invalid value ({}), expected {expected}", kind(unexpected)),
            None => "invalid value".to_owned(),
        }
    } else if let Some(rest) = message.strip_prefix("unknown variant ") {
        match rest.split_once(", expected ") {
            Some((_, expected)) => format!("unknown variant, expected {expected}"),
            None => "unknown variant".to_owned(),
        }
    } else if let Some(rest) = message.strip_prefix("unknown field ") {
        match rest.split_once(", expected ") {
            Some((_, expected)) => format!("unknown field, expected {expected}"),
            None => "unknown field".to_owned(),
        }
    } else if message.starts_with("missing field ")
        || message.starts_with("duplicate field ")
        || message.starts_with("invalid length ")
    {
        // The field is one of the API's own names; the length a number.
        message.to_owned()
    } else if !message.contains(['"', '`', '\'']) && !keel_core::mask::looks_secret(message) {
        message.to_owned()
    } else {
        "invalid value".to_owned()
    };
    format!("{described}{position}")
}

/// `string "…"` → `string`, `integer `5`` → `integer`: the kind of what was sent, not its value.
fn kind(unexpected: &str) -> &str {
    let end = unexpected.find(['"', '`', '\'']).unwrap_or(unexpected.len());
    let kind = unexpected[..end].trim();
    if kind.is_empty() {
        "value"
    } else {
        kind
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde::Deserialize;
    use serde_json::json;

    #[derive(Debug, Deserialize)]
    #[serde(rename_all = "camelCase")]
    #[allow(dead_code)]
    struct Body {
        content: String,
        #[serde(default)]
        cancel_on_disconnect: bool,
        #[serde(default)]
        mode: Option<Mode>,
        #[serde(default)]
        items: Vec<u32>,
    }

    #[derive(Debug, Deserialize)]
    #[serde(rename_all = "snake_case")]
    enum Mode {
        Fast,
        Slow,
    }

    #[derive(Debug, Deserialize)]
    #[serde(deny_unknown_fields)]
    #[allow(dead_code)]
    struct Strict {
        a: u32,
    }

    const SECRET: &str = "sk-proj-AbC123dEf456";

    #[test]
    fn wrong_types_name_the_field_and_the_type_not_the_value() {
        let e = from_value::<Body>(json!({"content": "hi", "cancelOnDisconnect": SECRET})).unwrap_err();
        assert_eq!(e, "cancelOnDisconnect: invalid type string, expected a boolean");
        let e = from_value::<Body>(json!({"content": 12345})).unwrap_err();
        assert_eq!(e, "content: invalid type integer, expected a string");
        let e = from_value::<Body>(json!({"content": "x", "mode": SECRET})).unwrap_err();
        assert_eq!(e, "mode: unknown variant, expected `fast` or `slow`");
        assert!(!e.contains(SECRET));
        let e = from_value::<Body>(json!({"content": "x", "items": [1, SECRET]})).unwrap_err();
        assert_eq!(e, "items[1]: invalid type string, expected u32");
        let e = from_value::<Body>(json!({})).unwrap_err();
        assert_eq!(e, "missing field `content`");
    }

    #[test]
    fn unknown_keys_are_not_repeated() {
        let e = from_value::<Strict>(json!({"a": 1, SECRET: 2})).unwrap_err();
        assert!(!e.contains(SECRET), "{e}");
        assert!(e.contains("unknown field"), "{e}");
    }

    #[test]
    fn syntax_errors_give_the_position() {
        let e = serde_json::from_str::<Value>(&format!("{{\"a\": {SECRET}}}")).unwrap_err();
        let text = syntax(&e);
        assert!(!text.contains(SECRET), "{text}");
        assert!(text.contains("line 1 column"), "{text}");
    }
}
