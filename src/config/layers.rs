//! The file and the environment as one tree of values, each knowing where it came from: a file's value keeps its
//! TOML type and line, a variable's value is its text, read as whatever the key it sets asks for (see [`super::read`]).
//!
//! Owns parsing the file, laying the variables over it, and finding a key's value and origin again for a problem
//! found later. It never decides what a value means: that is the [`super::Config`] type's.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;

use super::env::{Env, ENV_PREFIX, ENV_SEPARATOR, FILE_ONLY_LISTS};
use super::ConfigError;

/// Where a value was given.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Origin {
    /// A file (its name as given) and the line the value is on.
    File { name: Arc<str>, line: usize },
    /// An environment variable.
    Env(String),
}

impl fmt::Display for Origin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Origin::File { name, line } => write!(f, "{name}, line {line}"),
            Origin::Env(variable) => write!(f, "from {variable}"),
        }
    }
}

/// A value of the tree.
#[derive(Debug, Clone)]
pub(super) enum Value {
    Table(BTreeMap<String, Node>),
    Array(Vec<Node>),
    /// A TOML string, integer, float, boolean or datetime, as the file typed it.
    Scalar(Scalar),
    /// A variable's text: an integer key reads it as an integer, a boolean key as `true`/`false`, and so on.
    Text(String),
    /// Taken out after it was refused: its key reads as absent (its default), its place in a list is skipped,
    /// so that the rest of the configuration is still checked.
    Refused,
}

#[derive(Debug, Clone, PartialEq)]
pub(super) enum Scalar {
    String(String),
    Integer(i128),
    Float(f64),
    Boolean(bool),
    Datetime(String),
}

#[derive(Debug, Clone)]
pub(super) struct Node {
    pub(super) value: Value,
    /// `None` for the tables a variable's path makes on its way to its key.
    pub(super) origin: Option<Origin>,
}

impl Node {
    fn table() -> Node {
        Node {
            value: Value::Table(BTreeMap::new()),
            origin: None,
        }
    }

    /// The tree of a file's text; a syntax error is the one problem, at its line.
    pub(super) fn from_file(text: &str, name: &str) -> Result<Node, ConfigError> {
        let name: Arc<str> = Arc::from(name);
        let lines = Lines::of(text);
        match toml::de::DeTable::parse(text) {
            Ok(table) => {
                let origin = Origin::File {
                    name: name.clone(),
                    line: 1,
                };
                Ok(Node {
                    value: Value::Table(file_table(table.get_ref(), &name, &lines)),
                    origin: Some(origin),
                })
            }
            Err(err) => {
                let line = err.span().map_or(1, |span| lines.at(span.start));
                Err(
                    ConfigError::new("config", format!("not valid TOML: {}", one_line(err.message())))
                        .given_at(Origin::File { name, line }),
                )
            }
        }
    }

    /// The tree of no file at all.
    pub(super) fn empty() -> Node {
        Node::table()
    }

    /// Lays the `FLOODGATE__` variables over the tree. A variable naming a list of tables (which a name cannot
    /// index) is a problem of its own and is left out.
    pub(super) fn overlay_env(&mut self, env: &Env, problems: &mut Vec<ConfigError>) {
        let mut refused_lists = Vec::new();
        for (variable, text) in env.values() {
            let Some(rest) = variable
                .get(ENV_PREFIX.len()..)
                .filter(|_| variable.len() > ENV_PREFIX.len())
            else {
                continue;
            };
            let path: Vec<String> = rest.split(ENV_SEPARATOR).map(str::to_ascii_lowercase).collect();
            if path.iter().any(String::is_empty) {
                problems.push(
                    ConfigError::new(
                        "environment",
                        format!("{variable}: not a key (parts are separated by a double underscore)"),
                    )
                    .with_value(format!("{text:?}")),
                );
                continue;
            }
            if let Some(list) = FILE_ONLY_LISTS
                .iter()
                .find(|list| path.first().map(String::as_str) == Some(**list))
            {
                refused_lists.push((*list, variable.clone()));
                continue;
            }
            let leaf = Node {
                value: Value::Text(text),
                origin: Some(Origin::Env(variable)),
            };
            self.insert(&path, leaf);
        }
        refused_lists.sort();
        problems.extend(refused_lists.into_iter().map(|(list, variable)| {
            ConfigError::new(
                list,
                format!("cannot be set from the environment ({variable}); give [[{list}]] in the file"),
            )
        }));
    }

    /// Puts `leaf` at `path`, making the tables on the way (a value in the way is replaced: the later layer wins).
    fn insert(&mut self, path: &[String], leaf: Node) {
        let Some((last, parents)) = path.split_last() else {
            return;
        };
        let mut node = self;
        for part in parents {
            if !matches!(node.value, Value::Table(_)) {
                *node = Node::table();
            }
            let Value::Table(entries) = &mut node.value else {
                return;
            };
            node = entries.entry(part.clone()).or_insert_with(Node::table);
        }
        if !matches!(node.value, Value::Table(_)) {
            *node = Node::table();
        }
        if let Value::Table(entries) = &mut node.value {
            entries.insert(last.clone(), leaf);
        }
    }

    /// The value a problem's key names (`upstreams.api.max_connections`, `routes[2].upstream`,
    /// `trusted_proxies[0]`) as a file would write it (`None` for a table or list), and where it was given; `None`
    /// if no layer gave it.
    pub(super) fn shown(&self, key: &str) -> Option<(Option<String>, Option<&Origin>)> {
        let mut node = self;
        let mut steps = Step::parse(key)?.into_iter();
        while let Some(step) = steps.next() {
            node = match (node.child(step), &node.value, step) {
                (Some(next), _, _) => next,
                // An item of a variable's comma-separated text.
                (None, Value::Text(text), Step::Index(index)) if steps.next().is_none() => {
                    let item = text_items(text).nth(index)?;
                    return Some((Some(format!("{item:?}")), node.origin.as_ref()));
                }
                _ => return None,
            };
        }
        let value = match node.value {
            Value::Table(_) | Value::Array(_) | Value::Refused => None,
            _ => Some(node.value.to_string()),
        };
        Some((value, node.origin.as_ref()))
    }

    /// Marks the value `key` names as refused; false if there is no such value left to refuse. An item of a
    /// variable's comma-separated text is refused alone: the text becomes the list it reads as.
    pub(super) fn refuse(&mut self, key: &str) -> bool {
        let Some(steps) = Step::parse(key) else {
            return false;
        };
        let mut node = self;
        for step in steps {
            if let (Value::Text(text), Step::Index(_)) = (&node.value, step) {
                let items = text_items(text)
                    .map(|item| Node {
                        value: Value::Text(item.to_string()),
                        origin: node.origin.clone(),
                    })
                    .collect();
                node.value = Value::Array(items);
            }
            let next = match (&mut node.value, step) {
                (Value::Table(entries), Step::Key(name)) => entries.get_mut(name),
                (Value::Array(items), Step::Index(index)) => items.get_mut(index),
                _ => None,
            };
            let Some(next) = next else { return false };
            node = next;
        }
        if matches!(node.value, Value::Refused) {
            return false;
        }
        node.value = Value::Refused;
        true
    }

    fn child(&self, step: Step<'_>) -> Option<&Node> {
        match (&self.value, step) {
            (Value::Table(entries), Step::Key(name)) => entries.get(name),
            (Value::Array(items), Step::Index(index)) => items.get(index),
            _ => None,
        }
    }
}

/// The items of a variable's text that a list key reads (see [`super::read`]): comma-separated, trimmed, empty
/// ones skipped.
pub(super) fn text_items(text: &str) -> impl Iterator<Item = &str> {
    text.split(',').map(str::trim).filter(|item| !item.is_empty())
}

/// One step of a key's path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Step<'a> {
    Key(&'a str),
    Index(usize),
}

impl<'a> Step<'a> {
    /// `a.b[2].c` as `a`, `b`, `2`, `c`; `None` if an index is not a number.
    fn parse(key: &'a str) -> Option<Vec<Step<'a>>> {
        let mut steps = Vec::new();
        for part in key.split('.') {
            let (name, mut indexes) = match part.split_once('[') {
                Some((name, rest)) => (name, Some(rest)),
                None => (part, None),
            };
            if !name.is_empty() {
                steps.push(Step::Key(name));
            }
            while let Some(rest) = indexes {
                let (index, after) = rest.split_once(']')?;
                steps.push(Step::Index(index.parse().ok()?));
                indexes = after.strip_prefix('[');
            }
        }
        Some(steps)
    }
}

/// Byte offsets of line starts, to name the line a span starts on.
struct Lines(Vec<usize>);

impl Lines {
    fn of(text: &str) -> Lines {
        let starts = std::iter::once(0)
            .chain(text.match_indices('\n').map(|(at, _)| at + 1))
            .collect();
        Lines(starts)
    }

    fn at(&self, offset: usize) -> usize {
        self.0.partition_point(|&start| start <= offset).max(1)
    }
}

fn file_table(table: &toml::de::DeTable<'_>, name: &Arc<str>, lines: &Lines) -> BTreeMap<String, Node> {
    table
        .iter()
        .map(|(key, value)| {
            let line = lines.at(key.span().start);
            (key.get_ref().to_string(), file_node(value.get_ref(), line, name, lines))
        })
        .collect()
}

fn file_node(value: &toml::de::DeValue<'_>, line: usize, name: &Arc<str>, lines: &Lines) -> Node {
    use toml::de::DeValue;
    let value = match value {
        DeValue::String(text) => Value::Scalar(Scalar::String(text.to_string())),
        // TOML integers fit an i64; the parser has checked the digits, so this cannot fail for a parsed file.
        DeValue::Integer(integer) => match i128::from_str_radix(integer.as_str(), integer.radix()) {
            Ok(number) => Value::Scalar(Scalar::Integer(number)),
            Err(_) => Value::Scalar(Scalar::String(integer.to_string())),
        },
        DeValue::Float(float) => match float.as_str().parse::<f64>() {
            Ok(number) => Value::Scalar(Scalar::Float(number)),
            Err(_) => Value::Scalar(Scalar::String(float.to_string())),
        },
        DeValue::Boolean(flag) => Value::Scalar(Scalar::Boolean(*flag)),
        DeValue::Datetime(datetime) => Value::Scalar(Scalar::Datetime(datetime.to_string())),
        DeValue::Array(items) => Value::Array(
            items
                .iter()
                .map(|item| file_node(item.get_ref(), lines.at(item.span().start), name, lines))
                .collect(),
        ),
        DeValue::Table(table) => Value::Table(file_table(table, name, lines)),
    };
    Node {
        value,
        origin: Some(Origin::File {
            name: name.clone(),
            line,
        }),
    }
}

impl fmt::Display for Value {
    /// The value as a TOML file would write it, for a problem to show what it is about.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Value::Scalar(Scalar::String(text)) | Value::Text(text) => write!(f, "{text:?}"),
            Value::Scalar(Scalar::Integer(number)) => write!(f, "{number}"),
            Value::Scalar(Scalar::Float(number)) => write!(f, "{number:?}"),
            Value::Scalar(Scalar::Boolean(flag)) => write!(f, "{flag}"),
            Value::Scalar(Scalar::Datetime(text)) => f.write_str(text),
            Value::Array(_) => f.write_str("[…]"),
            Value::Table(_) => f.write_str("{…}"),
            Value::Refused => f.write_str("(refused)"),
        }
    }
}

pub(super) fn one_line(text: &str) -> String {
    text.split_whitespace().collect::<Vec<_>>().join(" ")
}

impl Env {
    /// The `FLOODGATE__` variables and their values, sorted by name (a value that is not Unicode is left out, as
    /// no key could use it).
    fn values(&self) -> Vec<(String, String)> {
        let mut values: Vec<(String, String)> = match self {
            Env::Process => std::env::vars_os()
                .filter_map(|(name, value)| Some((name.into_string().ok()?, value.into_string().ok()?)))
                .collect(),
            Env::Vars(vars) => vars.iter().map(|(k, v)| (k.clone(), v.clone())).collect(),
        };
        values.retain(|(name, _)| {
            name.get(..ENV_PREFIX.len())
                .is_some_and(|prefix| prefix.eq_ignore_ascii_case(ENV_PREFIX))
        });
        values.sort();
        values
    }
}
