use super::*;

#[test]
fn origin_accepts_urls_bare_authorities_and_ipv6_literals() {
    let o = Origin::parse("http://127.0.0.1:9000").unwrap();
    assert_eq!((o.scheme, o.host.as_str(), o.port), (Scheme::Http, "127.0.0.1", 9000));
    let o = Origin::parse("localhost:81").unwrap();
    assert_eq!((o.scheme, o.host.as_str(), o.port), (Scheme::Http, "localhost", 81));
    let o = Origin::parse("https://example.com").unwrap();
    assert_eq!((o.scheme, o.host.as_str(), o.port), (Scheme::Https, "example.com", 443));
    assert_eq!(o.url(), "https://example.com:443");
    assert_eq!(Origin::parse(&o.url()).unwrap(), o);
    assert_eq!(Origin::parse("https://[::1]:8443").unwrap().port, 8443);
    let o = Origin::parse("http://[::1]:9000/").unwrap();
    assert_eq!((o.host.as_str(), o.port), ("::1", 9000));
    assert_eq!(o.authority(), "[::1]:9000");
    assert_eq!(Origin::parse("http://example.com").unwrap().port, 80);
    assert!(Origin::parse("ftp://example.com").is_err());
    assert!(Origin::parse("http://example.com/path").is_err());
    assert!(Origin::parse("example.com:notaport").is_err());
    assert!(Origin::parse("http://a[1::]:9000").is_err());
}

#[test]
fn quick_case_has_one_upstream_and_a_catch_all() {
    let config = Config::single_upstream("127.0.0.1:9000", 4).unwrap();
    assert_eq!(config.upstreams[DEFAULT_UPSTREAM].max_connections, 4);
    assert_eq!(config.routes.len(), 1);
    assert!(config.routes[0].host.is_none() && config.routes[0].path_prefix.is_none());
}

/// The built-in defaults with one upstream `app` at `url` and a catch-all route to it.
fn defaults_with_app(url: &str) -> Config {
    let mut config = Config::default();
    let app = UpstreamConfig {
        url: url.to_string(),
        ..UpstreamConfig::default()
    };
    config.upstreams.insert("app".to_string(), app);
    config.routes.push(RouteConfig {
        host: None,
        path_prefix: None,
        upstream: "app".to_string(),
        priority: 0,
        ..RouteConfig::default()
    });
    config
}

#[test]
fn the_reference_file_is_valid_and_states_every_key_with_its_default() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("config/floodgate.toml");
    let config = Config::load(Some(&path), &Env::none(), &Overrides::default()).unwrap();
    let mut expected = defaults_with_app("http://127.0.0.1:9000");
    assert_eq!(config.to_redacted_toml().unwrap(), expected.to_redacted_toml().unwrap());
    // Every key appears, set or commented out; `threads` (no default) shows up only once it has a value.
    expected.threads = Some(2);
    expected.tls_cert = Some("cert.pem".into());
    expected.tls_key = Some("key.pem".into());
    expected.tls_certificates.push(TlsCertificateConfig {
        names: vec!["api.example.com".to_string()],
        cert: "api.pem".into(),
        key: "api-key.pem".into(),
    });
    if let Some(app) = expected.upstreams.get_mut("app") {
        app.tls_ca = Some("ca.pem".into());
        app.tls_client_cert = Some("client.pem".into());
        app.tls_client_key = Some("client-key.pem".into());
        app.tls_server_name = Some("app.internal".to_string());
        app.endpoints = crate::config::Endpoints::List(vec![EndpointConfig {
            url: "http://127.0.0.1:9001".into(),
            max_connections: 1,
        }]);
    }
    let text = std::fs::read_to_string(&path).unwrap();
    let mentioned = |key: &str| {
        text.lines()
            .any(|line| line.trim_start_matches("# ").starts_with(&format!("{key} = ")))
    };
    let table: toml::Table = toml::from_str(&expected.to_redacted_toml().unwrap()).unwrap();
    let lists = ["upstreams", "routes", "tls_certificates"];
    let mut keys: Vec<String> = table.keys().filter(|k| !lists.contains(&k.as_str())).cloned().collect();
    keys.extend(table["upstreams"]["app"].as_table().unwrap().keys().cloned());
    keys.extend(table["tls_certificates"][0].as_table().unwrap().keys().cloned());
    keys.extend(["host", "path_prefix", "upstream"].map(String::from));
    let missing: Vec<&String> = keys.iter().filter(|key| !mentioned(key)).collect();
    assert!(missing.is_empty(), "config/floodgate.toml does not state {missing:?}");
    assert!(text.lines().any(|line| line == "# [[tls_certificates]]"));
}

#[test]
fn zero_connections_is_rejected_with_its_key() {
    let err = Config::single_upstream("127.0.0.1:9000", 0).unwrap_err();
    assert_eq!(err.problems()[0].key, "upstreams.default.max_connections");
}

fn vars(pairs: &[(&str, &str)]) -> Env {
    Env::Vars(pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect())
}

const FILE: &str = r#"
listen = "127.0.0.1:1000"
[upstreams.api]
url = "http://127.0.0.1:9000"
max_connections = 4
[[routes]]
upstream = "api"
"#;

fn load(env: &Env, overrides: &Overrides) -> Result<Config, ConfigErrors> {
    Config::from_layers(Node::from_file(FILE, "test")?, env, overrides, &[])
}

fn problem_lines(err: &ConfigErrors) -> Vec<String> {
    err.problems().iter().map(ToString::to_string).collect()
}

#[test]
fn the_environment_overrides_the_file_and_flags_override_the_environment() {
    let env = vars(&[
        ("FLOODGATE__LISTEN", "0.0.0.0:2000"),
        ("FLOODGATE__UPSTREAMS__API__MAX_CONNECTIONS", "16"),
        ("FLOODGATE__UPSTREAMS__API__QUEUE_TIMEOUT", "1m 30s"),
        ("floodgate__upstreams__api__max_queue", "7"),
    ]);
    let config = load(&env, &Overrides::default()).unwrap();
    assert_eq!(config.listen, "0.0.0.0:2000".parse().unwrap());
    let api = &config.upstreams["api"];
    assert_eq!(api.max_connections, 16);
    assert_eq!(
        api.queue_timeout,
        Duration::from_secs(90),
        "durations parse as in the file"
    );
    assert_eq!(api.max_queue, 7, "names are case-insensitive");
    assert_eq!(api.url, "http://127.0.0.1:9000", "the file's other keys stay");

    let mut flags = Overrides::default();
    flags.global.listen = Some("127.0.0.1:3000".parse().unwrap());
    flags.upstream.max_connections = Some(2);
    let config = load(&env, &flags).unwrap();
    assert_eq!(config.listen, "127.0.0.1:3000".parse().unwrap());
    assert_eq!(config.upstreams["api"].max_connections, 2);
}

#[test]
fn the_environment_alone_can_define_an_upstream_and_trusted_proxies() {
    let env = vars(&[
        ("FLOODGATE__UPSTREAMS__WEB_2__URL", "127.0.0.1:9100"),
        ("FLOODGATE__TRUSTED_PROXIES", "10.0.0.0/8, 192.168.1.1/32"),
    ]);
    let config = load(&env, &Overrides::default()).unwrap();
    assert_eq!(config.upstreams["web_2"].url, "127.0.0.1:9100");
    assert_eq!(config.upstreams["web_2"].max_connections, 8, "the rest are defaults");
    let proxies: Vec<String> = config.trusted_proxies.iter().map(ToString::to_string).collect();
    assert_eq!(proxies, ["10.0.0.0/8", "192.168.1.1/32"]);
    let empty = load(&vars(&[("FLOODGATE__TRUSTED_PROXIES", "")]), &Overrides::default()).unwrap();
    assert!(empty.trusted_proxies.is_empty());
}

#[test]
fn kubernetes_service_variables_change_nothing() {
    let kubernetes = vars(&[
        ("FLOODGATE_PORT", "tcp://10.96.0.12:8080"),
        ("FLOODGATE_PORT_8080_TCP", "tcp://10.96.0.12:8080"),
        ("FLOODGATE_PORT_8080_TCP_ADDR", "10.96.0.12"),
        ("FLOODGATE_PORT_8080_TCP_PORT", "8080"),
        ("FLOODGATE_PORT_8080_TCP_PROTO", "tcp"),
        ("FLOODGATE_SERVICE_HOST", "10.96.0.12"),
        ("FLOODGATE_SERVICE_PORT", "8080"),
        ("FLOODGATE_SERVICE_PORT_HTTP", "8080"),
        ("FLOODGATE_ADMIN_SERVICE_HOST", "10.96.0.13"),
    ]);
    let with = load(&kubernetes, &Overrides::default()).unwrap();
    let without = load(&Env::none(), &Overrides::default()).unwrap();
    assert_eq!(with.to_redacted_toml().unwrap(), without.to_redacted_toml().unwrap());
    assert!(kubernetes.variables().is_empty());
}

#[test]
fn a_bad_environment_value_names_its_key_and_variable() {
    let env = vars(&[("FLOODGATE__UPSTREAMS__API__MAX_CONNECTIONS", "lots")]);
    let err = load(&env, &Overrides::default()).unwrap_err();
    let lines = problem_lines(&err);
    assert_eq!(lines.len(), 1, "{lines:?}");
    assert_eq!(
        lines[0],
        "upstreams.api.max_connections = \"lots\": expected an integer \
         (from FLOODGATE__UPSTREAMS__API__MAX_CONNECTIONS)"
    );
}

#[test]
fn an_invalid_environment_value_names_its_variable_unless_a_flag_replaced_it() {
    let env = vars(&[("FLOODGATE__UPSTREAMS__API__MAX_CONNECTIONS", "0")]);
    let err = load(&env, &Overrides::default()).unwrap_err();
    assert_eq!(
        problem_lines(&err),
        ["upstreams.api.max_connections = \"0\": must be greater than zero \
          (from FLOODGATE__UPSTREAMS__API__MAX_CONNECTIONS)"]
    );
    let mut flag = Overrides::default();
    flag.upstream.max_connections = Some(0);
    let err = load(&env, &flag).unwrap_err();
    assert_eq!(
        problem_lines(&err),
        ["upstreams.api.max_connections: must be greater than zero (from --max-connections)"]
    );
}

#[test]
fn routes_cannot_come_from_the_environment() {
    let env = vars(&[("FLOODGATE__ROUTES__0__UPSTREAM", "api")]);
    let err = load(&env, &Overrides::default()).unwrap_err();
    let lines = problem_lines(&err);
    assert_eq!(lines.len(), 1, "{lines:?}");
    assert!(lines[0].starts_with("routes: cannot be set from the environment (FLOODGATE__ROUTES__0__UPSTREAM)"));
}

#[test]
fn listener_certificates_cannot_come_from_the_environment() {
    let env = vars(&[("FLOODGATE__TLS_CERTIFICATES__0__CERT", "/etc/a.pem")]);
    let err = load(&env, &Overrides::default()).unwrap_err();
    assert_eq!(
        problem_lines(&err),
        [
            "tls_certificates: cannot be set from the environment (FLOODGATE__TLS_CERTIFICATES__0__CERT); \
          give [[tls_certificates]] in the file"
        ]
    );
}

#[test]
fn tls_keys_on_a_plain_http_upstream_are_refused_rather_than_ignored() {
    let env = vars(&[
        ("FLOODGATE__UPSTREAMS__API__TLS_CA", "/etc/ca.pem"),
        ("FLOODGATE__UPSTREAMS__API__TLS_SERVER_NAME", "api.internal"),
    ]);
    let err = load(&env, &Overrides::default()).unwrap_err();
    let keys: Vec<&str> = err.problems().iter().map(|p| p.key.as_str()).collect();
    assert_eq!(keys, ["upstreams.api.tls_ca", "upstreams.api.tls_server_name"]);
    assert!(problem_lines(&err)[0].contains("only for https://"), "{err}");
}

#[test]
fn every_bad_value_is_reported_not_only_the_first() {
    let text = r#"
listen = "nowhere"
bogus = 1
[upstreams.api]
url = "http://127.0.0.1:9000"
max_connections = "many"
queue_timeout = "5 parsecs"
[upstreams.web]
url = "http://127.0.0.1:9001"
idle_timeout = 30
"#;
    let err = Config::load_toml(text, "test", &Overrides::default()).unwrap_err();
    let keys: Vec<&str> = err.problems().iter().map(|p| p.key.as_str()).collect();
    assert_eq!(
        keys,
        [
            "bogus",
            "listen",
            "upstreams.api.max_connections",
            "upstreams.api.queue_timeout",
            "upstreams.web.idle_timeout",
            // Found by validating the rest: the file has no [[routes]].
            "routes"
        ]
    );
    assert!(err.problems().iter().all(|p| !p.to_string().contains('\n')));
}

#[test]
fn a_refused_value_hides_only_what_its_default_could_cause() {
    let text = r#"
first_byte_timeout = "0s"
listen = 5
admin = "127.0.0.1:8080"
[upstreams.api]
url = "http://127.0.0.1:9000"
max_connections = 2.5
min_connections = 6
connect_timeout = "0s"
[upstreams.web]
endpoints = 3
tls_server_name = "web.internal"
max_queue = 2
min_connections = 0
[[routes]]
upstream = "api"
[[routes]]
upstream = "web"
"#;
    let err = Config::load_toml(text, "test", &Overrides::default()).unwrap_err();
    let keys: Vec<&str> = err.problems().iter().map(|p| p.key.as_str()).collect();
    // Not min_connections against the default 8, nor url missing nor tls_server_name on http://, nor admin on
    // the default listen's port: those are the defaults standing in for the refused values.
    assert_eq!(
        keys,
        [
            "listen",
            "upstreams.api.max_connections",
            "upstreams.web.endpoints",
            "first_byte_timeout",
            "upstreams.api.connect_timeout",
            "upstreams.web.min_connections"
        ]
    );
}

#[test]
fn every_invalid_setting_is_reported_not_only_the_first() {
    let text = r#"
max_header_bytes = 0
[upstreams.Api]
url = "ftp://example.com"
max_connections = 0
[[routes]]
upstream = "nowhere"
path_prefix = "x"
"#;
    let err = Config::load_toml(text, "test", &Overrides::default()).unwrap_err();
    let keys: Vec<&str> = err.problems().iter().map(|p| p.key.as_str()).collect();
    assert_eq!(
        keys,
        [
            "max_header_bytes",
            "upstreams.Api",
            "upstreams.Api.url",
            "upstreams.Api.max_connections",
            "routes[0].upstream",
            "routes[0].path_prefix"
        ]
    );
}

#[test]
fn upstream_names_must_survive_the_environment_mapping() {
    for good in ["api", "web_2", "a1_b2_c3", "0"] {
        assert!(is_addressable_name(good), "{good}");
    }
    for bad in ["", "Api", "web-2", "a__b", "_a", "a_", "é"] {
        assert!(!is_addressable_name(bad), "{bad}");
    }
}

#[test]
fn the_effective_toml_loads_back_to_itself() {
    let mut config = load(&Env::none(), &Overrides::default()).unwrap();
    config.threads = Some(3);
    config.trusted_proxies = vec!["10.0.0.0/8".parse().unwrap()];
    config.routes.push(RouteConfig {
        host: Some("example.com".to_string()),
        path_prefix: Some("/x".to_string()),
        upstream: "api".to_string(),
        priority: 3,
        ..RouteConfig::default()
    });
    let text = config.to_redacted_toml().unwrap();
    let again = Config::load_toml(&text, "effective", &Overrides::default()).unwrap();
    assert_eq!(again.to_redacted_toml().unwrap(), text);
}

#[test]
fn secrets_are_redacted_when_printed_or_logged() {
    #[derive(Debug, Deserialize, Serialize)]
    struct WithSecret {
        token: Secret,
    }
    let parsed: WithSecret = toml::from_str("token = \"hunter2\"").unwrap();
    assert_eq!(parsed.token.expose(), "hunter2");
    let printed = toml::to_string(&parsed).unwrap();
    assert_eq!(printed.trim(), format!("token = \"{REDACTED}\""));
    assert!(!format!("{parsed:?}").contains("hunter2"));
}
