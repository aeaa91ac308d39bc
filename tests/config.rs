//! Configuration: bad files are rejected with the offending key named,
//! flags override the file, routes pick upstreams.

mod support;

use std::time::Duration;

use http::StatusCode;
use support::*;

/// Runs floodgate on `config` and expects a configuration error: exit code 2
/// and exactly one line on stderr, naming every string in `must_name`.
fn assert_rejected(config: &str, extra_args: &[&str], must_name: &[&str]) -> String {
    let file = TempConfig::new(config);
    let path = file.path_str();
    let mut args = vec!["--listen", "127.0.0.1:0", "--admin", "127.0.0.1:0", "--config", &path];
    args.extend_from_slice(extra_args);
    let (status, stdout, stderr) = run_to_exit(&args, Duration::from_secs(10));
    assert!(!status.success(), "accepted bad config:\n{config}");
    assert_eq!(
        status.code(),
        Some(2),
        "configuration errors exit with 2; stderr: {stderr}"
    );
    assert!(!stdout.contains("floodgate ready"), "printed ready with a bad config");
    let lines: Vec<&str> = stderr.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), 1, "expected one line on stderr, got:\n{stderr}");
    for name in must_name {
        assert!(
            lines[0].contains(name),
            "stderr line does not name {name:?}: {}",
            lines[0]
        );
    }
    lines[0].to_owned()
}

/// With its route: every problem gets a line of its own, and a missing route would be a second one.
const GOOD_UPSTREAM: &str = r#"
[upstreams.api]
url = "http://127.0.0.1:9"
max_connections = 4

[[routes]]
upstream = "api"
"#;

#[test]
fn unknown_top_level_key_is_rejected_naming_it() {
    let config = format!("bogus_setting = 1\n{GOOD_UPSTREAM}");
    assert_rejected(&config, &[], &["bogus_setting"]);
}

#[test]
fn unknown_upstream_key_is_rejected_naming_it() {
    let config = r#"
[upstreams.api]
url = "http://127.0.0.1:9"
max_conections = 4

[[routes]]
upstream = "api"
"#;
    assert_rejected(config, &[], &["max_conections"]);
}

#[test]
fn zero_max_connections_is_rejected_naming_the_key() {
    // With its route: every problem gets a line of its own, and a missing route would be a second one.
    let config = r#"
[upstreams.api]
url = "http://127.0.0.1:9"
max_connections = 0

[[routes]]
upstream = "api"
"#;
    assert_rejected(config, &[], &["upstreams.api.max_connections"]);
}

#[test]
fn negative_max_connections_is_rejected_naming_the_key() {
    let config = r#"
[upstreams.api]
url = "http://127.0.0.1:9"
max_connections = -1

[[routes]]
upstream = "api"
"#;
    assert_rejected(config, &[], &["max_connections"]);
}

#[test]
fn unparsable_duration_is_rejected_naming_the_key() {
    let config = r#"
[upstreams.api]
url = "http://127.0.0.1:9"
max_connections = 4
queue_timeout = "5 parsecs"

[[routes]]
upstream = "api"
"#;
    assert_rejected(config, &[], &["queue_timeout"]);
}

#[test]
fn route_to_unknown_upstream_is_rejected_naming_the_key() {
    let config = format!(
        r#"{GOOD_UPSTREAM}
[[routes]]
path_prefix = "/x"
upstream = "nowhere"
"#
    );
    assert_rejected(&config, &[], &["routes", "upstream"]);
}

/// Runs floodgate with `args` (no config file) and expects a configuration error: exit code 2, nothing on
/// stdout, and exactly one line on stderr naming every string in `must_name`.
fn assert_args_rejected(args: &[&str], must_name: &[&str]) -> String {
    let mut all = vec!["--listen", "127.0.0.1:0", "--admin", "127.0.0.1:0"];
    all.extend_from_slice(args);
    let (status, stdout, stderr) = run_to_exit(&all, Duration::from_secs(10));
    assert_eq!(
        status.code(),
        Some(2),
        "{args:?}: configuration errors exit with 2; stdout: {stdout}; stderr: {stderr}"
    );
    assert!(!stdout.contains("floodgate ready"), "{args:?} printed ready: {stdout}");
    let lines: Vec<&str> = stderr.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), 1, "{args:?}: expected one line on stderr, got:\n{stderr}");
    for name in must_name {
        assert!(
            lines[0].contains(name),
            "{args:?}: stderr line does not name {name:?}: {}",
            lines[0]
        );
    }
    lines[0].to_owned()
}

#[test]
fn zero_max_connections_flag_is_rejected_naming_the_key() {
    assert_args_rejected(
        &["--upstream", "127.0.0.1:9", "--max-connections", "0"],
        &["max_connections"],
    );
}

#[test]
fn missing_upstream_is_rejected_naming_the_key() {
    // Neither --upstream nor a file.
    assert_args_rejected(&[], &["upstreams"]);
    // A file with settings but no upstream table.
    assert_rejected("max_client_connections = 10\n", &[], &["upstreams"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn flags_override_the_config_file() {
    let upstream = Upstream::start().await;
    let config = TempConfig::new(&format!(
        r#"
listen = "127.0.0.1:1"
admin = "127.0.0.1:2"

[upstreams.default]
url = "{}"
max_connections = 8
max_queue = 10

[[routes]]
upstream = "default"
"#,
        upstream.url()
    ));
    let proxy = Proxy::start(&[
        "--config",
        &config.path_str(),
        "--max-connections",
        "2",
        "--max-queue",
        "33",
    ])
    .await;
    assert_ne!(proxy.listen.port(), 1, "--listen beats the file");
    let up = proxy.upstream_status("default").await;
    assert_eq!(up["max_connections"], 2, "{up}");
    assert_eq!(up["max_queue"], 33, "{up}");
    assert_eq!(get(proxy.listen, "/").await.status, StatusCode::OK);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn routes_pick_the_upstream_by_host_and_path_prefix_and_unmatched_gets_404() {
    let api = Upstream::start().await;
    let web = Upstream::start().await;
    let config = TempConfig::new(&format!(
        r#"
[upstreams.api]
url = "{api}"
max_connections = 2

[upstreams.web]
url = "{web}"
max_connections = 2

[[routes]]
host = "API.example.com"
upstream = "api"

[[routes]]
path_prefix = "/static"
upstream = "web"
"#,
        api = api.url(),
        web = web.url()
    ));
    let proxy = Proxy::start(&["--config", &config.path_str()]).await;
    let t = Duration::from_secs(10);
    let ask = |host: &'static str, path: &'static str| {
        let addr = proxy.listen;
        async move {
            let mut conn = RawConn::connect(addr).await;
            conn.write(format!("GET {path} HTTP/1.1\r\nHost: {host}\r\n\r\n").as_bytes())
                .await
                .unwrap();
            conn.read_response(false, t).await.unwrap().status
        }
    };
    // Host match is case-insensitive and ignores the port.
    assert_eq!(ask("api.example.com", "/v1/users").await, 200);
    assert_eq!(ask("api.example.com:8080", "/v1/orders").await, 200);
    // Prefix matches on a segment boundary.
    assert_eq!(ask("www.example.com", "/static").await, 200);
    assert_eq!(ask("www.example.com", "/static/app.js").await, 200);
    assert_eq!(ask("www.example.com", "/staticfoo").await, 404);
    assert_eq!(ask("www.example.com", "/other").await, 404);

    let api_paths: Vec<String> = api.recorded().into_iter().map(|r| r.uri).collect();
    let web_paths: Vec<String> = web.recorded().into_iter().map(|r| r.uri).collect();
    assert_eq!(api_paths, vec!["/v1/users", "/v1/orders"]);
    assert_eq!(web_paths, vec!["/static", "/static/app.js"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http2_requests_are_routed_by_their_authority() {
    let a = Upstream::start().await;
    let b = Upstream::start().await;
    let config = TempConfig::new(&format!(
        r#"
[upstreams.a]
url = "{a}"
max_connections = 2

[upstreams.b]
url = "{b}"
max_connections = 2

[[routes]]
host = "b.example"
upstream = "b"

[[routes]]
upstream = "a"
"#,
        a = a.url(),
        b = b.url()
    ));
    let proxy = Proxy::start(&["--config", &config.path_str()]).await;

    // HTTP/2 carries the host in :authority only (hyper sends no Host header over h2).
    let mut h2 = H2Conn::connect(proxy.listen).await;
    for (uri, expect_b) in [
        ("http://b.example/b-plain", true),
        ("http://B.Example:8443/b-port", true),
        ("http://a.example/a-plain", false),
    ] {
        let resp = h2.try_get_uri(uri).await.unwrap();
        assert_eq!(resp.status, StatusCode::OK, "{uri}: {}", resp.text());
        assert_eq!(resp.version, http::Version::HTTP_2);
        let path = uri.split_once("//").unwrap().1;
        let path = &path[path.find('/').unwrap()..];
        let (right, wrong) = if expect_b { (&b, &a) } else { (&a, &b) };
        assert_eq!(
            right.recorded_with_prefix(path).len(),
            1,
            "{uri} did not reach its upstream"
        );
        assert!(
            wrong.recorded_with_prefix(path).is_empty(),
            "{uri} reached the wrong upstream"
        );
    }
    // The upstream gets the authority as its Host.
    let seen = b.recorded();
    assert_eq!(seen.len(), 2);
    for (r, host) in seen.iter().zip(["b.example", "b.example:8443"]) {
        let got = r.header_all("host");
        assert_eq!(got.len(), 1, "{r:?}");
        assert!(got[0].eq_ignore_ascii_case(host), "Host {:?}, expected {host}", got[0]);
    }
    assert_eq!(a.requests(), 1);
}

#[test]
fn a_port_in_use_is_reported_once_and_exits_1() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap().to_string();
    let (status, stdout, stderr) = run_to_exit(
        &["--upstream", "127.0.0.1:9", "--listen", &addr, "--admin", "127.0.0.1:0"],
        Duration::from_secs(10),
    );
    assert_eq!(status.code(), Some(1), "stdout: {stdout}; stderr: {stderr}");
    let lines: Vec<&str> = stderr.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), 1, "{stderr}");
    assert!(lines[0].contains(&format!("cannot listen on {addr}")), "{stderr}");
    assert_eq!(
        lines[0].matches("in use").count(),
        1,
        "the reason is given twice: {stderr}"
    );
}

#[test]
fn listen_and_admin_on_one_port_are_refused_by_check_as_start_up_would_fail() {
    // A port free now, given to both listeners.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    for (listen, admin) in [
        (format!("127.0.0.1:{port}"), format!("127.0.0.1:{port}")),
        (format!("0.0.0.0:{port}"), format!("127.0.0.1:{port}")),
    ] {
        let config = format!("listen = \"{listen}\"\nadmin = \"{admin}\"\n{GOOD_UPSTREAM}");
        let line = support::pki::assert_refused(&config, "admin");
        assert!(line.contains("listen"), "{line}");
    }
    // Port 0 picks a free port for each: no clash.
    let (status, _, stderr) = run_to_exit(
        &[
            "check",
            "--upstream",
            "127.0.0.1:9",
            "--listen",
            "127.0.0.1:0",
            "--admin",
            "127.0.0.1:0",
        ],
        Duration::from_secs(10),
    );
    assert_eq!(status.code(), Some(0), "{stderr}");
}

#[test]
fn check_reports_parse_and_semantic_problems_in_one_pass_one_line_each() {
    let config = TempConfig::new(
        r#"
listen = "not an address"
max_client_connections = "many"

[upstreams.api]
url = "http://127.0.0.1:9000"
max_connections = 0
queue_timeout = "forever"

[[routes]]
upstream = "nope"
"#,
    );
    let (status, _, stderr) = run_to_exit(&["check", "--config", &config.path_str()], Duration::from_secs(10));
    assert_eq!(status.code(), Some(2), "{stderr}");
    let lines: Vec<&str> = stderr.lines().filter(|line| !line.trim().is_empty()).collect();
    // Each problem once, with the value it is about and the line of the file that gave it.
    let path = config.path_str();
    for (key, value, line) in [
        ("listen", "\"not an address\"", 2),
        ("max_client_connections", "\"many\"", 3),
        ("upstreams.api.max_connections", "0", 7),
        ("upstreams.api.queue_timeout", "\"forever\"", 8),
        ("routes[0].upstream", "\"nope\"", 11),
    ] {
        let prefix = format!("floodgate: invalid configuration: {key} = {value}: ");
        let origin = format!("({path}, line {line})");
        assert_eq!(
            lines
                .iter()
                .filter(|l| l.starts_with(&prefix) && l.ends_with(&origin))
                .count(),
            1,
            "{key} not named once with its value and line:\n{stderr}"
        );
    }
    assert_eq!(lines.len(), 5, "{stderr}");
}

/// `[upstreams.api]` with `api` set in it, `top` before it, and its route.
fn one_upstream_with(top: &str, api: &str) -> String {
    format!(
        "listen = \"127.0.0.1:0\"\nadmin = \"127.0.0.1:0\"\n{top}\n[upstreams.api]\nurl = \"http://127.0.0.1:9\"\n\
         {api}\n\n[[routes]]\nupstream = \"api\"\n"
    )
}

/// Top-level lines, lines in `[upstreams.api]`, environment, the key, what its one line must say.
type Mistake = (
    &'static str,
    &'static str,
    &'static [(&'static str, &'static str)],
    &'static str,
    &'static str,
);

#[test]
fn each_kind_of_mistake_is_said_in_words_with_its_value_and_where_it_was_given() {
    // `check` and a start-up each refuse with exactly that line (support::pki).
    let cases: &[Mistake] = &[
        // An enum names its values, and the one meant.
        (
            "",
            "queue_discipline = \"lifo\"",
            &[],
            "upstreams.api.queue_discipline",
            "upstreams.api.queue_discipline = \"lifo\": must be one of fifo, adaptive-lifo or codel; did you mean \
             adaptive-lifo? (",
        ),
        // A key that is part of the one meant.
        (
            "",
            "discipline = \"fifo\"",
            &[],
            "upstreams.api.discipline",
            "upstreams.api.discipline = \"fifo\": unknown key; did you mean `queue_discipline`? (",
        ),
        (
            "log_format = \"yaml\"",
            "",
            &[],
            "log_format",
            "log_format = \"yaml\": must be one of human or json (",
        ),
        // An unknown key: the key meant, at its line.
        (
            "",
            "max_conections = 8",
            &[],
            "upstreams.api.max_conections",
            "upstreams.api.max_conections = 8: unknown key; did you mean `max_connections`? (",
        ),
        // A wrong type, said as types an operator knows.
        (
            "",
            "queue_timeout = 5",
            &[],
            "upstreams.api.queue_timeout",
            "upstreams.api.queue_timeout = 5: expected a duration such as \"5s\", \"250ms\" or \"1m 30s\", not an \
             integer (",
        ),
        // A quoted integer is a string in a file; a variable's text is read as the key's type.
        (
            "",
            "max_connections = \"8\"",
            &[],
            "upstreams.api.max_connections",
            "upstreams.api.max_connections = \"8\": expected an integer, not a string (write it without quotes) (",
        ),
        (
            "",
            "",
            &[("FLOODGATE__UPSTREAMS__API__MAX_CONNECTIONS", "8 connections")],
            "upstreams.api.max_connections",
            "upstreams.api.max_connections = \"8 connections\": expected an integer \
             (from FLOODGATE__UPSTREAMS__API__MAX_CONNECTIONS)",
        ),
        (
            "",
            "max_connections = -1",
            &[],
            "upstreams.api.max_connections",
            "= -1: must not be negative (",
        ),
        // A boolean is true or false, nothing else.
        (
            "proxy_protocol = \"yes\"",
            "",
            &[],
            "proxy_protocol",
            "proxy_protocol = \"yes\": expected a boolean (true or false), not a string (",
        ),
        (
            "proxy_protocol = 1",
            "",
            &[],
            "proxy_protocol",
            "proxy_protocol = 1: expected a boolean (true or false), not an integer (",
        ),
        (
            "",
            "",
            &[("FLOODGATE__PROXY_PROTOCOL", "on")],
            "proxy_protocol",
            "proxy_protocol = \"on\": expected true or false (from FLOODGATE__PROXY_PROTOCOL)",
        ),
        // A log level that is no level, which a filter would take for a target and then drop every line.
        (
            "log_level = \"verbose\"",
            "",
            &[],
            "log_level",
            "log_level = \"verbose\": `verbose` is not a level (trace, debug, info, warn, error or off)",
        ),
        (
            "log_level = \"warn,floodgate=loud\"",
            "",
            &[],
            "log_level",
            "`loud` is not a level",
        ),
    ];
    for (top, api, env, key, says) in cases {
        let line = support::pki::assert_refused_with_env(&one_upstream_with(top, api), key, env);
        assert!(line.contains(says), "{top} {api} {env:?}: {line}\ndoes not say: {says}");
        if env.is_empty() {
            assert!(
                line.ends_with(")") && line.contains(", line "),
                "no line number: {line}"
            );
        }
    }
    // A flag's value names the flag.
    let (status, _, stderr) = run_to_exit(
        &["check", "--upstream", "127.0.0.1:9", "--max-connections", "0"],
        Duration::from_secs(10),
    );
    assert_eq!(status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("upstreams.default.max_connections: must be greater than zero (from --max-connections)"),
        "{stderr}"
    );
}
