//! Endpoints discovered from DNS (`endpoints = { dns = ... }`): every address the name resolves to is an endpoint
//! with its own cap, and a changed answer is put in force in place: a kept endpoint keeps its connections, a new one
//! takes its share, a vanished one drains; an answer without addresses keeps the last set. The name is answered by
//! a DNS server the test runs (`support::dns`), the endpoints are one counting upstream listening on 127.0.0.1 and
//! 127.0.0.2.

mod support;

use std::net::Ipv4Addr;
use std::time::Duration;

use support::dns::DnsServer;
use support::*;

const WAIT: Duration = Duration::from_secs(15);
const ONE: Ipv4Addr = Ipv4Addr::new(127, 0, 0, 1);
const TWO: Ipv4Addr = Ipv4Addr::new(127, 0, 0, 2);

fn config(dns: &DnsServer, port: u16) -> String {
    format!(
        r#"
[upstreams.a]
endpoints = {{ dns = "app.test", port = {port}, max_connections = 2, interval = "100ms", nameserver = "{}" }}
max_connections = 8
max_queue = 1000
queue_timeout = "30s"

[[routes]]
upstream = "a"
"#,
        dns.addr()
    )
}

/// Each endpoint's address and connections, as `/status` shows them.
async fn endpoints(proxy: &Proxy) -> Vec<(String, u64)> {
    let status = proxy.upstream_status("a").await;
    status["endpoints"]
        .as_array()
        .map(|list| {
            list.iter()
                .map(|endpoint| {
                    (
                        endpoint["address"].as_str().unwrap_or_default().to_string(),
                        endpoint["connections_open"].as_u64().unwrap_or_default(),
                    )
                })
                .collect()
        })
        .unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_changed_answer_is_put_in_force_in_place_and_an_empty_one_keeps_the_last_set() {
    let upstream = Upstream::start_with(UpstreamOptions {
        any_address: true,
        ..UpstreamOptions::default()
    })
    .await;
    let port = upstream.addr().port();
    let at = |ip: Ipv4Addr| format!("{ip}:{port}");
    let dns = DnsServer::start(&[ONE]).await;
    let file = TempConfig::new(&config(&dns, port));
    let proxy = Proxy::start(&["--config", &file.path_str()]).await;
    // Start-up waited for the first answer.
    assert_eq!(endpoints(&proxy).await, [(at(ONE), 0)]);
    assert_eq!(proxy.upstream_field("a", "max_connections").await, 2);

    let load = Load::start(proxy.listen, 8, "/delay/5");
    load.serve_more(100).await;
    assert!(
        upstream.peak_connections() <= 2,
        "{} at one endpoint of cap 2",
        upstream.peak_connections()
    );
    wait_until_sync("the first endpoint's two connections", WAIT, || {
        upstream.connections() == 2
    })
    .await;
    let dialled = upstream.accepted();

    // A second address: it joins with its own cap, and the first keeps its connections.
    dns.set(&[ONE, TWO]);
    wait_until("both endpoints at work", WAIT, || async {
        endpoints(&proxy).await == [(at(ONE), 2), (at(TWO), 2)]
    })
    .await;
    assert_eq!(proxy.upstream_field("a", "max_connections").await, 4);
    assert_eq!(upstream.accepted(), dialled + 2, "only the new endpoint was dialled");
    load.serve_more(100).await;

    // The first address gone: it drains, and only the second is left.
    dns.set(&[TWO]);
    wait_until("only the second endpoint", WAIT, || async {
        endpoints(&proxy)
            .await
            .iter()
            .map(|(address, _)| address.clone())
            .collect::<Vec<_>>()
            == [at(TWO)]
    })
    .await;
    assert_eq!(proxy.upstream_field("a", "max_connections").await, 2);
    load.serve_more(100).await;

    // An answer without addresses keeps the set in force, counted and served on.
    let asked = dns.questions();
    dns.set(&[]);
    wait_until("an empty answer counted", WAIT, || async {
        let samples = parse_metrics(&proxy.metrics().await);
        samples.iter().any(|sample| {
            sample.name == "floodgate_upstream_discovery_failures_total"
                && sample
                    .labels
                    .iter()
                    .any(|(name, value)| name == "upstream" && value == "a")
                && sample.value > 0.0
        })
    })
    .await;
    assert!(dns.questions() > asked);
    assert_eq!(endpoints(&proxy).await.len(), 1);
    load.serve_more(100).await;
    load.finish_without_failures().await;
    assert!(
        upstream.peak_connections() <= 4,
        "{} connections",
        upstream.peak_connections()
    );
}

#[test]
fn discovery_errors_name_their_key() {
    for (table, key) in [
        (r#"dns = "", port = 80, max_connections = 1"#, "endpoints.dns"),
        (r#"dns = "app", port = 0, max_connections = 1"#, "endpoints.port"),
        (
            r#"dns = "app", port = 80, max_connections = 0"#,
            "endpoints.max_connections",
        ),
        (
            r#"dns = "app", port = 80, max_connections = 1, scheme = "ftp""#,
            "endpoints.scheme",
        ),
        (
            r#"dns = "app", port = 80, max_connections = 1, interval = "1ms""#,
            "endpoints.interval",
        ),
    ] {
        let file = TempConfig::new(&format!(
            "[upstreams.a]\nendpoints = {{ {table} }}\n\n[[routes]]\nupstream = \"a\"\n"
        ));
        let (status, _, stderr) = run_to_exit(&["--config", &file.path_str()], Duration::from_secs(10));
        assert!(!status.success(), "{table} was taken");
        assert!(stderr.contains(&format!("upstreams.a.{key}")), "{table}: {stderr}");
    }
}
