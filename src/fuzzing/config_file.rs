//! The `config` target: a TOML file through the real loader and validation.

use std::time::Duration;

use http::HeaderValue;

use crate::config::{Config, Origin, Overrides};

/// Loads `bytes` as a config file. A refusal must name its key on one line; an accepted config must hold every
/// limit the reference file documents, so nothing downstream (pools, listeners, timers) has to check again.
pub fn config_file(bytes: &[u8]) {
    let text = String::from_utf8_lossy(bytes);
    match Config::load_toml(&text, "config", &Overrides::default()) {
        Ok(config) => check_accepted(&config),
        Err(errors) => {
            assert!(!errors.problems().is_empty(), "a refusal with no problem");
            for err in errors.problems() {
                assert!(!err.key.is_empty(), "a refusal names no key: {err}");
                assert!(!err.to_string().contains('\n'), "a refusal spans lines: {err:?}");
            }
        }
    }
}

fn check_accepted(config: &Config) {
    assert!(!config.upstreams.is_empty(), "accepted without an upstream");
    assert!(!config.routes.is_empty(), "accepted without a route");
    assert!(config.max_client_connections > 0, "max_client_connections is 0");
    assert!(
        config.max_client_connections <= tokio::sync::Semaphore::MAX_PERMITS,
        "max_client_connections {} is more than a semaphore holds",
        config.max_client_connections
    );
    assert!(config.max_header_bytes > 0, "max_header_bytes is 0");
    assert!(config.max_concurrent_streams > 0, "max_concurrent_streams is 0");
    assert!(config.threads != Some(0), "threads is 0");
    for (name, value, zero_allowed) in [
        ("first_byte_timeout", config.first_byte_timeout, false),
        ("header_read_timeout", config.header_read_timeout, false),
        ("client_idle_timeout", config.client_idle_timeout, false),
        ("shutdown_timeout", config.shutdown_timeout, true),
    ] {
        check_duration(name, value, zero_allowed);
    }
    for (name, upstream) in &config.upstreams {
        // Reachable as FLOODGATE__UPSTREAMS__<NAME>__…: lowercase, and `__` only ever between key parts.
        assert!(
            crate::config::is_addressable_name(name),
            "upstream name {name:?} is not a-z, 0-9 and single _ inside"
        );
        let endpoints = match upstream.endpoint_list(name) {
            Ok(endpoints) => endpoints,
            Err(problem) => panic!("accepted endpoints do not parse: {problem}"),
        };
        assert!(
            !endpoints.is_empty() || upstream.endpoints.dns().is_some(),
            "upstreams.{name} has no endpoint"
        );
        for (origin, cap) in endpoints {
            assert!(cap > 0, "upstreams.{name}: an endpoint with cap 0");
            assert!(
                origin.port > 0 && !origin.host.is_empty(),
                "origin {origin:?} cannot be dialled"
            );
            // The pool's default Host header; a fallback there would send requests for another host.
            assert!(
                HeaderValue::from_str(&origin.authority()).is_ok(),
                "origin {origin:?} gives no valid Host header"
            );
            assert_eq!(
                Origin::parse(&origin.url()).as_ref(),
                Ok(&origin),
                "origin URL does not parse back"
            );
        }
        assert!(upstream.max_connections > 0, "upstreams.{name}.max_connections is 0");
        for (field, value, zero_allowed) in upstream.durations() {
            check_duration(&format!("upstreams.{name}.{field}"), value, zero_allowed);
        }
    }
    for (index, route) in config.routes.iter().enumerate() {
        assert!(
            config.upstreams.contains_key(&route.upstream),
            "routes[{index}] goes to unknown upstream {:?}",
            route.upstream
        );
        if let Some(prefix) = &route.path_prefix {
            assert!(
                prefix.starts_with('/'),
                "routes[{index}].path_prefix {prefix:?} is not a path"
            );
        }
    }
    // The listener gives a client that stops reading this long; it must be a usable deadline too.
    check_duration("client_write_stall_limit", config.client_write_stall_limit(), false);
    // What `floodgate check` prints must be a file that gives the same configuration.
    let printed = match config.to_redacted_toml() {
        Ok(text) => text,
        Err(err) => panic!("an accepted config cannot be printed: {err}"),
    };
    match Config::load_toml(&printed, "printed", &Overrides::default()) {
        Ok(again) => assert_eq!(
            again.to_redacted_toml().ok().as_deref(),
            Some(printed.as_str()),
            "the printed config loads as another"
        ),
        Err(err) => panic!("the printed config is refused: {err}\n{printed}"),
    }
}

/// Deadlines are `now + duration`: non-zero where zero would fire at once, and never near overflow.
fn check_duration(key: &str, value: Duration, zero_allowed: bool) {
    assert!(zero_allowed || !value.is_zero(), "{key} is 0");
    assert!(
        value <= Duration::from_secs(366 * 24 * 3600),
        "{key} {value:?} is more than a year"
    );
    assert!(
        tokio::time::Instant::now().checked_add(value).is_some(),
        "{key} {value:?} overflows a deadline"
    );
}
