//! Reads the typed configuration out of the layers' tree ([`super::layers`]): serde's `Deserializer` over it.
//!
//! Strict where the layer can be: a file's value must have the key's TOML type (`max_connections = "8"` and
//! `proxy_protocol = 1` are refused), a variable's text must read as the key's type (`8`, `true`/`false`). Each
//! refusal names the key it is about and says what was expected in words an operator reads: the valid values of
//! an enum, the key meant by a misspelt one. It never shows a value itself: the caller does, from the tree, so that
//! a secret is redacted in one place.

use std::fmt;

use serde::de::{self, DeserializeSeed, IntoDeserializer, MapAccess, SeqAccess, Unexpected, Visitor};

use super::layers::{Node, Scalar, Value};

/// Keys floodgate no longer reads, with what became of them: refused with that rather than as unknown.
const RETIRED: &[(&str, &str)] = &[(
    "http1_server",
    "retired: floodgate's own HTTP/1 server now serves every HTTP/1 client, TLS ones too (hyper's was removed); \
     remove the key",
)];

/// Why a value was refused, and at which key (`None` until the deserializer that met it names it).
#[derive(Debug)]
pub(super) struct Refusal {
    pub(super) key: Option<String>,
    pub(super) message: String,
}

impl Refusal {
    /// Names the key, unless a deeper one already did.
    fn at(mut self, key: &str) -> Refusal {
        if self.key.is_none() {
            self.key = Some(key.to_string());
        }
        self
    }
}

impl fmt::Display for Refusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.key {
            Some(key) => write!(f, "{key}: {}", self.message),
            None => f.write_str(&self.message),
        }
    }
}

impl std::error::Error for Refusal {}

impl de::Error for Refusal {
    fn custom<T: fmt::Display>(message: T) -> Self {
        Refusal {
            key: None,
            message: message.to_string(),
        }
    }

    fn invalid_type(unexpected: Unexpected<'_>, expected: &dyn de::Expected) -> Self {
        let expected = in_words(&expected.to_string());
        let hint = match unexpected {
            Unexpected::Str(_) if expected.contains("integer") || expected.contains("boolean") => {
                " (write it without quotes)"
            }
            _ => "",
        };
        Self::custom(format!("expected {expected}, not {}{hint}", kind(&unexpected)))
    }

    fn invalid_value(_: Unexpected<'_>, expected: &dyn de::Expected) -> Self {
        Self::custom(format!("expected {}", in_words(&expected.to_string())))
    }

    fn unknown_field(field: &str, expected: &'static [&'static str]) -> Self {
        if let Some((_, became)) = RETIRED.iter().find(|(retired, _)| *retired == field) {
            return Self::custom(*became);
        }
        let message = match closest(field, expected) {
            Some(meant) => format!("unknown key; did you mean `{meant}`?"),
            None if expected.len() <= 8 => format!("unknown key; this table takes {}", list(expected)),
            None => "unknown key (config/floodgate.toml lists every key)".to_string(),
        };
        Self::custom(message)
    }

    fn unknown_variant(variant: &str, expected: &'static [&'static str]) -> Self {
        let message = match closest(variant, expected) {
            Some(meant) if meant != variant => format!("must be one of {}; did you mean {meant}?", list(expected)),
            _ => format!("must be one of {}", list(expected)),
        };
        Self::custom(message)
    }

    fn missing_field(field: &'static str) -> Self {
        Self::custom(format!("`{field}` is required here"))
    }

    fn duplicate_field(field: &'static str) -> Self {
        Self::custom(format!("`{field}` is given twice"))
    }
}

/// serde's names for types, as an operator would say them.
fn in_words(expected: &str) -> String {
    match expected {
        "a duration" => "a duration such as \"5s\", \"250ms\" or \"1m 30s\"".to_string(),
        "a boolean" => "a boolean (true or false)".to_string(),
        "a string" | "a borrowed string" => "a string".to_string(),
        "struct" | "map" | "a map" => "a table".to_string(),
        "a sequence" => "a list".to_string(),
        "f64" | "f32" => "a number".to_string(),
        other if other.starts_with("struct ") || other.starts_with("a table") => "a table".to_string(),
        other if other.starts_with("variant identifier") || other.starts_with("enum ") => "a name".to_string(),
        other if ["u8", "u16", "u32", "u64", "usize", "i64"].contains(&other) => "an integer".to_string(),
        other => other.to_string(),
    }
}

fn kind(value: &Unexpected<'_>) -> &'static str {
    match value {
        Unexpected::Str(_) => "a string",
        Unexpected::Signed(_) | Unexpected::Unsigned(_) => "an integer",
        Unexpected::Float(_) => "a float",
        Unexpected::Bool(_) => "a boolean",
        Unexpected::Seq => "a list",
        Unexpected::Map => "a table",
        _ => "that",
    }
}

fn list(names: &[&str]) -> String {
    match names {
        [] => "nothing".to_string(),
        [only] => (*only).to_string(),
        [init @ .., last] => format!("{} or {last}", init.join(", ")),
    }
}

/// The name among `names` that `given` most likely shortens (`discipline` for `queue_discipline`, `lifo` for
/// `adaptive-lifo`: a name holding it whole says more than one a letter away) or misspells, if one is close enough.
fn closest<'a>(given: &str, names: &[&'a str]) -> Option<&'a str> {
    let given = given.to_ascii_lowercase();
    let misspelt = names
        .iter()
        .map(|name| (strsim::damerau_levenshtein(&given, name), *name))
        .filter(|(distance, name)| *distance <= (name.len() / 3).max(1))
        .min_by_key(|(distance, _)| *distance)
        .map(|(_, name)| name);
    let mut shortened = names
        .iter()
        .filter(|name| given.len() >= 4 && name.contains(given.as_str()));
    match (shortened.next(), shortened.next()) {
        (Some(only), None) => Some(*only),
        _ => misspelt,
    }
}

fn join(path: &str, key: &str) -> String {
    if path.is_empty() {
        key.to_string()
    } else {
        format!("{path}.{key}")
    }
}

/// A node of the tree at its key, as serde reads it.
pub(super) struct NodeReader<'a> {
    node: &'a Node,
    key: String,
}

impl<'a> NodeReader<'a> {
    pub(super) fn root(node: &'a Node) -> NodeReader<'a> {
        NodeReader {
            node,
            key: String::new(),
        }
    }
}

/// A variable's text (or one comma-separated item of it), read as the key asks.
struct TextReader<'a> {
    text: &'a str,
    key: String,
}

macro_rules! read_integer {
    ($($method:ident)*) => {$(
        fn $method<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Refusal> {
            self.integer(visitor)
        }
    )*};
}

macro_rules! forward_to_any {
    ($($method:ident)*) => {$(
        fn $method<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Refusal> {
            self.deserialize_any(visitor)
        }
    )*};
}

/// What both readers do alike whatever they hold: the shapes that read as any value, or as a sequence.
macro_rules! forward_shapes {
    () => {
        fn deserialize_ignored_any<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Refusal> {
            visitor.visit_unit()
        }

        forward_to_any!(deserialize_char deserialize_str deserialize_string deserialize_bytes deserialize_byte_buf
            deserialize_unit deserialize_map deserialize_identifier);

        fn deserialize_unit_struct<V: Visitor<'de>>(self, _: &'static str, visitor: V) -> Result<V::Value, Refusal> {
            self.deserialize_any(visitor)
        }

        fn deserialize_tuple<V: Visitor<'de>>(self, _: usize, visitor: V) -> Result<V::Value, Refusal> {
            self.deserialize_seq(visitor)
        }

        fn deserialize_tuple_struct<V: Visitor<'de>>(
            self,
            _: &'static str,
            _: usize,
            visitor: V,
        ) -> Result<V::Value, Refusal> {
            self.deserialize_seq(visitor)
        }

        fn deserialize_struct<V: Visitor<'de>>(
            self,
            _: &'static str,
            _: &'static [&'static str],
            visitor: V,
        ) -> Result<V::Value, Refusal> {
            self.deserialize_any(visitor)
        }
    };
}

impl<'de> NodeReader<'de> {
    fn integer<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Refusal> {
        match &self.node.value {
            Value::Text(text) => TextReader::new(text, self.key).integer(visitor),
            _ => de::Deserializer::deserialize_any(self, visitor),
        }
    }
}

impl<'de> de::Deserializer<'de> for NodeReader<'de> {
    type Error = Refusal;

    fn deserialize_any<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Refusal> {
        let result = match &self.node.value {
            Value::Table(entries) => visitor.visit_map(TableReader {
                entries: entries.iter(),
                pending: None,
                key: self.key.clone(),
            }),
            Value::Array(items) => visitor.visit_seq(ArrayReader {
                items: items.iter().enumerate(),
                key: self.key.clone(),
            }),
            Value::Scalar(Scalar::String(text) | Scalar::Datetime(text)) => visitor.visit_str(text),
            Value::Scalar(Scalar::Integer(number)) => visit_integer(*number, visitor),
            Value::Scalar(Scalar::Float(number)) => visitor.visit_f64(*number),
            Value::Scalar(Scalar::Boolean(flag)) => visitor.visit_bool(*flag),
            Value::Text(text) => visitor.visit_str(text),
            Value::Refused => Err(de::Error::custom("refused")),
        };
        result.map_err(|refusal| refusal.at(&self.key))
    }

    fn deserialize_bool<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Refusal> {
        match &self.node.value {
            Value::Text(text) => TextReader::new(text, self.key).deserialize_bool(visitor),
            _ => self.deserialize_any(visitor),
        }
    }

    read_integer!(deserialize_i8 deserialize_i16 deserialize_i32 deserialize_i64 deserialize_i128
        deserialize_u8 deserialize_u16 deserialize_u32 deserialize_u64 deserialize_u128);

    fn deserialize_f32<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Refusal> {
        self.deserialize_f64(visitor)
    }

    fn deserialize_f64<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Refusal> {
        match &self.node.value {
            Value::Text(text) => TextReader::new(text, self.key).deserialize_f64(visitor),
            _ => self.deserialize_any(visitor),
        }
    }

    fn deserialize_option<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Refusal> {
        visitor.visit_some(self)
    }

    fn deserialize_newtype_struct<V: Visitor<'de>>(self, _: &'static str, visitor: V) -> Result<V::Value, Refusal> {
        visitor.visit_newtype_struct(self)
    }

    fn deserialize_seq<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Refusal> {
        match &self.node.value {
            Value::Text(text) => TextReader::new(text, self.key).deserialize_seq(visitor),
            _ => self.deserialize_any(visitor),
        }
    }

    fn deserialize_enum<V: Visitor<'de>>(
        self,
        _: &'static str,
        _: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value, Refusal> {
        match &self.node.value {
            Value::Text(text) | Value::Scalar(Scalar::String(text)) => visitor
                .visit_enum(text.as_str().into_deserializer())
                .map_err(|refusal: Refusal| refusal.at(&self.key)),
            _ => self.deserialize_any(visitor),
        }
    }

    forward_shapes!();
}

/// A file's integers fit an i64; a variable's may not, and the key's type then says it is too large.
fn visit_integer<'de, V: Visitor<'de>>(number: i128, visitor: V) -> Result<V::Value, Refusal> {
    if let Ok(number) = i64::try_from(number) {
        visitor.visit_i64(number)
    } else if let Ok(number) = u64::try_from(number) {
        visitor.visit_u64(number)
    } else {
        visitor.visit_i128(number)
    }
}

impl<'de> TextReader<'de> {
    fn new(text: &'de str, key: String) -> TextReader<'de> {
        TextReader { text, key }
    }

    fn integer<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Refusal> {
        let result = match self.text.parse::<i128>() {
            Ok(number) => visit_integer(number, visitor),
            Err(_) => Err(de::Error::invalid_value(Unexpected::Str(self.text), &visitor)),
        };
        result.map_err(|refusal| refusal.at(&self.key))
    }
}

impl<'de> de::Deserializer<'de> for TextReader<'de> {
    type Error = Refusal;

    fn deserialize_any<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Refusal> {
        visitor
            .visit_str(self.text)
            .map_err(|refusal: Refusal| refusal.at(&self.key))
    }

    fn deserialize_bool<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Refusal> {
        let result = match self.text {
            "true" => visitor.visit_bool(true),
            "false" => visitor.visit_bool(false),
            _ => Err(de::Error::custom("expected true or false")),
        };
        result.map_err(|refusal: Refusal| refusal.at(&self.key))
    }

    read_integer!(deserialize_i8 deserialize_i16 deserialize_i32 deserialize_i64 deserialize_i128
        deserialize_u8 deserialize_u16 deserialize_u32 deserialize_u64 deserialize_u128);

    fn deserialize_f32<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Refusal> {
        self.deserialize_f64(visitor)
    }

    fn deserialize_f64<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Refusal> {
        let result = match self.text.parse::<f64>() {
            Ok(number) if number.is_finite() => visitor.visit_f64(number),
            _ => Err(de::Error::custom("expected a number")),
        };
        result.map_err(|refusal: Refusal| refusal.at(&self.key))
    }

    fn deserialize_option<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Refusal> {
        visitor.visit_some(self)
    }

    fn deserialize_newtype_struct<V: Visitor<'de>>(self, _: &'static str, visitor: V) -> Result<V::Value, Refusal> {
        visitor.visit_newtype_struct(self)
    }

    /// The one way a variable gives a list: its items separated by commas.
    fn deserialize_seq<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Refusal> {
        let items = super::layers::text_items(self.text);
        let key = self.key.clone();
        visitor
            .visit_seq(TextItems {
                items: items.enumerate(),
                key: &key,
            })
            .map_err(|refusal| refusal.at(&self.key))
    }

    fn deserialize_enum<V: Visitor<'de>>(
        self,
        _: &'static str,
        _: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value, Refusal> {
        visitor
            .visit_enum(self.text.into_deserializer())
            .map_err(|refusal: Refusal| refusal.at(&self.key))
    }

    forward_shapes!();
}

struct TableReader<'a> {
    entries: std::collections::btree_map::Iter<'a, String, Node>,
    pending: Option<(&'a String, &'a Node)>,
    key: String,
}

impl<'de> MapAccess<'de> for TableReader<'de> {
    type Error = Refusal;

    fn next_key_seed<K: DeserializeSeed<'de>>(&mut self, seed: K) -> Result<Option<K::Value>, Refusal> {
        for (name, node) in self.entries.by_ref() {
            if matches!(node.value, Value::Refused) {
                continue;
            }
            self.pending = Some((name, node));
            let key = join(&self.key, name);
            return seed
                .deserialize(name.as_str().into_deserializer())
                .map(Some)
                // An unknown key, say: the refusal is about the key itself, not its table.
                .map_err(|refusal: Refusal| Refusal {
                    key: Some(key),
                    ..refusal
                });
        }
        Ok(None)
    }

    fn next_value_seed<V: DeserializeSeed<'de>>(&mut self, seed: V) -> Result<V::Value, Refusal> {
        match self.pending.take() {
            // A refusal the key's own type makes after reading it (a `fair_key` that names nothing) is the key's.
            Some((name, node)) => {
                let key = join(&self.key, name);
                seed.deserialize(NodeReader { node, key: key.clone() })
                    .map_err(|refusal| refusal.at(&key))
            }
            None => Err(de::Error::custom("a value without its key")),
        }
    }
}

struct ArrayReader<'a> {
    items: std::iter::Enumerate<std::slice::Iter<'a, Node>>,
    key: String,
}

impl<'de> SeqAccess<'de> for ArrayReader<'de> {
    type Error = Refusal;

    fn next_element_seed<T: DeserializeSeed<'de>>(&mut self, seed: T) -> Result<Option<T::Value>, Refusal> {
        for (index, node) in self.items.by_ref() {
            if matches!(node.value, Value::Refused) {
                continue;
            }
            let key = format!("{}[{index}]", self.key);
            return seed
                .deserialize(NodeReader { node, key: key.clone() })
                .map(Some)
                .map_err(|refusal| refusal.at(&key));
        }
        Ok(None)
    }
}

struct TextItems<'a, I> {
    items: std::iter::Enumerate<I>,
    key: &'a str,
}

impl<'de, I: Iterator<Item = &'de str>> SeqAccess<'de> for TextItems<'_, I> {
    type Error = Refusal;

    fn next_element_seed<T: DeserializeSeed<'de>>(&mut self, seed: T) -> Result<Option<T::Value>, Refusal> {
        match self.items.next() {
            Some((index, text)) => {
                let key = format!("{}[{index}]", self.key);
                seed.deserialize(TextReader::new(text, key.clone()))
                    .map(Some)
                    .map_err(|refusal| refusal.at(&key))
            }
            None => Ok(None),
        }
    }
}
