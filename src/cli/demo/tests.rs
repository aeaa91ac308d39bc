use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;

use super::load::percentile;
use super::upstream::{read_request_head, HeadError, RequestHead};
use super::*;

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

#[test]
fn percentile_is_nearest_rank() {
    let sorted: Vec<Duration> = (1..=100).map(ms).collect();
    assert_eq!(percentile(&sorted, 50), Some(ms(50)));
    assert_eq!(percentile(&sorted, 99), Some(ms(99)));
    assert_eq!(percentile(&sorted, 100), Some(ms(100)));
    assert_eq!(percentile(&sorted, 0), Some(ms(1)));

    let few = [ms(10), ms(20), ms(30)];
    assert_eq!(percentile(&few, 50), Some(ms(20)));
    assert_eq!(percentile(&few, 99), Some(ms(30)));
    assert_eq!(percentile(&[ms(7)], 99), Some(ms(7)));
    assert_eq!(percentile(&[], 50), None);
}

fn get(mut stream: &TcpStream) -> anyhow::Result<String> {
    stream.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")?;
    let mut reader = BufReader::new(stream.try_clone()?);
    let mut head = String::new();
    let mut content_length = 0usize;
    loop {
        let mut line = String::new();
        reader.read_line(&mut line)?;
        if let Some(v) = line.to_ascii_lowercase().strip_prefix("content-length:") {
            content_length = v.trim().parse()?;
        }
        head.push_str(&line);
        if line == "\r\n" || line.is_empty() {
            break;
        }
    }
    let mut body = vec![0; content_length];
    reader.read_exact(&mut body)?;
    Ok(format!("{head}{}", String::from_utf8(body)?))
}

#[test]
fn upstream_spends_one_thread_per_connection() -> anyhow::Result<()> {
    let upstream = Upstream::start(ms(1))?;
    let a = TcpStream::connect(upstream.addr())?;
    let b = TcpStream::connect(upstream.addr())?;
    // Two requests on one keep-alive connection must not cost a thread more.
    for stream in [&a, &b, &a] {
        let response = get(stream)?;
        assert!(response.starts_with("HTTP/1.1 200 OK\r\n"), "{response}");
        assert!(response.ends_with("upstream\n"), "{response}");
    }
    let stats = upstream.stats();
    assert_eq!(stats.peak_threads, 2);
    assert_eq!(stats.peak_connections, 2);
    assert_eq!(stats.connections_accepted, 2);
    assert_eq!(stats.requests_served, 3);

    // Keep `a` open: shutdown must still end its thread.
    drop(b);
    let stats = upstream.shutdown(Duration::from_secs(5));
    assert_eq!(stats.live_threads, 0);
    drop(a);
    Ok(())
}

#[test]
fn head_parser_frames_requests() {
    let mut input: &[u8] = b"\r\nPOST /x HTTP/1.1\r\nHost: a\r\nContent-Length: 3\r\nConnection: close\r\n\r\nabc";
    let head = read_request_head(&mut input);
    assert!(matches!(
        head,
        Ok(Some(RequestHead {
            is_head: false,
            content_length: 3,
            keep_alive: false
        }))
    ));
    assert_eq!(input, b"abc");

    let mut empty: &[u8] = b"";
    assert!(matches!(read_request_head(&mut empty), Ok(None)));

    let mut chunked: &[u8] = b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n";
    assert!(matches!(
        read_request_head(&mut chunked),
        Err(HeadError::Unsupported(_))
    ));

    let huge = format!("GET / HTTP/1.1\r\nX: {}\r\n\r\n", "a".repeat(70_000));
    assert!(matches!(
        read_request_head(&mut huge.as_bytes()),
        Err(HeadError::TooLarge)
    ));
}
