//! Integer keys: an integer and nothing else (a file's `"8"`, `4.5` or `true` are refused; a variable's text is
//! read as one by [`super::read`]), out of range said in words.

use std::collections::BTreeMap;
use std::fmt;
use std::marker::PhantomData;

use serde::de::{self, Deserialize, Deserializer, Visitor};

/// An integer type a key may have, with its range for the refusal.
pub(super) trait Whole: TryFrom<i128> {
    const MIN: i128;
    const MAX: i128;
}

macro_rules! whole {
    ($($t:ty),*) => {$(
        impl Whole for $t {
            const MIN: i128 = <$t>::MIN as i128;
            const MAX: i128 = <$t>::MAX as i128;
        }
    )*};
}
whole!(u8, u16, u32, u64, usize);

struct Int<T>(T);

struct IntVisitor<T>(PhantomData<T>);

impl<T: Whole> IntVisitor<T> {
    fn fit<E: de::Error>(value: i128) -> Result<Int<T>, E> {
        match T::try_from(value) {
            Ok(value) => Ok(Int(value)),
            Err(_) if value < T::MIN => Err(E::custom("must not be negative")),
            Err(_) => Err(E::custom(format!("must be at most {}", T::MAX))),
        }
    }
}

impl<T: Whole> Visitor<'_> for IntVisitor<T> {
    type Value = Int<T>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("an integer")
    }

    fn visit_i64<E: de::Error>(self, value: i64) -> Result<Int<T>, E> {
        Self::fit(value.into())
    }

    fn visit_u64<E: de::Error>(self, value: u64) -> Result<Int<T>, E> {
        Self::fit(value.into())
    }

    fn visit_i128<E: de::Error>(self, value: i128) -> Result<Int<T>, E> {
        Self::fit(value)
    }

    fn visit_u128<E: de::Error>(self, value: u128) -> Result<Int<T>, E> {
        match i128::try_from(value) {
            Ok(value) => Self::fit(value),
            Err(_) => Self::fit(i128::MAX),
        }
    }
}

impl<'de, T: Whole> Deserialize<'de> for Int<T> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_i64(IntVisitor(PhantomData))
    }
}

pub(super) fn deserialize<'de, D: Deserializer<'de>, T: Whole>(deserializer: D) -> Result<T, D::Error> {
    Int::deserialize(deserializer).map(|Int(value)| value)
}

pub(super) fn option<'de, D: Deserializer<'de>, T: Whole>(deserializer: D) -> Result<Option<T>, D::Error> {
    Option::<Int<T>>::deserialize(deserializer).map(|value| value.map(|Int(value)| value))
}

pub(super) fn map<'de, D: Deserializer<'de>, T: Whole>(deserializer: D) -> Result<BTreeMap<String, T>, D::Error> {
    let map = BTreeMap::<String, Int<T>>::deserialize(deserializer)?;
    Ok(map.into_iter().map(|(key, Int(value))| (key, value)).collect())
}
