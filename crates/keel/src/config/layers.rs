//! The layers under [`Options`], merged by figment: defaults < the file < the environment < flags.
//!
//! clap has already read each flag and, for a flag not given, its `KEEL_…` variable, and filled in
//! the defaults; it also says which of the three each value is. So the parsed options are split
//! back into three layers, the file goes between the lowest two, and figment's record of which
//! layer each value came from lets an error name what the user wrote: `--heartbeat`,
//! `KEEL_HEARTBEAT` or `keel.toml: heartbeat`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::{anyhow, bail};
use clap::parser::{ArgMatches, ValueSource};
use clap::{Args, Command};
use figment::error::Kind;
use figment::value::{Dict, Map, Value};
use figment::{Figment, Metadata, Profile, Provider, Source};

use super::{Env, Options};

/// A setting that is read from a variable but is not a flag (see [`Options`]).
struct EnvOnly {
    key: &'static str,
    var: &'static str,
    value: fn(String) -> Value,
}

const ENV_ONLY: &[EnvOnly] = &[
    EnvOnly { key: "model_api_key", var: "KEEL_MODEL_API_KEY", value: Value::from },
    // Anything but an explicit no keeps usage on, as it always has.
    EnvOnly {
        key: "model_include_usage",
        var: "KEEL_MODEL_INCLUDE_USAGE",
        value: |v| Value::from(!matches!(v.as_str(), "0" | "false" | "no")),
    },
];

/// The names of the layers other than the file's, as figment keeps them with each value.
const DEFAULTS: &str = "defaults";
const ENVIRONMENT: &str = "environment";
const FLAGS: &str = "flags";

/// The file the settings were read from when it is not named: `./keel.toml`.
const DEFAULT_FILE: &str = "keel.toml";

pub(super) struct Layers {
    figment: Figment,
    /// The file read, if there was one.
    file: Option<PathBuf>,
    /// For each key that is a flag: `--its-name` and its variable.
    flags: BTreeMap<String, (Option<String>, Option<String>)>,
}

impl Layers {
    pub(super) fn new(options: &Options, matches: &ArgMatches, env: Env) -> anyhow::Result<Self> {
        let flags: BTreeMap<_, _> = Options::augment_args(Command::new("keel"))
            .get_arguments()
            .map(|arg| {
                let long = arg.get_long().map(|l| format!("--{l}"));
                let var = arg.get_env().map(|v| v.to_string_lossy().into_owned());
                (arg.get_id().to_string(), (long, var))
            })
            .collect();
        let Value::Dict(_, parsed) = Value::serialize(options).map_err(|e| anyhow!("the parsed options: {e}"))? else {
            bail!("the parsed options are not a table");
        };
        let (mut defaults, mut from_env, mut given) = (Dict::new(), Dict::new(), Dict::new());
        for (key, value) in parsed {
            // Only a flag's id may be asked about: clap's debug builds panic on any other.
            let source = if flags.contains_key(&key) { matches.value_source(&key) } else { None };
            let layer = match source {
                Some(ValueSource::CommandLine) => &mut given,
                Some(ValueSource::EnvVariable) => &mut from_env,
                // Defaults, and what only the file can set (empty here).
                _ => &mut defaults,
            };
            layer.insert(key, value);
        }
        for setting in ENV_ONLY {
            if let Some(text) = env(setting.var) {
                from_env.insert(setting.key.to_owned(), (setting.value)(text));
            }
        }

        let file = read_file(options.config.as_deref())?;
        let mut figment = Figment::new().merge(Layer::named(DEFAULTS, defaults));
        if let Some((path, table)) = &file {
            let Value::Dict(_, dict) = Value::serialize(table).map_err(|e| anyhow!("{}: {e}", path.display()))? else {
                bail!("{}: not a table", path.display());
            };
            let metadata = Metadata::from(path.display().to_string(), Source::File(path.clone()));
            figment = figment.merge(Layer { metadata, dict });
        }
        let figment = figment.merge(Layer::named(ENVIRONMENT, from_env)).merge(Layer::named(FLAGS, given));
        Ok(Self { figment, file: file.map(|(path, _)| path), flags })
    }

    /// The merged options, or one line about the first value that does not fit.
    pub(super) fn extract(&self) -> anyhow::Result<Options> {
        self.figment.extract().map_err(|e| anyhow!(self.describe(e)))
    }

    /// The file's name as the user gave it (`keel.toml` when none was read).
    pub(super) fn file_name(&self) -> String {
        self.file.as_deref().unwrap_or(Path::new(DEFAULT_FILE)).display().to_string()
    }

    /// Where the value of the top-level `key` came from, as the user wrote it: `--db`, `KEEL_DB`,
    /// `keel.toml: db`; a default is named by its key.
    pub(super) fn origin(&self, key: &str) -> String {
        let (long, var) = self.flags.get(key).cloned().unwrap_or_default();
        let var = var.or_else(|| ENV_ONLY.iter().find(|s| s.key == key).map(|s| s.var.to_owned()));
        match self.figment.find_metadata(key).and_then(|m| m.source.as_ref()) {
            Some(Source::File(path)) => format!("{}: {key}", path.display()),
            Some(Source::Custom(layer)) if layer == FLAGS => long.unwrap_or_else(|| key.to_owned()),
            Some(Source::Custom(layer)) if layer == ENVIRONMENT => var.unwrap_or_else(|| key.to_owned()),
            _ => key.to_owned(),
        }
    }

    /// A figment error as one line: `keel.toml: api_keys[0].role: expected a string, found …`.
    fn describe(&self, error: figment::Error) -> String {
        // figment may gather several errors; the first is enough to act on and keeps it one line.
        let error = error.into_iter().next().unwrap_or_else(|| figment::Error::from("no error"));
        let mut path = error.path.clone();
        // Secrets are never repeated, not even a mistyped one.
        let secret = matches!(path.first().map(String::as_str), Some("model_api_key" | "model_headers"));
        let problem = match &error.kind {
            Kind::UnknownField(name, expected) => {
                if path.last() != Some(name) {
                    path.push(name.clone());
                }
                unknown_key(name, expected)
            }
            Kind::MissingField(name) => {
                path.push(name.to_string());
                "required".to_owned()
            }
            Kind::InvalidType(_, expected) | Kind::InvalidValue(_, expected) if secret => {
                format!("expected {}", in_toml_words(expected))
            }
            Kind::InvalidType(actual, expected) | Kind::InvalidValue(actual, expected) => {
                format!("expected {}, found {}", in_toml_words(expected), found(actual))
            }
            Kind::UnknownVariant(name, known) => {
                let known: Vec<String> = known.iter().map(|k| format!("`{k}`")).collect();
                format!("expected one of {}, found {name:?}", known.join(", "))
            }
            kind => kind.to_string(),
        };
        let key = dotted(&path);
        let from_file = matches!(error.metadata.as_ref().and_then(|m| m.source.as_ref()), Some(Source::File(_)));
        // The other layers are written from `Options` itself, so an unknown key can only be the
        // file's, even where figment tagged the table holding it with another layer.
        if from_file || matches!(error.kind, Kind::UnknownField(..)) {
            format!("{}: {key}: {problem}", self.file_name())
        } else {
            let top = error.path.first().map(String::as_str).unwrap_or_default();
            format!("{} ({key}): {problem}", self.origin(top))
        }
    }
}

/// `unknown key`, with the known key nearest to `name` when there is one near enough to be a typo.
pub(super) fn unknown_key(name: &str, known: &[&str]) -> String {
    let near = known
        .iter()
        .map(|k| (strsim::jaro(name, k), k))
        .filter(|(score, _)| *score > 0.8)
        .max_by(|a, b| a.0.partial_cmp(&b.0).unwrap_or(std::cmp::Ordering::Equal));
    match near {
        Some((_, k)) => format!("unknown key (did you mean `{k}`?)"),
        None => "unknown key".to_owned(),
    }
}

/// serde's words for what was expected, in TOML's.
fn in_toml_words(expected: &str) -> String {
    expected.replace("a sequence", "an array").replace("a map", "a table")
}

/// A value as a TOML writer knows it: TOML has integers, not signed and unsigned ones.
fn found(actual: &figment::error::Actual) -> String {
    use figment::error::Actual;
    match actual {
        Actual::Signed(n) => format!("integer {n}"),
        Actual::Unsigned(n) => format!("integer {n}"),
        Actual::Float(x) => format!("float {x}"),
        Actual::Seq => "an array".to_owned(),
        Actual::Map => "a table".to_owned(),
        other => other.to_string(),
    }
}

/// `["api_keys", "0", "role"]` → `api_keys[0].role`.
pub(super) fn dotted(path: &[String]) -> String {
    let mut out = String::new();
    for segment in path {
        if !segment.is_empty() && segment.bytes().all(|b| b.is_ascii_digit()) {
            out.push_str(&format!("[{segment}]"));
        } else {
            if !out.is_empty() {
                out.push('.');
            }
            out.push_str(segment);
        }
    }
    out
}

/// One layer: its values and the name figment keeps with each of them.
struct Layer {
    metadata: Metadata,
    dict: Dict,
}

impl Layer {
    fn named(name: &'static str, dict: Dict) -> Self {
        Self { metadata: Metadata::from(name, Source::Custom(name.to_owned())), dict }
    }
}

impl Provider for Layer {
    fn metadata(&self) -> Metadata {
        self.metadata.clone()
    }

    fn data(&self) -> figment::Result<Map<Profile, Dict>> {
        Ok(Profile::Default.collect(self.dict.clone()))
    }
}

/// `named` (it must exist) or `./keel.toml` (if it exists), parsed. Read here rather than by
/// figment's own provider: that one quietly takes a missing file as empty and searches parent
/// directories, and its syntax errors span several lines.
fn read_file(named: Option<&Path>) -> anyhow::Result<Option<(PathBuf, toml::Table)>> {
    let (path, required) = match named {
        Some(path) => (path.to_owned(), true),
        None => (PathBuf::from(DEFAULT_FILE), false),
    };
    let text = match std::fs::read_to_string(&path) {
        Ok(text) => text,
        Err(e) if !required && e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => bail!("{}: cannot read it: {e}", path.display()),
    };
    match toml::from_str::<toml::Table>(&text) {
        Ok(table) => Ok(Some((path, table))),
        Err(e) => {
            let at = e.span().map(|span| line_and_column(&text, span.start)).unwrap_or_default();
            let message: Vec<&str> = e.message().lines().map(str::trim).filter(|l| !l.is_empty()).collect();
            bail!("{}{at}: {}", path.display(), message.join("; "))
        }
    }
}

/// `:LINE:COLUMN` of a byte offset, both from 1.
fn line_and_column(text: &str, offset: usize) -> String {
    let before = text.get(..offset).unwrap_or(text);
    let line = before.matches('\n').count() + 1;
    let column = before.rsplit('\n').next().unwrap_or_default().chars().count() + 1;
    format!(":{line}:{column}")
}
