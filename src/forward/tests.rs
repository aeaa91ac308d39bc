use http::header::{self, HeaderMap, HeaderValue};
use http::{Uri, Version};

use super::head::{plain_host, plainly_valid, valid_authority, valid_authority_in_full, without_root_dot, KEEP_ALIVE};
use super::response::{content_length, ContentLength};
use super::*;

#[test]
fn a_plain_host_is_one_that_authority_parsing_accepts_too() {
    for host in [
        "app.example",
        "app.example:8080",
        "a-b.c",
        "10.0.0.1:1",
        "x:65535",
        "x:0",
    ] {
        assert!(plain_host(host.as_bytes()), "{host}");
        assert!(http::uri::Authority::try_from(host.as_bytes()).is_ok(), "{host}");
    }
    for host in ["", "a:b:c", "host:", ":80", "[::1]:80", "a_b", "h\u{e9}", "a@b"] {
        assert!(!plain_host(host.as_bytes()), "{host}");
    }
}

#[test]
fn the_one_pass_host_check_takes_only_what_the_full_one_takes_and_every_usual_host() {
    for host in [
        "localhost",
        "127.0.0.1:8080",
        "app.example.",
        "a-b.c:65535",
        "x:0",
        "x:00080",
        "app.example.:1",
    ] {
        assert!(plainly_valid(host.as_bytes()), "{host}");
    }
    for host in ["x:65536", "x:", "a..b", ".", "", "[::1]", "a@b:1", "a:1:2", "a_b"] {
        assert!(!plainly_valid(host.as_bytes()), "{host}");
    }
    // Every string of up to six bytes over the bytes that matter: where the one pass says valid, so do the rules.
    const ALPHABET: &[u8] = b"a9.-:@[]";
    for len in 0..=6u32 {
        for mut n in 0..(ALPHABET.len() as u32).pow(len) {
            let host: Vec<u8> = (0..len)
                .map(|_| {
                    let byte = ALPHABET[(n % ALPHABET.len() as u32) as usize];
                    n /= ALPHABET.len() as u32;
                    byte
                })
                .collect();
            assert!(
                !plainly_valid(&host) || valid_authority_in_full(&host),
                "{:?}",
                String::from_utf8_lossy(&host)
            );
        }
    }
}

#[test]
fn a_target_host_has_a_16_bit_port_and_no_empty_label_but_the_root() {
    for host in [
        "app.example",
        "app.example.",
        "app.example.:8080",
        "x:65535",
        "x:0",
        "x:",
        "[::1]",
        "[::1]:443",
        "a!b",
    ] {
        assert!(valid_authority(host.as_bytes()), "{host}");
    }
    for host in [
        "",
        "host:99999999",
        "x:65536",
        "x:+80",
        "x:8o",
        "[::1]:70000",
        "[::1].",
        ".",
        ".:80",
        ":80",
        "a..b",
        ".a",
        "a..",
        "user@a",
        "a b",
    ] {
        assert!(!valid_authority(host.as_bytes()), "{host}");
    }
}

#[test]
fn the_root_dot_is_dropped_from_the_name_and_the_port_kept() {
    let dropped = |host: &str| without_root_dot(host.as_bytes()).map(|h| String::from_utf8_lossy(&h).into_owned());
    assert_eq!(dropped("a.example.").as_deref(), Some("a.example"));
    assert_eq!(dropped("A.Example.:8080").as_deref(), Some("A.Example:8080"));
    assert_eq!(dropped("a.example"), None);
    assert_eq!(dropped("a.example:80"), None);
    assert_eq!(dropped("[::1]:80"), None);
    assert_eq!(dropped("."), None);
}

#[test]
fn hop_by_hop_headers_and_the_ones_connection_names_are_removed() {
    let mut headers = HeaderMap::new();
    headers.insert(header::CONNECTION, HeaderValue::from_static("keep-alive, X-Secret"));
    headers.insert("x-secret", HeaderValue::from_static("1"));
    headers.insert(KEEP_ALIVE, HeaderValue::from_static("timeout=5"));
    headers.insert(header::TE, HeaderValue::from_static("trailers"));
    headers.insert("x-kept", HeaderValue::from_static("1"));
    strip_hop_by_hop(&mut headers);
    assert_eq!(headers.len(), 1, "{headers:?}");
    assert!(headers.contains_key("x-kept"));
}

#[test]
fn the_uri_authority_wins_over_host_and_host_is_the_fallback() {
    let mut headers = HeaderMap::new();
    headers.insert(header::HOST, HeaderValue::from_static("spoofed.example"));
    let absolute: Uri = "http://real.example:8080/x".parse().unwrap();
    assert_eq!(target_host(&absolute, &headers), Some("real.example:8080"));
    let origin: Uri = "/x".parse().unwrap();
    assert_eq!(target_host(&origin, &headers), Some("spoofed.example"));
    assert_eq!(target_host(&origin, &HeaderMap::new()), None);
}

#[test]
fn a_content_length_is_one_number_however_often_it_is_given() {
    let length = |lines: &[&'static str]| {
        let mut headers = HeaderMap::new();
        for line in lines {
            headers.append(header::CONTENT_LENGTH, HeaderValue::from_static(line));
        }
        match content_length(&headers) {
            ContentLength::Plain => Some(None),
            ContentLength::Repeated(length) => Some(Some(length)),
            ContentLength::Invalid => None,
        }
    };
    assert_eq!(length(&[]), Some(None));
    assert_eq!(length(&["42"]), Some(None));
    assert_eq!(length(&["42, 42"]), Some(Some(42)));
    assert_eq!(length(&["42", "42"]), Some(Some(42)));
    assert_eq!(length(&["18446744073709551615"]), Some(Some(u64::MAX)));
    for invalid in [
        &["3", "5"][..],
        &["3, 5"],
        &["abc"],
        &["+3"],
        &[""],
        &["3,"],
        &["18446744073709551616"],
    ] {
        assert_eq!(length(invalid), None, "{invalid:?}");
    }
}

#[test]
fn keep_alive_follows_version_and_connection_header() {
    let mut headers = HeaderMap::new();
    assert!(keeps_alive(Version::HTTP_11, &headers));
    assert!(!keeps_alive(Version::HTTP_10, &headers));
    headers.insert(header::CONNECTION, HeaderValue::from_static("Close"));
    assert!(!keeps_alive(Version::HTTP_11, &headers));
    headers.insert(header::CONNECTION, HeaderValue::from_static("keep-alive"));
    assert!(keeps_alive(Version::HTTP_10, &headers));
}

#[test]
fn an_answer_is_small_to_move_between_the_exchange_and_the_clients_task() {
    // It crosses a channel and several futures per request: the relay behind its body is boxed, not inline
    // (640 bytes when it was, docs/data-path.md).
    assert!(std::mem::size_of::<http::Response<ResponseBody>>() <= 192);
}
