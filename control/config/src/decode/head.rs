//! The identity of a document — `apiVersion`, `kind`, `metadata.name`,
//! `metadata.namespace` — read through serde from any format (YAML text,
//! JSON bytes, a JSON value) without building the rest of the document.

use std::fmt;

use serde::de::{self, Deserialize, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};

/// One identity field as found.
#[derive(Debug, Clone, PartialEq, Default)]
pub(super) enum Field {
    /// Absent or null.
    #[default]
    Missing,
    Str(String),
    /// Present but not a string.
    NotAString,
}

/// What a document is, as far as its identity goes.
#[derive(Debug, Clone, PartialEq)]
pub(super) enum Head {
    /// An empty (null) document.
    Empty,
    /// Not a mapping: what it is instead ("a list", ...).
    NotAnObject(&'static str),
    Object {
        api_version: Field,
        kind: Field,
        name: Field,
        namespace: Field,
    },
}

/// Consumes a sequence or a mapping without keeping it.
fn drain_seq<'de, A: SeqAccess<'de>>(mut seq: A) -> Result<(), A::Error> {
    while seq.next_element::<IgnoredAny>()?.is_some() {}
    Ok(())
}

fn drain_map<'de, A: MapAccess<'de>>(mut map: A) -> Result<(), A::Error> {
    while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
    Ok(())
}

/// Implements the scalar, sequence and mapping callbacks of a visitor whose
/// every non-string value maps to one constant.
macro_rules! non_string {
    ($value:expr) => {
        fn visit_bool<E: de::Error>(self, _: bool) -> Result<Self::Value, E> {
            Ok($value)
        }
        fn visit_i64<E: de::Error>(self, _: i64) -> Result<Self::Value, E> {
            Ok($value)
        }
        fn visit_u64<E: de::Error>(self, _: u64) -> Result<Self::Value, E> {
            Ok($value)
        }
        fn visit_f64<E: de::Error>(self, _: f64) -> Result<Self::Value, E> {
            Ok($value)
        }
        fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<Self::Value, A::Error> {
            drain_seq(seq)?;
            Ok($value)
        }
    };
}

impl<'de> Deserialize<'de> for Field {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Field;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a string")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Field, E> {
                Ok(Field::Str(v.to_string()))
            }
            fn visit_string<E: de::Error>(self, v: String) -> Result<Field, E> {
                Ok(Field::Str(v))
            }
            fn visit_unit<E: de::Error>(self) -> Result<Field, E> {
                Ok(Field::Missing)
            }
            fn visit_none<E: de::Error>(self) -> Result<Field, E> {
                Ok(Field::Missing)
            }
            fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Field, D::Error> {
                Field::deserialize(d)
            }
            fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Field, A::Error> {
                drain_map(map)?;
                Ok(Field::NotAString)
            }
            non_string!(Field::NotAString);
        }
        d.deserialize_any(V)
    }
}

/// A key of the top-level mapping or of `metadata`.
enum Key {
    Named(String),
    Other,
}

impl<'de> Deserialize<'de> for Key {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Key;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a mapping key")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Key, E> {
                Ok(Key::Named(v.to_string()))
            }
            fn visit_unit<E: de::Error>(self) -> Result<Key, E> {
                Ok(Key::Other)
            }
            fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Key, A::Error> {
                drain_map(map)?;
                Ok(Key::Other)
            }
            non_string!(Key::Other);
        }
        d.deserialize_any(V)
    }
}

/// `metadata`: its name and namespace; anything but a mapping has neither.
struct Meta {
    name: Field,
    namespace: Field,
}

impl<'de> Deserialize<'de> for Meta {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        const NONE: Meta = Meta {
            name: Field::Missing,
            namespace: Field::Missing,
        };
        impl<'de> Visitor<'de> for V {
            type Value = Meta;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a mapping")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Meta, A::Error> {
                let mut meta = NONE;
                while let Some(key) = map.next_key::<Key>()? {
                    match key {
                        Key::Named(k) if k == "name" => meta.name = map.next_value()?,
                        Key::Named(k) if k == "namespace" => meta.namespace = map.next_value()?,
                        _ => {
                            map.next_value::<IgnoredAny>()?;
                        }
                    }
                }
                Ok(meta)
            }
            fn visit_str<E: de::Error>(self, _: &str) -> Result<Meta, E> {
                Ok(NONE)
            }
            fn visit_unit<E: de::Error>(self) -> Result<Meta, E> {
                Ok(NONE)
            }
            fn visit_none<E: de::Error>(self) -> Result<Meta, E> {
                Ok(NONE)
            }
            fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Meta, D::Error> {
                Meta::deserialize(d)
            }
            non_string!(NONE);
        }
        d.deserialize_any(V)
    }
}

impl<'de> Deserialize<'de> for Head {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Head;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a Kubernetes object")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Head, A::Error> {
                let (mut api_version, mut kind) = (Field::Missing, Field::Missing);
                let mut meta = Meta {
                    name: Field::Missing,
                    namespace: Field::Missing,
                };
                while let Some(key) = map.next_key::<Key>()? {
                    match key {
                        Key::Named(k) if k == "apiVersion" => api_version = map.next_value()?,
                        Key::Named(k) if k == "kind" => kind = map.next_value()?,
                        Key::Named(k) if k == "metadata" => meta = map.next_value()?,
                        _ => {
                            map.next_value::<IgnoredAny>()?;
                        }
                    }
                }
                Ok(Head::Object {
                    api_version,
                    kind,
                    name: meta.name,
                    namespace: meta.namespace,
                })
            }
            fn visit_unit<E: de::Error>(self) -> Result<Head, E> {
                Ok(Head::Empty)
            }
            fn visit_none<E: de::Error>(self) -> Result<Head, E> {
                Ok(Head::Empty)
            }
            fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Head, D::Error> {
                Head::deserialize(d)
            }
            fn visit_str<E: de::Error>(self, _: &str) -> Result<Head, E> {
                Ok(Head::NotAnObject("a string"))
            }
            fn visit_bool<E: de::Error>(self, _: bool) -> Result<Head, E> {
                Ok(Head::NotAnObject("a boolean"))
            }
            fn visit_i64<E: de::Error>(self, _: i64) -> Result<Head, E> {
                Ok(Head::NotAnObject("a number"))
            }
            fn visit_u64<E: de::Error>(self, _: u64) -> Result<Head, E> {
                Ok(Head::NotAnObject("a number"))
            }
            fn visit_f64<E: de::Error>(self, _: f64) -> Result<Head, E> {
                Ok(Head::NotAnObject("a number"))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<Head, A::Error> {
                drain_seq(seq)?;
                Ok(Head::NotAnObject("a list"))
            }
        }
        d.deserialize_any(V)
    }
}
