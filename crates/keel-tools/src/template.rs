//! `{argName}` templates: the confirmation card's texts and an HTTP tool's URL path.
//!
//! `{{` and `}}` stand for literal braces. A placeholder names a top-level property of the tool's
//! argument schema; that is checked when the tool is built, so a typo is a configuration error rather
//! than an empty hole in a card a human reads.

use std::collections::BTreeSet;

use serde_json::Value;

#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Piece {
    Text(String),
    Arg(String),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Template {
    pieces: Vec<Piece>,
}

impl Template {
    /// Parses `text`; the error says what is wrong, in words (it quotes a placeholder, never a value).
    pub(crate) fn parse(text: &str) -> Result<Self, String> {
        let mut pieces = Vec::new();
        let mut literal = String::new();
        let mut chars = text.chars().peekable();
        while let Some(c) = chars.next() {
            match c {
                '{' if chars.peek() == Some(&'{') => {
                    chars.next();
                    literal.push('{');
                }
                '}' if chars.peek() == Some(&'}') => {
                    chars.next();
                    literal.push('}');
                }
                '{' => {
                    let mut name = String::new();
                    loop {
                        match chars.next() {
                            Some('}') => break,
                            Some('{') => return Err("a placeholder cannot contain {".to_owned()),
                            Some(c) => name.push(c),
                            None => return Err("a { is never closed (write {{ for a literal brace)".to_owned()),
                        }
                    }
                    let name = name.trim();
                    if name.is_empty() {
                        return Err("an empty placeholder {} (write {{}} for literal braces)".to_owned());
                    }
                    if !literal.is_empty() {
                        pieces.push(Piece::Text(std::mem::take(&mut literal)));
                    }
                    pieces.push(Piece::Arg(name.to_owned()));
                }
                '}' => return Err("a } without its { (write }} for a literal brace)".to_owned()),
                c => literal.push(c),
            }
        }
        if !literal.is_empty() {
            pieces.push(Piece::Text(literal));
        }
        Ok(Self { pieces })
    }

    pub(crate) fn args(&self) -> impl Iterator<Item = &str> {
        self.pieces.iter().filter_map(|p| match p {
            Piece::Arg(name) => Some(name.as_str()),
            Piece::Text(_) => None,
        })
    }

    /// Fails with the first placeholder that is not a property of the argument schema.
    pub(crate) fn check_args(&self, properties: &BTreeSet<String>) -> Result<(), String> {
        match self.args().find(|a| !properties.contains(*a)) {
            None => Ok(()),
            Some(unknown) => Err(format!(
                "the placeholder {{{}}} is not a property of args_schema (its properties: {})",
                keel_core::mask::truncate(unknown, 64),
                if properties.is_empty() {
                    "none".to_owned()
                } else {
                    properties.iter().map(String::as_str).collect::<Vec<_>>().join(", ")
                }
            )),
        }
    }

    /// The template with each placeholder replaced by `fill(name)`.
    pub(crate) fn render<E>(&self, mut fill: impl FnMut(&str) -> Result<String, E>) -> Result<String, E> {
        let mut out = String::new();
        for piece in &self.pieces {
            match piece {
                Piece::Text(t) => out.push_str(t),
                Piece::Arg(name) => out.push_str(&fill(name)?),
            }
        }
        Ok(out)
    }

    /// The template as written, placeholders and all: safe to show, it holds no argument values.
    pub(crate) fn source(&self) -> String {
        let mut out = String::new();
        for piece in &self.pieces {
            match piece {
                Piece::Text(t) => out.push_str(t),
                Piece::Arg(name) => {
                    out.push('{');
                    out.push_str(name);
                    out.push('}');
                }
            }
        }
        out
    }
}

/// The top-level property names of an argument schema (`properties`), the names placeholders may use.
pub(crate) fn schema_properties(schema: &Value) -> BTreeSet<String> {
    schema.get("properties").and_then(Value::as_object).map(|p| p.keys().cloned().collect()).unwrap_or_default()
}

/// An argument as text for a card: strings as they are, other scalars as JSON, a missing or null
/// argument as nothing.
pub(crate) fn arg_text(args: &Value, name: &str) -> String {
    match args.get(name) {
        None | Some(Value::Null) => String::new(),
        Some(Value::String(s)) => s.clone(),
        Some(other) => other.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn parses_placeholders_and_escapes() {
        let t = Template::parse("Restart {instanceId} in {{prod}}?").unwrap();
        assert_eq!(t.args().collect::<Vec<_>>(), ["instanceId"]);
        assert_eq!(t.source(), "Restart {instanceId} in {prod}?");
        let filled = t.render::<()>(|n| Ok(format!("<{n}>"))).unwrap();
        assert_eq!(filled, "Restart <instanceId> in {prod}?");
        assert!(Template::parse("a {b").is_err());
        assert!(Template::parse("a } b").is_err());
        assert!(Template::parse("a {} b").is_err());
        assert!(Template::parse("a {b{c}} b").is_err());
    }

    #[test]
    fn placeholders_must_be_properties() {
        let props = schema_properties(&json!({"type": "object", "properties": {"id": {"type": "string"}}}));
        assert!(Template::parse("/x/{id}").unwrap().check_args(&props).is_ok());
        let e = Template::parse("/x/{idd}").unwrap().check_args(&props).unwrap_err();
        assert!(e.contains("{idd}") && e.contains("id"), "{e}");
    }

    #[test]
    fn argument_text() {
        let args = json!({"s": "a b", "n": 3, "b": true, "z": null});
        assert_eq!(arg_text(&args, "s"), "a b");
        assert_eq!(arg_text(&args, "n"), "3");
        assert_eq!(arg_text(&args, "b"), "true");
        assert_eq!(arg_text(&args, "z"), "");
        assert_eq!(arg_text(&args, "missing"), "");
    }
}
