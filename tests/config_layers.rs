//! Configuration layers through the real binary: built-in defaults < file < `FLOODGATE__` environment < flags,
//! the Kubernetes service variables ignored, and `floodgate check` on good and bad configurations and on every
//! file under `config/`.

mod support;

use std::path::{Path, PathBuf};
use std::process::ExitStatus;
use std::time::Duration;

use http::StatusCode;
use support::*;

/// What Kubernetes injects into every pod of a namespace with a Service named `floodgate` (ports 8080 and 9901).
const KUBERNETES: &[(&str, &str)] = &[
    ("FLOODGATE_SERVICE_HOST", "10.96.0.12"),
    ("FLOODGATE_SERVICE_PORT", "8080"),
    ("FLOODGATE_SERVICE_PORT_HTTP", "8080"),
    ("FLOODGATE_SERVICE_PORT_ADMIN", "9901"),
    ("FLOODGATE_PORT", "tcp://10.96.0.12:8080"),
    ("FLOODGATE_PORT_8080_TCP", "tcp://10.96.0.12:8080"),
    ("FLOODGATE_PORT_8080_TCP_PROTO", "tcp"),
    ("FLOODGATE_PORT_8080_TCP_PORT", "8080"),
    ("FLOODGATE_PORT_8080_TCP_ADDR", "10.96.0.12"),
    ("FLOODGATE_PORT_9901_TCP", "tcp://10.96.0.12:9901"),
    ("FLOODGATE_PORT_9901_TCP_ADDR", "10.96.0.12"),
];

struct Run {
    status: ExitStatus,
    stdout: String,
    stderr: String,
}

impl Run {
    /// The non-empty lines on stderr.
    fn problems(&self) -> Vec<&str> {
        self.stderr.lines().filter(|l| !l.trim().is_empty()).collect()
    }

    /// The configuration `check` printed; panics unless it succeeded.
    fn effective(&self) -> toml::Table {
        assert_eq!(
            self.status.code(),
            Some(0),
            "check failed\nstdout:\n{}\nstderr:\n{}",
            self.stdout,
            self.stderr
        );
        match self.stdout.parse::<toml::Table>() {
            Ok(table) => table,
            Err(err) => panic!("check printed no TOML ({err}):\n{}", self.stdout),
        }
    }
}

/// floodgate with `env` as its only `FLOODGATE__` variables: the layers under test are these, not those the suite
/// itself may run under.
fn floodgate(args: &[&str], env: &[(&str, &str)]) -> Run {
    let mut command = std::process::Command::new(floodgate_bin());
    for (name, _) in std::env::vars_os() {
        if name.to_string_lossy().to_ascii_uppercase().starts_with("FLOODGATE__") {
            command.env_remove(name);
        }
    }
    command.args(args).envs(env.iter().copied());
    let (status, stdout, stderr) = run_command_to_exit(command, Duration::from_secs(10));
    Run { status, stdout, stderr }
}

fn check(args: &[&str], env: &[(&str, &str)]) -> Run {
    let mut all = vec!["check"];
    all.extend_from_slice(args);
    floodgate(&all, env)
}

fn upstream<'t>(effective: &'t toml::Table, name: &str) -> &'t toml::Table {
    match effective
        .get("upstreams")
        .and_then(|u| u.get(name))
        .and_then(|u| u.as_table())
    {
        Some(table) => table,
        None => panic!("no upstreams.{name} in {effective:#?}"),
    }
}

const API_FILE: &str = r#"
[upstreams.api]
url = "http://127.0.0.1:9"

[[routes]]
upstream = "api"
"#;

#[test]
fn check_prints_the_effective_configuration_as_toml_and_exits_0() {
    let file = TempConfig::new(API_FILE);
    let path = file.path_str();
    let run = check(&["--config", &path], &[]);
    assert!(run.stderr.trim().is_empty(), "stderr: {}", run.stderr);
    assert!(
        run.stdout.starts_with("# floodgate check: valid."),
        "stdout: {}",
        run.stdout
    );
    let effective = run.effective();
    // Defaults the file leaves out are stated.
    assert_eq!(effective["listen"].as_str(), Some("127.0.0.1:8080"));
    assert_eq!(effective["client_idle_timeout"].as_str(), Some("1m"));
    let api = upstream(&effective, "api");
    assert_eq!(api["url"].as_str(), Some("http://127.0.0.1:9"));
    assert_eq!(api["max_connections"].as_integer(), Some(8));
    assert_eq!(api["queue_timeout"].as_str(), Some("5s"));
    assert_eq!(effective["routes"][0]["upstream"].as_str(), Some("api"));

    // Flags before the subcommand count as well as after it.
    let before = floodgate(&["--config", &path, "check"], &[]);
    assert_eq!(before.status.code(), Some(0), "stderr: {}", before.stderr);
    assert_eq!(before.stdout, run.stdout);
}

#[test]
fn check_lists_every_problem_one_line_each_naming_its_key_and_exits_2() {
    let bad_values = TempConfig::new(
        r#"
listen = "nowhere"
[upstreams.api]
url = "http://127.0.0.1:9"
max_connections = "many"
queue_timeout = "5 parsecs"

[[routes]]
upstream = "api"
"#,
    );
    let run = check(&["--config", &bad_values.path_str()], &[]);
    assert_eq!(run.status.code(), Some(2), "stderr: {}", run.stderr);
    assert!(run.stdout.is_empty(), "stdout: {}", run.stdout);
    let lines = run.problems();
    assert_eq!(lines.len(), 3, "{lines:#?}");
    for (line, key) in lines.iter().zip([
        "listen = \"nowhere\": ",
        "upstreams.api.max_connections = \"many\": ",
        "upstreams.api.queue_timeout = \"5 parsecs\": ",
    ]) {
        assert!(
            line.starts_with(&format!("floodgate: invalid configuration: {key}")),
            "{line}"
        );
    }

    let bad_settings = TempConfig::new(
        r#"
[upstreams.API]
url = "ftp://127.0.0.1:9"
max_connections = 0

[[routes]]
upstream = "nowhere"
"#,
    );
    let run = check(&["--config", &bad_settings.path_str()], &[]);
    assert_eq!(run.status.code(), Some(2), "stderr: {}", run.stderr);
    let lines = run.problems();
    let keys = [
        "upstreams.API: ",
        "upstreams.API.url = \"ftp://127.0.0.1:9\": ",
        "upstreams.API.max_connections = 0: ",
        "routes[0].upstream = \"nowhere\": ",
    ];
    assert_eq!(lines.len(), keys.len(), "{lines:#?}");
    for (line, key) in lines.iter().zip(keys) {
        assert!(line.contains(key), "{line} does not name {key}");
    }
}

#[test]
fn each_layer_overrides_the_one_below() {
    let file = TempConfig::new(
        r#"
listen = "127.0.0.1:1001"
shutdown_timeout = "11s"

[upstreams.api]
url = "http://127.0.0.1:9"
max_queue = 100
queue_timeout = "1s"

[[routes]]
upstream = "api"
"#,
    );
    let path = file.path_str();
    let env = [
        ("FLOODGATE__LISTEN", "127.0.0.1:2002"),
        ("FLOODGATE__UPSTREAMS__API__MAX_QUEUE", "200"),
        ("FLOODGATE__UPSTREAMS__API__QUEUE_TIMEOUT", "2s"),
    ];

    // The file over the defaults.
    let file_only = check(&["--config", &path], &[]).effective();
    assert_eq!(file_only["listen"].as_str(), Some("127.0.0.1:1001"));
    assert_eq!(file_only["admin"].as_str(), Some("127.0.0.1:9901"), "a default");
    assert_eq!(upstream(&file_only, "api")["max_queue"].as_integer(), Some(100));

    // The environment over the file.
    let with_env = check(&["--config", &path], &env).effective();
    assert_eq!(with_env["listen"].as_str(), Some("127.0.0.1:2002"));
    assert_eq!(
        with_env["shutdown_timeout"].as_str(),
        Some("11s"),
        "the file's other keys stay"
    );
    let api = upstream(&with_env, "api");
    assert_eq!(api["max_queue"].as_integer(), Some(200));
    assert_eq!(api["queue_timeout"].as_str(), Some("2s"));

    // Flags over the environment.
    let run = check(
        &["--config", &path, "--listen", "127.0.0.1:3003", "--max-queue", "300"],
        &env,
    );
    assert!(
        run.stdout
            .contains("environment (FLOODGATE__LISTEN, FLOODGATE__UPSTREAMS__API__MAX_QUEUE"),
        "check names the variables it read: {}",
        run.stdout
    );
    let with_flags = run.effective();
    assert_eq!(with_flags["listen"].as_str(), Some("127.0.0.1:3003"));
    let api = upstream(&with_flags, "api");
    assert_eq!(api["max_queue"].as_integer(), Some(300));
    assert_eq!(api["queue_timeout"].as_str(), Some("2s"), "no flag: the environment's");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_environment_reaches_each_upstream_by_name() {
    let api = Upstream::start().await;
    let web = Upstream::start().await;
    let file = TempConfig::new(&format!(
        r#"
[upstreams.api]
url = "{}"
max_connections = 8

[[routes]]
host = "web.example"
upstream = "web_2"

[[routes]]
upstream = "api"
"#,
        api.url()
    ));
    // `web_2` exists only in the environment; `api`'s cap comes from there too.
    let web_url = web.url();
    let proxy = Proxy::start_with_env(
        &["--config", &file.path_str()],
        &[
            ("FLOODGATE__UPSTREAMS__API__MAX_CONNECTIONS", "3"),
            ("FLOODGATE__UPSTREAMS__API__QUEUE_TIMEOUT", "1m 30s"),
            ("FLOODGATE__UPSTREAMS__WEB_2__URL", &web_url),
            ("FLOODGATE__UPSTREAMS__WEB_2__MAX_CONNECTIONS", "2"),
        ],
    )
    .await;
    assert_eq!(proxy.upstream_status("api").await["max_connections"], 3);
    assert_eq!(proxy.upstream_status("web_2").await["max_connections"], 2);

    assert_eq!(get(proxy.listen, "/to-api").await.status, StatusCode::OK);
    let mut conn = RawConn::connect(proxy.listen).await;
    conn.write(b"GET /to-web HTTP/1.1\r\nHost: web.example\r\n\r\n")
        .await
        .unwrap();
    let resp = conn.read_response(false, CLIENT_TIMEOUT).await.unwrap();
    assert_eq!(resp.status, 200);
    assert_eq!(api.recorded_with_prefix("/to-api").len(), 1);
    assert_eq!(web.recorded_with_prefix("/to-web").len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubernetes_service_variables_change_nothing() {
    let file = TempConfig::new(API_FILE);
    let path = file.path_str();
    let plain = check(&["--config", &path], &[]);
    let in_kubernetes = check(&["--config", &path], KUBERNETES);
    plain.effective();
    assert_eq!(in_kubernetes.stdout, plain.stdout, "stderr: {}", in_kubernetes.stderr);
    assert!(plain.stdout.contains("environment (none)"), "{}", plain.stdout);

    // And the proxy starts and serves with them.
    let upstream = Upstream::start().await;
    let proxy = Proxy::start_with_env(&["--upstream", &upstream.url(), "--max-connections", "2"], KUBERNETES).await;
    assert_eq!(get(proxy.listen, "/").await.status, StatusCode::OK);
    assert_eq!(proxy.upstream_status("default").await["max_connections"], 2);
}

#[test]
fn a_bad_environment_value_stops_start_up_with_one_line_naming_the_key() {
    let file = TempConfig::new(API_FILE);
    let path = file.path_str();
    for (variable, value, names) in [
        (
            "FLOODGATE__UPSTREAMS__API__MAX_CONNECTIONS",
            "lots",
            &[
                "upstreams.api.max_connections",
                "FLOODGATE__UPSTREAMS__API__MAX_CONNECTIONS",
            ][..],
        ),
        (
            "FLOODGATE__UPSTREAMS__API__QUEUE_TIMEOUT",
            "5 parsecs",
            &[
                "upstreams.api.queue_timeout",
                "FLOODGATE__UPSTREAMS__API__QUEUE_TIMEOUT",
            ][..],
        ),
        (
            "FLOODGATE__UPSTREAMS__API__MAX_CONNECTIONS",
            "0",
            &[
                "upstreams.api.max_connections",
                "FLOODGATE__UPSTREAMS__API__MAX_CONNECTIONS",
            ][..],
        ),
        ("FLOODGATE__ADMIN", "localhost", &["admin", "FLOODGATE__ADMIN"][..]),
        (
            "FLOODGATE__UPSTREAMS__API__MAX_CONECTIONS",
            "4",
            &["upstreams.api.max_conections"][..],
        ),
        (
            "FLOODGATE__ROUTES__0__UPSTREAM",
            "api",
            &["routes", "FLOODGATE__ROUTES__0__UPSTREAM"][..],
        ),
    ] {
        let run = floodgate(
            &["--listen", "127.0.0.1:0", "--admin", "127.0.0.1:0", "--config", &path],
            &[(variable, value)],
        );
        assert_eq!(
            run.status.code(),
            Some(2),
            "{variable}={value}: stdout: {}; stderr: {}",
            run.stdout,
            run.stderr
        );
        assert!(!run.stdout.contains("floodgate ready"), "{variable}={value} started");
        let lines = run.problems();
        assert_eq!(lines.len(), 1, "{variable}={value}: {lines:#?}");
        for name in names {
            assert!(
                lines[0].contains(name),
                "{variable}={value}: {} does not name {name}",
                lines[0]
            );
        }
    }
}

fn toml_files(dir: &Path, found: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            toml_files(&path, found);
        } else if path.extension().is_some_and(|ext| ext == "toml") {
            found.push(path);
        }
    }
}

#[test]
fn every_file_under_config_passes_check_and_prints_a_config_that_does_too() {
    let mut files = Vec::new();
    toml_files(&Path::new(env!("CARGO_MANIFEST_DIR")).join("config"), &mut files);
    files.sort();
    for expected in [
        "config/floodgate.toml",
        "config/examples/ktor-front-door.toml",
        "config/examples/load-shedding-gateway.toml",
    ] {
        assert!(files.iter().any(|f| f.ends_with(expected)), "{expected} is missing");
    }
    for file in &files {
        let run = check(&["--config", &file.display().to_string()], &[]);
        let effective = run.effective();
        // What check prints is a configuration file that states the same configuration.
        let printed = TempConfig::new(&run.stdout);
        let again = check(&["--config", &printed.path_str()], &[]).effective();
        assert_eq!(again, effective, "{}", file.display());
    }
}

#[test]
fn the_admin_token_is_checked_and_never_shown() {
    let file = TempConfig::new(API_FILE);
    let path = file.path_str();
    let token = "a-long-enough-admin-token";
    let run = check(&["--config", &path], &[("FLOODGATE__ADMIN_TOKEN", token)]);
    let effective = run.effective();
    assert_eq!(effective["admin_token"].as_str(), Some("<redacted>"));
    assert!(!run.stdout.contains(token), "{}", run.stdout);

    let short = "short token";
    let run = check(&["--config", &path], &[("FLOODGATE__ADMIN_TOKEN", short)]);
    assert_eq!(run.status.code(), Some(2), "stderr: {}", run.stderr);
    let problems = run.problems();
    assert_eq!(problems.len(), 1, "{problems:?}");
    assert!(problems[0].contains("admin_token = <redacted>: "), "{problems:?}");
    assert!(!run.stderr.contains(short), "{}", run.stderr);
}

/// A file that starts on ephemeral ports (in case start-up accepts it) with upstream `api` and its route; `top`
/// goes before the tables, `api` inside `[upstreams.api]`, `rest` after the route.
fn file_with(top: &str, api: &str, rest: &str) -> String {
    format!(
        "listen = \"127.0.0.1:0\"\nadmin = \"127.0.0.1:0\"\n{top}\n[upstreams.api]\nurl = \"http://127.0.0.1:9\"\n\
         {api}\n\n[[routes]]\nupstream = \"api\"\n{rest}\n"
    )
}

#[test]
fn integer_keys_refuse_fractions_and_booleans_in_the_file() {
    for (top, api, rest, key) in [
        ("", "max_connections = 4.5", "", "upstreams.api.max_connections"),
        ("", "max_connections = 0.5", "", "upstreams.api.max_connections"),
        ("", "max_connections = true", "", "upstreams.api.max_connections"),
        ("", "max_queue = 2.5", "", "upstreams.api.max_queue"),
        ("", "shed_status = 503.0", "", "upstreams.api.shed_status"),
        (
            "",
            "fair_weights = { gold = 2.5 }",
            "",
            "upstreams.api.fair_weights.gold",
        ),
        ("threads = 2.0", "", "", "threads"),
        ("max_concurrent_streams = false", "", "", "max_concurrent_streams"),
        ("max_buffered_bytes = 1e6", "", "", "max_buffered_bytes"),
        ("", "", "priority = 1.5", "routes[0].priority"),
    ] {
        let line = pki::assert_refused(&file_with(top, api, rest), key);
        assert!(line.contains("expected an integer"), "{line}");
    }
    // A file types its values: a quoted number is a string, and an integer key refuses it, showing it as given.
    let line = pki::assert_refused(
        &file_with("", "max_connections = \"4\"", ""),
        "upstreams.api.max_connections",
    );
    assert!(
        line.contains("upstreams.api.max_connections = \"4\": expected an integer, not a string"),
        "{line}"
    );
}

#[test]
fn integer_keys_refuse_fractions_and_booleans_from_the_environment() {
    let file = file_with("", "", "");
    for (variable, value, key) in [
        (
            "FLOODGATE__UPSTREAMS__API__MAX_CONNECTIONS",
            "true",
            "upstreams.api.max_connections",
        ),
        (
            "FLOODGATE__UPSTREAMS__API__MAX_CONNECTIONS",
            "4.5",
            "upstreams.api.max_connections",
        ),
        ("FLOODGATE__UPSTREAMS__API__MAX_QUEUE", "yes", "upstreams.api.max_queue"),
        ("FLOODGATE__UPSTREAMS__API__MAX_QUEUE", "2.5", "upstreams.api.max_queue"),
        ("FLOODGATE__THREADS", "on", "threads"),
    ] {
        let line = pki::assert_refused_with_env(&file, key, &[(variable, value)]);
        assert!(line.contains(variable), "{line}");
    }
    let run = check(
        &["--config", &TempConfig::new(&file).path_str()],
        &[("FLOODGATE__UPSTREAMS__API__MAX_QUEUE", "7")],
    );
    assert_eq!(upstream(&run.effective(), "api")["max_queue"].as_integer(), Some(7));
}

#[test]
fn threads_beyond_the_bound_are_refused_by_check_and_start_up_alike() {
    pki::assert_refused(&file_with("threads = 100000", "", ""), "threads");
    pki::assert_refused(&file_with("threads = 1025", "", ""), "threads");
    let run = check(
        &[
            "--config",
            &TempConfig::new(&file_with("threads = 1024", "", "")).path_str(),
        ],
        &[],
    );
    assert_eq!(run.effective()["threads"].as_integer(), Some(1024));
    // As a flag too.
    for args in [
        &["check", "--upstream", "127.0.0.1:9", "--threads", "100000"][..],
        &[
            "--upstream",
            "127.0.0.1:9",
            "--threads",
            "100000",
            "--listen",
            "127.0.0.1:0",
            "--admin",
            "127.0.0.1:0",
        ],
    ] {
        let run = floodgate(args, &[]);
        assert_eq!(run.status.code(), Some(2), "{args:?}: {}", run.stderr);
        let lines = run.problems();
        assert_eq!(lines.len(), 1, "{args:?}: {lines:?}");
        assert!(lines[0].contains(" threads: "), "{lines:?}");
    }
}

/// floodgate with `args`, allowed `max_processes` threads in all (itself included), through util-linux's `prlimit`:
/// as root, run as `nobody`, whose count holds floodgate alone (root's own limit is not enforced); otherwise the
/// limit is 1, below what the user running the tests already has, so that no thread at all can be made.
fn floodgate_with_few_threads(args: &[&str], env: &[(&str, &str)], max_processes: u32) -> Run {
    let root = std::process::Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|out| out.stdout.trim_ascii() == b"0");
    let mut command = if root {
        let mut command = std::process::Command::new("setpriv");
        command.args(["--reuid=65534", "--regid=65534", "--clear-groups", "prlimit"]);
        command
    } else {
        std::process::Command::new("prlimit")
    };
    let limit = if root { max_processes } else { 1 };
    command
        .arg(format!("--nproc={limit}"))
        .arg(floodgate_bin())
        .args(args)
        .envs(env.iter().copied());
    let (status, stdout, stderr) = run_command_to_exit(command, Duration::from_secs(20));
    Run { status, stdout, stderr }
}

#[test]
fn a_runtime_that_cannot_get_its_threads_is_one_line_and_exit_1_not_a_panic_or_a_hang() {
    let ports = [
        "--listen",
        "127.0.0.1:0",
        "--admin",
        "127.0.0.1:0",
        "--upstream",
        "127.0.0.1:9",
    ];
    // Some worker threads start and then the rest cannot (tokio panics there, and its unwinding waits forever on
    // the ones it started); then none at all.
    for max_processes in [8, 1] {
        let mut args = ports.to_vec();
        args.extend(["--threads", "64"]);
        let run = floodgate_with_few_threads(&args, &[], max_processes);
        assert_eq!(run.status.code(), Some(1), "limit {max_processes}: {}", run.stderr);
        let lines = run.problems();
        assert_eq!(lines.len(), 1, "limit {max_processes}: {}", run.stderr);
        assert!(
            lines[0].starts_with("floodgate: cannot start the runtime: "),
            "limit {max_processes}: {lines:?}"
        );
        assert!(!run.stdout.contains("floodgate ready"), "{}", run.stdout);
    }
    // The access log's writer thread is the first one made: the same, under its own name.
    let run = floodgate_with_few_threads(&ports, &[("FLOODGATE__ACCESS_LOG", "stderr")], 1);
    assert_eq!(run.status.code(), Some(1), "{}", run.stderr);
    let lines = run.problems();
    assert_eq!(lines.len(), 1, "{}", run.stderr);
    assert!(lines[0].starts_with("floodgate: cannot start "), "{lines:?}");
}

#[test]
fn check_refuses_an_access_log_that_start_up_could_not_open() {
    let dir = pki::TempDir::new();
    let missing = dir.0.join("no-such-dir").join("access.log");
    let line = pki::assert_refused(
        &file_with(&format!("access_log = {:?}", missing.display().to_string()), "", ""),
        "access_log",
    );
    assert!(line.contains("no-such-dir"), "{line}");
    // A directory is no file to append to.
    pki::assert_refused(
        &file_with(&format!("access_log = {:?}", dir.0.display().to_string()), "", ""),
        "access_log",
    );

    // A file that can be opened passes, and check leaves it as it was: an existing one keeps its lines, a new one
    // is not created.
    let existing = dir.write("existing.log", "an old line\n");
    let new = dir.0.join("new.log").display().to_string();
    for path in [&existing, &new] {
        let file = TempConfig::new(&file_with(&format!("access_log = {path:?}"), "", ""));
        check(&["--config", &file.path_str()], &[]).effective();
    }
    assert_eq!(std::fs::read_to_string(&existing).unwrap(), "an old line\n");
    assert!(!Path::new(&new).exists(), "check created {new}");
}

/// `check` and start-up both exit 2 with the same problems, one line each; returns the lines.
fn assert_refused_with_lines(config: &str, env: &[(&str, &str)]) -> Vec<String> {
    let file = TempConfig::new(config);
    let path = file.path_str();
    let checked = check(&["--config", &path], env);
    let started = floodgate(&["--config", &path], env);
    for run in [&checked, &started] {
        assert_eq!(
            run.status.code(),
            Some(2),
            "stdout: {}; stderr: {}",
            run.stdout,
            run.stderr
        );
    }
    assert_eq!(checked.problems(), started.problems());
    checked.problems().iter().map(|line| line.to_string()).collect()
}

#[test]
fn every_bad_trusted_proxies_entry_is_reported_not_only_the_first() {
    let lines = assert_refused_with_lines(
        &file_with(
            r#"trusted_proxies = ["10.0.0.0/8", "nope", "300.1.1.1", "10.0.0.0/99"]"#,
            "",
            "",
        ),
        &[],
    );
    let keys = [
        "trusted_proxies[1] = \"nope\": ",
        "trusted_proxies[2] = \"300.1.1.1\": ",
        "trusted_proxies[3] = \"10.0.0.0/99\": ",
    ];
    assert_eq!(lines.len(), keys.len(), "{lines:#?}");
    for (line, key) in lines.iter().zip(keys) {
        assert!(line.contains(key), "{line} does not name {key}");
    }
    let lines = assert_refused_with_lines(
        &file_with("", "", ""),
        &[("FLOODGATE__TRUSTED_PROXIES", "nope, 10.0.0.0/8, 300.1.1.1")],
    );
    assert_eq!(lines.len(), 2, "{lines:#?}");
    assert!(
        lines[0].contains("trusted_proxies[0] = \"nope\": ") && lines[0].contains("(from FLOODGATE__TRUSTED_PROXIES)"),
        "{lines:#?}"
    );
    assert!(lines[1].contains("trusted_proxies[2] = \"300.1.1.1\": "), "{lines:#?}");
}

#[test]
fn a_bad_value_does_not_hide_the_problems_of_other_keys() {
    let config = r#"
listen = "127.0.0.1:0"
admin = "127.0.0.1:0"
max_header_bytes = 0
fair_weights_typo = 1

[upstreams.api]
url = "http://127.0.0.1:9"
max_connections = 4.5
fair_weights = { a = 0.5, b = 2, c = "x" }

[upstreams.web]
endpoints = [
    { url = "ftp://127.0.0.1:1", max_connections = 1 },
    { url = "http://127.0.0.1:2", max_connections = 0 },
]

[[routes]]
upstream = "api"

[[routes]]
upstream = "nowhere"
"#;
    let lines = assert_refused_with_lines(config, &[]);
    // Each with its value as the file gave it.
    let keys = [
        "fair_weights_typo = 1: ",
        "upstreams.api.fair_weights.a = 0.5: ",
        "upstreams.api.fair_weights.c = \"x\": ",
        "upstreams.api.max_connections = 4.5: ",
        "max_header_bytes = 0: ",
        "upstreams.web.endpoints[0].url = \"ftp://127.0.0.1:1\": ",
        "upstreams.web.endpoints[1].max_connections = 0: ",
        "routes[1].upstream = \"nowhere\": ",
    ];
    assert_eq!(lines.len(), keys.len(), "{lines:#?}");
    for key in keys {
        assert!(
            lines.iter().any(|line| line.contains(key)),
            "no line names {key}: {lines:#?}"
        );
    }
}

#[test]
fn the_retired_http1_server_key_is_refused_saying_what_became_of_it_from_a_file_or_a_variable() {
    for (top, env) in [
        (r#"http1_server = "hyper""#, &[][..]),
        ("", &[("FLOODGATE__HTTP1_SERVER", "floodgate")][..]),
    ] {
        let lines = assert_refused_with_lines(&file_with(top, "", ""), env);
        assert_eq!(lines.len(), 1, "{lines:#?}");
        assert!(
            lines[0].contains("http1_server = ") && lines[0].contains("retired") && lines[0].contains("TLS"),
            "{lines:#?}"
        );
    }
}
