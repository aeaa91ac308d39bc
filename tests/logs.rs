//! Logging through the real binary: `--log-format json` (or `log_format` from the environment) writes one JSON
//! object per line, `log_level` picks the lines, `RUST_LOG` wins over it, and a bad filter stops start-up with
//! one line naming the key.

mod support;

use std::time::Duration;

use http::StatusCode;
use support::*;

/// Stops the proxy cleanly so that its last lines are written, then returns everything it wrote to stderr.
async fn stopped_output(mut proxy: Proxy) -> String {
    proxy.sigterm();
    assert!(
        proxy.wait_exit(Duration::from_secs(10)).await.is_some(),
        "floodgate did not exit on SIGTERM"
    );
    // The reader threads may still be collecting the last words.
    proxy.wait_output_closed(Duration::from_secs(5)).await;
    let output = proxy.output();
    assert!(output.contains("floodgate stopped"), "no stop line:\n{output}");
    output
}

fn stderr_lines(output: &str) -> Vec<&str> {
    output
        .lines()
        .filter(|line| !line.trim().is_empty() && !line.starts_with("[stdout]"))
        .collect()
}

/// floodgate with `args`, its log in JSON and its access log on stdout.
async fn with_json_access_log(args: &[&str]) -> Proxy {
    let mut args = args.to_vec();
    args.extend(["--log-format", "json"]);
    Proxy::start_with_env(&args, &[("FLOODGATE__ACCESS_LOG", "stdout")]).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn json_log_format_writes_one_parseable_object_per_line() {
    let upstream = Upstream::start().await;
    // An empty RUST_LOG is ignored, so the configured level (info) applies whatever the test runner has set.
    let proxy = Proxy::start_with_env(
        &["--upstream", &upstream.url(), "--log-format", "json"],
        &[("RUST_LOG", "")],
    )
    .await;
    assert_eq!(get(proxy.listen, "/hello").await.status, StatusCode::OK);
    let output = stopped_output(proxy).await;

    let lines = stderr_lines(&output);
    assert!(lines.len() >= 3, "too few log lines:\n{output}");
    let mut started = None;
    for line in lines {
        let value: serde_json::Value =
            serde_json::from_str(line).unwrap_or_else(|e| panic!("not JSON ({e}): {line}\nall output:\n{output}"));
        assert!(value["timestamp"].is_string(), "no timestamp: {line}");
        assert!(value["level"].is_string(), "no level: {line}");
        if value["message"] == "floodgate started" {
            started = Some(value);
        }
    }
    let started = started.unwrap_or_else(|| panic!("no start line:\n{output}"));
    assert_eq!(started["level"], "INFO");
    // Fields sit beside the message, not under a nested object.
    assert!(
        started["listen"].as_str().is_some_and(|l| l.starts_with("127.0.0.1:")),
        "{started}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_format_and_level_come_from_the_environment_and_rust_log_wins_over_the_level() {
    let upstream = Upstream::start().await;
    let url = upstream.url();
    let args = ["--upstream", url.as_str()];

    // log_level = warn: the info lines are gone; the format is JSON from the variable alone.
    let quiet = Proxy::start_with_env(
        &args,
        &[
            ("FLOODGATE__LOG_FORMAT", "json"),
            ("FLOODGATE__LOG_LEVEL", "warn"),
            ("RUST_LOG", ""),
        ],
    )
    .await;
    quiet.sigterm();
    let mut quiet = quiet;
    assert!(quiet.wait_exit(Duration::from_secs(10)).await.is_some());
    quiet.wait_output_closed(Duration::from_secs(5)).await;
    let output = quiet.output();
    assert!(
        !output.contains("floodgate started"),
        "info line at log_level = warn:\n{output}"
    );
    for line in stderr_lines(&output) {
        serde_json::from_str::<serde_json::Value>(line).unwrap_or_else(|e| panic!("not JSON ({e}): {line}"));
    }

    // RUST_LOG set: it replaces log_level; the human format is the default.
    let loud = Proxy::start_with_env(&args, &[("FLOODGATE__LOG_LEVEL", "warn"), ("RUST_LOG", "info")]).await;
    let output = stopped_output(loud).await;
    let started = output
        .lines()
        .find(|line| line.contains("floodgate started"))
        .unwrap_or_else(|| panic!("RUST_LOG=info did not win over log_level = warn:\n{output}"));
    assert!(started.contains("INFO"), "{started}");
    assert!(
        serde_json::from_str::<serde_json::Value>(started).is_err(),
        "human format expected: {started}"
    );
}

/// A proxy that would serve nothing (port 9 upstream, ephemeral listeners): for runs that must stop at start-up.
const NOWHERE_ARGS: [&str; 6] = [
    "--upstream",
    "127.0.0.1:9",
    "--listen",
    "127.0.0.1:0",
    "--admin",
    "127.0.0.1:0",
];

#[test]
fn a_bad_log_level_or_format_stops_start_up_with_one_line_naming_the_key() {
    for (env, key) in [
        (("FLOODGATE__LOG_LEVEL", "info,floodgate=loud"), "log_level"),
        (("FLOODGATE__LOG_FORMAT", "xml"), "log_format"),
    ] {
        let (status, stdout, stderr) = run_to_exit_with_env(&NOWHERE_ARGS, &[env], Duration::from_secs(10));
        assert_eq!(status.code(), Some(2), "{env:?}: stdout {stdout}\nstderr {stderr}");
        let lines: Vec<&str> = stderr.lines().filter(|l| !l.trim().is_empty()).collect();
        assert_eq!(lines.len(), 1, "{env:?}: {stderr}");
        assert!(lines[0].contains(key), "{env:?}: {stderr}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_access_log_has_a_line_for_a_served_and_for_a_shed_request() {
    let upstream = Upstream::start().await;
    let url = upstream.url();
    let proxy = with_json_access_log(&["--upstream", &url, "--max-connections", "1", "--max-queue", "0"]).await;

    let mut conn = H1Conn::connect(proxy.listen).await;
    let request = http::Request::get("/hello?q=a%20b&page=2")
        .header("user-agent", "access-test/1.0")
        .header("host", "app.example:8443")
        .body(body_empty())
        .unwrap();
    let served = collect(conn.send(request).await.unwrap()).await.unwrap();
    assert_eq!(served.status, StatusCode::OK);
    let lines = proxy.access_lines(1).await;
    let line = &lines[0];
    assert_eq!(line["target"], "floodgate::access", "{line}");
    assert!(line["timestamp"].is_string(), "{line}");
    // OpenTelemetry's semantic-convention names.
    assert_eq!(line["client.address"], "127.0.0.1", "{line}");
    assert!(line["client.port"].as_u64().is_some_and(|port| port > 0), "{line}");
    assert_eq!(line["http.request.method"], "GET", "{line}");
    assert_eq!(line["url.path"], "/hello", "{line}");
    assert_eq!(line["url.query"], "q=a%20b&page=2", "{line}");
    assert_eq!(line["server.address"], "app.example", "the host alone: {line}");
    assert_eq!(line["server.port"], 8443, "{line}");
    assert_eq!(line["url.scheme"], "http", "{line}");
    assert_eq!(line["http.route"], "*", "the route's label, as the traces': {line}");
    assert!(line.get("trace_id").is_none(), "no trace without otlp_endpoint: {line}");
    assert_eq!(line["user_agent.original"], "access-test/1.0", "{line}");
    assert_eq!(line["network.protocol.version"], "1.1", "{line}");
    assert!(
        line["http.request.header.x-request-id"]
            .as_str()
            .is_some_and(|id| !id.is_empty()),
        "{line}"
    );
    assert_eq!(line["http.response.status_code"], 200, "{line}");
    assert_eq!(line["floodgate.upstream"], "default", "{line}");
    assert_eq!(line["floodgate.outcome"], "ok", "{line}");
    assert_eq!(line["http.response.body.size"], served.body.len() as u64, "{line}");
    assert_eq!(line["http.request.body.size"], 0, "a GET without a body: {line}");
    let micros = |key: &str| line[key].as_u64().unwrap_or_else(|| panic!("{key} missing: {line}"));
    assert!(
        micros("floodgate.request.duration_us")
            >= micros("floodgate.upstream.duration_us") + micros("floodgate.queue.duration_us"),
        "{line}"
    );
    assert!(line.get("floodgate.tunnel.closed_by").is_none(), "{line}");

    // The only slot held, no queue: the next request is shed, and its line says why.
    let addr = proxy.listen;
    let stalled = tokio::spawn(async move { get(addr, "/stall").await });
    wait_until_sync("the only slot is taken", Duration::from_secs(5), || {
        upstream.inflight() == 1
    })
    .await;
    let shed = get(proxy.listen, "/shed-me").await;
    assert_eq!(shed.status, StatusCode::SERVICE_UNAVAILABLE);
    let lines = proxy.access_lines(2).await;
    let line = &lines[1];
    assert_eq!(line["url.path"], "/shed-me", "{line}");
    assert!(line.get("url.query").is_none(), "{line}");
    assert_eq!(line["http.response.status_code"], 503, "{line}");
    assert_eq!(line["floodgate.upstream"], "default", "{line}");
    assert_eq!(line["floodgate.outcome"], "shed_queue_full", "{line}");
    assert_eq!(line["http.response.body.size"], shed.body.len() as u64, "{line}");
    assert_eq!(line["floodgate.upstream.duration_us"], 0, "never admitted: {line}");

    upstream.release_stalled();
    assert_eq!(stalled.await.unwrap().status, StatusCode::OK);
    let lines = proxy.access_lines(3).await;
    assert_eq!(lines[2]["url.path"], "/stall", "{}", lines[2]);
    assert_eq!(lines[2]["floodgate.outcome"], "ok", "{}", lines[2]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_access_line_counts_the_request_body_handed_upstream_buffered_or_streamed() {
    let upstream = Upstream::start().await;
    let proxy = with_json_access_log(&["--upstream", &upstream.url(), "--buffer-request-bytes", "1024"]).await;
    let mut conn = H1Conn::connect(proxy.listen).await;
    // One read whole before admission, one larger than the buffer that streams; the upstream reads each to its end
    // before it answers (`/echo`), so the whole body was handed on by the time the line is written.
    for (path, len) in [("/echo/small", 300u64), ("/echo/large", 200_000u64)] {
        let served = conn
            .try_request(http::Method::POST, path, body_pattern(len))
            .await
            .unwrap();
        assert_eq!(served.status, StatusCode::OK, "{}", served.text());
        assert_eq!(served.text(), len.to_string(), "the upstream read it all");
    }
    let lines = proxy.access_lines(2).await;
    for (line, (path, len)) in lines.iter().zip([("/echo/small", 300u64), ("/echo/large", 200_000u64)]) {
        assert_eq!(line["url.path"], path, "{line}");
        assert_eq!(line["http.request.body.size"], len, "{line}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_human_access_log_goes_to_a_file_one_readable_line_per_request() {
    let upstream = Upstream::start().await;
    let dir = std::env::temp_dir().join(format!("floodgate-access-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("access.log");
    let _ = std::fs::remove_file(&path);
    let config = TempConfig::new(&format!("access_log = {:?}\n", path.display().to_string()));
    let url = upstream.url();
    let proxy = Proxy::start(&["--config", &config.path_str(), "--upstream", &url]).await;

    assert_eq!(get(proxy.listen, "/one").await.status, StatusCode::OK);
    assert_eq!(get(proxy.listen, "/two").await.status, StatusCode::OK);
    let read = || std::fs::read_to_string(&path).unwrap_or_default();
    wait_until_sync("two access lines", Duration::from_secs(5), || {
        read().lines().count() >= 2
    })
    .await;
    let text = read();
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 2, "{text}");
    for (line, path) in lines.iter().zip(["/one", "/two"]) {
        for field in [
            "floodgate::access:",
            "client.address=127.0.0.1",
            "http.request.method=GET",
            &format!("url.path={path}"),
            "http.response.status_code=200",
            "floodgate.upstream=\"default\"",
            "floodgate.queue.duration_us=",
            "floodgate.upstream.duration_us=",
            "floodgate.request.duration_us=",
            "http.response.body.size=",
            "floodgate.outcome=\"ok\"",
        ] {
            assert!(line.contains(field), "{field} missing from {line}");
        }
    }
    // Not also in the ordinary log.
    assert!(!proxy.output().contains("floodgate::access"), "{}", proxy.output());
    drop(proxy);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn an_access_log_that_cannot_be_opened_stops_start_up_with_one_line_naming_the_key() {
    let (status, stdout, stderr) = run_to_exit_with_env(
        &NOWHERE_ARGS,
        &[("FLOODGATE__ACCESS_LOG", "/nonexistent-floodgate-dir/access.log")],
        Duration::from_secs(10),
    );
    assert_eq!(status.code(), Some(2), "stdout {stdout}\nstderr {stderr}");
    assert!(stdout.is_empty(), "{stdout}");
    let lines: Vec<&str> = stderr.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), 1, "{stderr}");
    assert!(
        lines[0].contains("access_log") && lines[0].contains("/nonexistent-floodgate-dir/access.log"),
        "{stderr}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_access_log_is_off_by_default() {
    let upstream = Upstream::start().await;
    // Even with floodgate's own lines at debug, no access line appears anywhere.
    let proxy = Proxy::start_with_env(&["--upstream", &upstream.url()], &[("RUST_LOG", "floodgate=debug")]).await;
    for _ in 0..3 {
        assert_eq!(get(proxy.listen, "/quiet").await.status, StatusCode::OK);
    }
    let output = stopped_output(proxy).await;
    assert!(!output.contains("floodgate::access"), "{output}");
    assert!(!output.contains("/quiet"), "{output}");
    assert!(!output.contains("[stdout]"), "{output}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_combined_access_log_is_what_web_log_tools_read_and_the_ready_line_stays_off_its_stdout() {
    let upstream = Upstream::start().await;
    let proxy = Proxy::start_with_env(
        &["--upstream", &upstream.url()],
        &[
            ("FLOODGATE__ACCESS_LOG", "stdout"),
            ("FLOODGATE__ACCESS_LOG_FORMAT", "combined"),
        ],
    )
    .await;
    let mut conn = H1Conn::connect(proxy.listen).await;
    let request = http::Request::get("/page?q=1")
        .header("user-agent", "Mozilla/5.0 (X11) \"quoted\"")
        .header("referer", "https://example.com/from")
        .body(body_empty())
        .unwrap();
    let served = collect(conn.send(request).await.unwrap()).await.unwrap();
    assert_eq!(served.status, StatusCode::OK);
    let read = || -> Vec<String> {
        proxy
            .output()
            .lines()
            .filter_map(|line| line.strip_prefix("[stdout] "))
            .map(str::to_string)
            .collect()
    };
    wait_until_sync("the access line", Duration::from_secs(5), || !read().is_empty()).await;
    // stdout carries the access log alone (the ready line went to stderr), one line per request.
    let stdout = read();
    assert_eq!(stdout.len(), 1, "{stdout:?}");
    let line = &stdout[0];
    // host ident user [time] "request line" status bytes "referer" "user agent"
    let (head, rest) = line.split_once(" [").expect("a [time]");
    assert_eq!(head, "127.0.0.1 - -", "{line}");
    let (time, rest) = rest.split_once("] ").expect("the time's end");
    assert_eq!(time.len(), "10/Oct/2000:13:55:36 +0000".len(), "{time}");
    assert!(
        time.ends_with(" +0000") && time.as_bytes()[2] == b'/' && time.as_bytes()[6] == b'/',
        "{time}"
    );
    let expected = format!(
        "\"GET /page?q=1 HTTP/1.1\" 200 {} \"https://example.com/from\" \"Mozilla/5.0 (X11) \\\"quoted\\\"\"",
        served.body.len()
    );
    assert_eq!(rest, expected, "{line}");
}

/// One record per request: whether it is served, refused before it has a route, or left behind by its client at
/// the upstream or in the queue, it ends in exactly one access-log line and one count.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_request_ends_in_one_line_and_one_count_served_refused_or_left_by_its_client() {
    use tokio::io::AsyncWriteExt;
    let upstream = Upstream::start().await;
    let url = upstream.url();
    let proxy = with_json_access_log(&["--upstream", &url, "--max-connections", "1", "--max-queue", "4"]).await;
    let send = |head: &'static str| async move {
        let mut client = tokio::net::TcpStream::connect(proxy.listen).await.unwrap();
        client.write_all(head.as_bytes()).await.unwrap();
        client
    };

    // At the upstream, then its client leaves: the exchange goes on there, holding the only slot.
    let at_upstream = send("GET /stall HTTP/1.1\r\nHost: app\r\n\r\n").await;
    wait_until_sync("the only slot is taken", Duration::from_secs(5), || {
        upstream.inflight() == 1
    })
    .await;
    drop(at_upstream);
    let lines = proxy.access_lines(1).await;
    assert_eq!(lines[0]["url.path"], "/stall", "{}", lines[0]);
    assert_eq!(lines[0]["floodgate.outcome"], "client_abort", "{}", lines[0]);

    // Queued behind it, then its client leaves.
    let queued = send("GET /queued HTTP/1.1\r\nHost: app\r\n\r\n").await;
    proxy
        .wait_until_field("default", "queue_depth", 1, Duration::from_secs(5))
        .await;
    drop(queued);
    proxy
        .wait_until_field("default", "queue_depth", 0, Duration::from_secs(5))
        .await;
    let lines = proxy.access_lines(2).await;
    assert_eq!(lines[1]["url.path"], "/queued", "{}", lines[1]);
    assert_eq!(lines[1]["floodgate.outcome"], "client_abort", "{}", lines[1]);
    assert_eq!(
        lines[1]["floodgate.upstream.duration_us"], 0,
        "never admitted: {}",
        lines[1]
    );

    // Refused before it has a route: counted on the client side, its line without an upstream.
    let mut refused = send("CONNECT example.com:443 HTTP/1.1\r\nHost: example.com:443\r\n\r\n").await;
    let _ = tokio::io::AsyncReadExt::read(&mut refused, &mut [0u8; 512]).await;
    let lines = proxy.access_lines(3).await;
    assert_eq!(lines[2]["http.request.method"], "CONNECT", "{}", lines[2]);
    assert_eq!(lines[2]["floodgate.outcome"], "not_implemented", "{}", lines[2]);
    assert_eq!(lines[2]["floodgate.upstream"], "-", "{}", lines[2]);

    // The upstream finishes the abandoned exchange; its slot serves the next request.
    upstream.release_stalled();
    assert_eq!(get(proxy.listen, "/hello").await.status, StatusCode::OK);
    assert_eq!(proxy.outcome_count("default", "client_abort").await, 2.0);
    assert_eq!(proxy.outcome_count("default", "ok").await, 1.0);

    // Stopped, every line is written: one per request, no more.
    let output = stopped_output(proxy).await;
    let access: Vec<serde_json::Value> = output
        .lines()
        .filter_map(|line| line.strip_prefix("[stdout] "))
        .filter_map(|line| serde_json::from_str(line).ok())
        .collect();
    let ends: Vec<(&str, &str)> = access
        .iter()
        .map(|line| {
            let path = line["url.path"].as_str().unwrap_or("");
            (path, line["floodgate.outcome"].as_str().unwrap_or(""))
        })
        .collect();
    assert_eq!(
        ends,
        vec![
            ("/stall", "client_abort"),
            ("/queued", "client_abort"),
            (ends[2].0, "not_implemented"),
            ("/hello", "ok")
        ],
        "{output}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_access_log_writes_the_fields_chosen_and_captures_headers_bounded_and_redacted() {
    let upstream = Upstream::start().await;
    let config = TempConfig::new(&format!(
        r#"access_log = "stdout"
log_format = "json"
access_log_fields = ["http.request.method", "url.path", "http.response.status_code"]
access_log_request_headers = ["x-api-key", "authorization", "cookie", "x-absent"]
access_log_response_headers = ["content-length"]
access_log_header_bytes = 8
access_log_unredacted = ["cookie"]

[upstreams.default]
url = "{}"

[[routes]]
upstream = "default"
"#,
        upstream.url()
    ));
    let proxy = Proxy::start(&["--config", &config.path_str()]).await;
    let mut conn = H1Conn::connect(proxy.listen).await;
    let request = http::Request::get("/bytes/5")
        .header("x-api-key", "key-0123456789")
        .header("authorization", "Bearer secret-token")
        .header("cookie", "session=abc")
        .body(body_empty())
        .unwrap();
    let served = collect(conn.send(request).await.unwrap()).await.unwrap();
    assert_eq!(served.status, StatusCode::OK);
    let lines = proxy.access_lines(1).await;
    let line = lines[0].as_object().unwrap();
    let mut keys: Vec<&str> = line.keys().map(String::as_str).collect();
    keys.sort_unstable();
    assert_eq!(
        keys,
        [
            "http.request.header.authorization",
            "http.request.header.cookie",
            "http.request.header.x-api-key",
            "http.request.method",
            "http.response.header.content-length",
            "http.response.status_code",
            "level",
            "message",
            "target",
            "timestamp",
            "url.path",
        ],
        "only the chosen fields and the headers that came: {line:?}"
    );
    assert_eq!(line["http.request.method"], "GET");
    assert_eq!(line["url.path"], "/bytes/5");
    assert_eq!(line["http.response.status_code"], 200);
    // Cut to access_log_header_bytes; a credential redacted unless named in access_log_unredacted.
    assert_eq!(line["http.request.header.x-api-key"], "key-0123…");
    assert_eq!(line["http.request.header.authorization"], "<redacted>");
    assert_eq!(line["http.request.header.cookie"], "session=…");
    assert_eq!(line["http.response.header.content-length"], "5");
    assert!(!proxy.output().contains("secret-token"), "{}", proxy.output());
}

#[test]
fn access_log_fields_and_captured_headers_that_cannot_be_stop_start_up_naming_the_key() {
    for (setting, key) in [
        ("access_log_fields = [\"url.pathh\"]", "access_log_fields"),
        (
            "access_log_request_headers = [\"bad header\"]",
            "access_log_request_headers",
        ),
        (
            "access_log_response_headers = [\"x(y)\"]",
            "access_log_response_headers",
        ),
        ("access_log_unredacted = [\"x-api-key\"]", "access_log_unredacted"),
        ("access_log_header_bytes = 0", "access_log_header_bytes"),
    ] {
        let config = TempConfig::new(&format!("access_log = \"stdout\"\n{setting}\n"));
        let path = config.path_str();
        let mut args = NOWHERE_ARGS.to_vec();
        args.extend(["--config", &path]);
        let (status, stdout, stderr) = run_to_exit(&args, Duration::from_secs(10));
        assert_eq!(status.code(), Some(2), "{setting}: stdout {stdout}\nstderr {stderr}");
        let lines: Vec<&str> = stderr.lines().filter(|l| !l.trim().is_empty()).collect();
        assert_eq!(lines.len(), 1, "{setting}: {stderr}");
        assert!(lines[0].contains(key), "{setting}: {stderr}");
    }
}
