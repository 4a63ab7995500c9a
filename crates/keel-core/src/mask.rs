//! Masking of secrets before anything is stored, streamed, logged or shown.

use serde_json::Value;

const SECRET_KEYS: &[&str] =
    &["password", "passwd", "secret", "token", "apikey", "api_key", "authorization", "private_key", "credential"];

/// Replaces the values of secret-looking keys and secret-looking strings with `"***"`.
pub fn mask_value(value: &Value) -> Value {
    match value {
        Value::Object(obj) => Value::Object(
            obj.iter()
                .map(|(k, v)| {
                    let lower = k.to_ascii_lowercase().replace('-', "_");
                    if SECRET_KEYS.iter().any(|s| lower.contains(s)) {
                        (k.clone(), Value::String("***".into()))
                    } else {
                        (k.clone(), mask_value(v))
                    }
                })
                .collect(),
        ),
        Value::Array(items) => Value::Array(items.iter().map(mask_value).collect()),
        Value::String(s) => Value::String(mask_text(s)),
        other => other.clone(),
    }
}

/// Masks bearer tokens, credentials in URLs and private key blocks in free text.
pub fn mask_text(text: &str) -> String {
    if text.contains("-----BEGIN") && text.contains("PRIVATE KEY") {
        return "***".into();
    }
    let mut out = String::with_capacity(text.len());
    let mut words = text.split(' ').peekable();
    let mut first = true;
    let mut after_bearer = false;
    while let Some(word) = words.next() {
        if !first {
            out.push(' ');
        }
        first = false;
        if after_bearer {
            out.push_str("***");
            after_bearer = false;
            continue;
        }
        if word.eq_ignore_ascii_case("bearer") {
            after_bearer = words.peek().is_some();
            out.push_str(word);
            continue;
        }
        out.push_str(&mask_url_credentials(word));
    }
    out
}

fn mask_url_credentials(word: &str) -> String {
    if let Some(scheme_end) = word.find("://") {
        let rest = &word[scheme_end + 3..];
        if let Some(at) = rest.find('@') {
            let userinfo = &rest[..at];
            if !userinfo.contains('/') && userinfo.contains(':') {
                return format!("{}://***@{}", &word[..scheme_end], &rest[at + 1..]);
            }
        }
    }
    word.to_owned()
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

    #[test]
    fn secrets_are_masked() {
        let v = mask_value(&json!({"instanceId": "pay-prod-2", "apiKey": "sk-1", "nested": {"db_password": "x"},
            "url": "postgres://u:p@db/x", "note": "use Bearer abc.def now"}));
        assert_eq!(v["instanceId"], "pay-prod-2");
        assert_eq!(v["apiKey"], "***");
        assert_eq!(v["nested"]["db_password"], "***");
        assert_eq!(v["url"], "postgres://***@db/x");
        assert_eq!(v["note"], "use Bearer *** now");
        assert_eq!(mask_text("-----BEGIN RSA PRIVATE KEY-----\nabc"), "***");
    }

    #[test]
    fn truncate_marks_the_cut() {
        assert_eq!(truncate("abcdef", 4), "abc…");
        assert_eq!(truncate("错误日志", 10), "错误日志");
    }
}
