use http::header::{self, HeaderMap, HeaderValue};
use http::{Uri, Version};

use super::head::{
    plain_host, plainly_valid, valid_authority, valid_authority_in_full, without_root_dot, KEEP_ALIVE, SET_HERE,
};
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
    // Routing reads it from the check that passes it.
    for (uri, headers) in [(&absolute, &headers), (&origin, &headers), (&origin, &HeaderMap::new())] {
        assert_eq!(check_host(uri, headers).ok(), Some(target_host(uri, headers)));
    }
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

/// The rewrite skips what a head does not carry (`Present`); these are the heads where skipping would go wrong.
#[test]
fn the_upstream_head_is_rewritten_the_same_whatever_its_fields_let_be_skipped() {
    let rewrite = |lines: &[(&str, &str)], trusted: bool| {
        let (mut parts, ()) = http::Request::new(()).into_parts();
        for (name, value) in lines {
            parts.headers.append(
                http::header::HeaderName::from_bytes(name.as_bytes()).unwrap(),
                HeaderValue::from_str(value).unwrap(),
            );
        }
        let client = ClientInfo::new("192.0.2.7:5000".parse().unwrap(), trusted, None);
        upstream_head(&mut parts, &client, &HeaderValue::from_static("up.example")).unwrap();
        parts.headers
    };
    // `Connection` may name Host: it is stripped, and the upstream still gets the one the request was for.
    let named_host = rewrite(&[("host", "app.example"), ("connection", "host")], false);
    assert_eq!(
        named_host.get_all(header::HOST).iter().collect::<Vec<_>>(),
        ["app.example"]
    );
    assert!(!named_host.contains_key(header::CONNECTION));
    // A plain Host goes on as the one line it was; a root dot is dropped.
    let plain = rewrite(&[("host", "app.example")], false);
    assert_eq!(plain.get_all(header::HOST).iter().collect::<Vec<_>>(), ["app.example"]);
    let dotted = rewrite(&[("host", "app.example.:81")], false);
    assert_eq!(
        dotted.get_all(header::HOST).iter().collect::<Vec<_>>(),
        ["app.example:81"]
    );
    // Aliases of the X- fields floodgate sets go; another name with `_` stays.
    let aliased = rewrite(
        &[
            ("host", "a"),
            ("x_forwarded_for", "6.6.6.6"),
            ("x-request_id", "forged"),
            ("my_field", "kept"),
        ],
        false,
    );
    assert!(!aliased.contains_key("x_forwarded_for") && !aliased.contains_key("x-request_id"));
    assert_eq!(aliased["my_field"], "kept");
    assert_eq!(aliased["x-forwarded-for"], "192.0.2.7");
    // A trusted hop's X-Forwarded-For is extended; an untrusted one's, and its Forwarded, replaced or dropped.
    let hop = [
        ("host", "a"),
        ("x-forwarded-for", "198.51.100.1"),
        ("forwarded", "for=1.2.3.4"),
    ];
    assert_eq!(rewrite(&hop, true)["x-forwarded-for"], "198.51.100.1, 192.0.2.7");
    assert!(rewrite(&hop, true).contains_key(header::FORWARDED));
    assert_eq!(rewrite(&hop, false)["x-forwarded-for"], "192.0.2.7");
    assert!(!rewrite(&hop, false).contains_key(header::FORWARDED));
    // Both framings: the length goes; a length alone is made canonical; Expect is ours to answer.
    let framed = rewrite(
        &[
            ("host", "a"),
            ("content-length", "5"),
            ("transfer-encoding", "chunked"),
            ("expect", "100-continue"),
        ],
        false,
    );
    assert!(!framed.contains_key(header::CONTENT_LENGTH) && !framed.contains_key(header::EXPECT));
    assert_eq!(
        rewrite(&[("host", "a"), ("content-length", "005")], false)["content-length"],
        "5"
    );
    for own in SET_HERE {
        assert!(
            own.as_str().starts_with("x-"),
            "{own}: Present::x_underscore would miss its aliases"
        );
    }
}
