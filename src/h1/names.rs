//! The field names nearly every head carries, known by their spelling: a name read as one of them, in any case, is
//! that name's constant, without `HeaderName::from_bytes`'s pass over a lowercasing table and its match over every
//! name the `http` crate knows (about 90 instructions a name, six or more names a request and its answer), nor, for
//! the `x-` ones floodgate sets, its allocation. Any other name goes through `from_bytes` as before.
//!
//! It only ever names a name httparse has read: a token (RFC 9110 §5.6.2), which is what makes the comparison below
//! exact. It never judges a value.

use http::header::{self, HeaderName};

/// The fields floodgate sets on a request it sends upstream (and on its answer, the request ID), and `Keep-Alive`,
/// which it strips: named once here, where the readers know them, for the rewrite (`forward::head`) and the access
/// log too.
pub const X_REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");
pub(crate) const X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
pub(crate) const X_FORWARDED_PROTO: HeaderName = HeaderName::from_static("x-forwarded-proto");
pub(crate) const X_FORWARDED_HOST: HeaderName = HeaderName::from_static("x-forwarded-host");
pub(crate) const KEEP_ALIVE: HeaderName = HeaderName::from_static("keep-alive");

/// Bit 5 of every byte: set, it lowers an ASCII capital and leaves digits and `-` as they are.
const FOLD: u64 = 0x2020_2020_2020_2020;

/// Writes the table once: [`usual`] matches a name by its length, then its spelling, and the tests read the same
/// rows (`ROWS`), so no row goes untested.
macro_rules! usual_names {
    ($($len:literal $lower:literal => $name:expr,)*) => {
        /// `name`'s constant when it is one of the usual names, in any case; `None` says only that it is not one of
        /// them. `name` must be a token, as httparse reads one.
        pub(super) fn usual(name: &[u8]) -> Option<HeaderName> {
            let is = |lower: &str| spelled(name, lower.as_bytes());
            // By length first: one or two comparisons a name.
            let known = match name.len() {
                $($len if is($lower) => $name,)*
                _ => return None,
            };
            Some(known)
        }

        /// Each row's length (the match's key) and spelling.
        #[cfg(test)]
        const ROWS: &[(usize, &str)] = &[$(($len, $lower)),*];
    };
}

usual_names! {
    2 "te" => header::TE,
    3 "via" => header::VIA,
    3 "age" => header::AGE,
    4 "host" => header::HOST,
    4 "date" => header::DATE,
    4 "etag" => header::ETAG,
    4 "vary" => header::VARY,
    5 "range" => header::RANGE,
    6 "accept" => header::ACCEPT,
    6 "cookie" => header::COOKIE,
    6 "server" => header::SERVER,
    6 "origin" => header::ORIGIN,
    6 "expect" => header::EXPECT,
    7 "referer" => header::REFERER,
    7 "upgrade" => header::UPGRADE,
    7 "expires" => header::EXPIRES,
    8 "location" => header::LOCATION,
    10 "user-agent" => header::USER_AGENT,
    10 "connection" => header::CONNECTION,
    10 "set-cookie" => header::SET_COOKIE,
    10 "keep-alive" => KEEP_ALIVE,
    12 "content-type" => header::CONTENT_TYPE,
    12 "x-request-id" => X_REQUEST_ID,
    13 "cache-control" => header::CACHE_CONTROL,
    13 "authorization" => header::AUTHORIZATION,
    13 "last-modified" => header::LAST_MODIFIED,
    13 "accept-ranges" => header::ACCEPT_RANGES,
    13 "if-none-match" => header::IF_NONE_MATCH,
    14 "content-length" => header::CONTENT_LENGTH,
    15 "accept-encoding" => header::ACCEPT_ENCODING,
    15 "accept-language" => header::ACCEPT_LANGUAGE,
    15 "x-forwarded-for" => X_FORWARDED_FOR,
    16 "content-encoding" => header::CONTENT_ENCODING,
    16 "x-forwarded-host" => X_FORWARDED_HOST,
    17 "transfer-encoding" => header::TRANSFER_ENCODING,
    17 "x-forwarded-proto" => X_FORWARDED_PROTO,
    17 "if-modified-since" => header::IF_MODIFIED_SINCE,
}

/// Whether the token `name` is `lower` (lowercase letters, digits and `-`) in any case, eight bytes at a time. Of the
/// bytes a token may hold, bit 5 turns only a capital into another of those (`^` and `_`, which lack it too, become
/// `~` and DEL), so the comparison is exact for a token; it is not for other bytes (a CR would read as `-`).
fn spelled(name: &[u8], lower: &[u8]) -> bool {
    name.len() == lower.len()
        && name
            .chunks(8)
            .zip(lower.chunks(8))
            .all(|(name, lower)| word(name) | FOLD == word(lower) | FOLD)
}

/// Up to eight bytes as a number, zeros after them.
fn word(bytes: &[u8]) -> u64 {
    let mut word = [0u8; 8];
    for (place, byte) in word.iter_mut().zip(bytes) {
        *place = *byte;
    }
    u64::from_le_bytes(word)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn title_case(name: &str) -> String {
        let mut up = true;
        name.chars()
            .map(|c| {
                let out = if up { c.to_ascii_uppercase() } else { c };
                up = c == '-';
                out
            })
            .collect()
    }

    #[test]
    fn each_usual_name_in_any_case_is_what_from_bytes_reads() {
        for &(len, name) in ROWS {
            assert_eq!(len, name.len(), "{name}: the row's length");
            for spelling in [name.to_string(), name.to_ascii_uppercase(), title_case(name)] {
                let read = HeaderName::from_bytes(spelling.as_bytes()).expect("a valid name");
                assert_eq!(usual(spelling.as_bytes()), Some(read), "{spelling}");
            }
        }
    }

    #[test]
    fn any_token_is_either_not_usual_or_what_from_bytes_reads() {
        // The table's names with one byte changed to every token byte, and random tokens: the near misses are where
        // a folded comparison could go wrong.
        const TCHAR: &[u8] = b"!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ";
        let mut tokens: Vec<Vec<u8>> = Vec::new();
        for (_, name) in ROWS {
            for at in 0..name.len() {
                for &byte in TCHAR {
                    let mut near = name.as_bytes().to_vec();
                    near[at] = byte;
                    tokens.push(near);
                }
            }
        }
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        for _ in 0..200_000 {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            let len = 1 + (seed % 20) as usize;
            tokens.push(
                (0..len)
                    .map(|i| TCHAR[((seed >> (i * 3)) as usize + i) % TCHAR.len()])
                    .collect(),
            );
        }
        let mut found = 0;
        for token in &tokens {
            if let Some(name) = usual(token) {
                found += 1;
                assert_eq!(
                    Some(name),
                    HeaderName::from_bytes(token).ok(),
                    "{:?}",
                    String::from_utf8_lossy(token)
                );
            } else {
                let read = HeaderName::from_bytes(token).expect("a token is a valid name");
                assert!(
                    !ROWS.iter().any(|&(_, usual)| usual == read.as_str()),
                    "{:?} is usual but was not taken",
                    String::from_utf8_lossy(token)
                );
            }
        }
        // Each name at least once per byte (the byte changed to itself), and again where it is a letter in capital.
        let lengths: usize = ROWS.iter().map(|&(len, _)| len).sum();
        assert!(found > lengths, "{found} of the near misses taken, {lengths} or fewer");
    }
}
