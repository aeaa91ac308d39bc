//! Fair sharing and priority classes through the real binary: a greedy client waits behind its own requests,
//! a client over its quota gets 429, and a higher class is served first.

mod support;

use std::net::SocketAddr;
use std::time::Duration;

use http::{Method, Request, StatusCode};
use support::*;
use tokio::net::TcpSocket;
use tokio::task::JoinHandle;

const WAIT: Duration = Duration::from_secs(10);

/// Upstream `a` with one connection and `extra` lines, behind `routes` (TOML) or a catch-all.
fn config(url: &str, extra: &str, routes: &str) -> String {
    let routes = if routes.is_empty() {
        "[[routes]]\nupstream = \"a\"\n"
    } else {
        routes
    };
    format!("[upstreams.a]\nurl = \"{url}\"\nmax_connections = 1\nqueue_timeout = \"30s\"\n{extra}\n\n{routes}")
}

/// A GET from `from` (a loopback address of its own) with `headers`.
async fn request(addr: SocketAddr, from: &str, path: String, headers: Vec<(&'static str, String)>) -> Resp {
    let socket = TcpSocket::new_v4().unwrap();
    socket.bind(format!("{from}:0").parse().unwrap()).unwrap();
    let stream = socket.connect(addr).await.unwrap();
    let mut conn = H1Conn::over(stream, addr).await.unwrap();
    let mut builder = Request::builder().method(Method::GET).uri(path);
    for (name, value) in headers {
        builder = builder.header(name, value);
    }
    let resp = conn.send(builder.body(body_empty()).unwrap()).await.unwrap();
    collect(resp).await.unwrap()
}

struct Client {
    from: &'static str,
    header: Option<(&'static str, &'static str)>,
}

impl Client {
    fn send(&self, proxy: &Proxy, path: String) -> JoinHandle<Resp> {
        let headers = self
            .header
            .iter()
            .map(|(name, value)| (*name, value.to_string()))
            .collect();
        tokio::spawn(request(proxy.listen, self.from, path, headers))
    }
}

/// Holds the only slot with a stalled request.
async fn hold_the_slot(proxy: &Proxy, upstream: &Upstream) -> JoinHandle<Resp> {
    let held = Client {
        from: "127.0.0.1",
        header: None,
    }
    .send(proxy, "/stall".to_string());
    wait_until_sync("the slot held", WAIT, || upstream.inflight() == 1).await;
    held
}

/// Queues `client`'s requests for `paths`, each in the queue before the next.
async fn queue(proxy: &Proxy, client: &Client, paths: &[&str]) -> Vec<JoinHandle<Resp>> {
    let mut queued = Vec::new();
    for path in paths {
        let depth = proxy.upstream_field("a", "queue_depth").await;
        queued.push(client.send(proxy, path.to_string()));
        proxy.wait_queue_depth("a", depth + 1, WAIT).await;
    }
    queued
}

/// Releases the held slot, waits for every queued answer, and gives the order the upstream served paths in.
async fn release_and_order(
    upstream: &Upstream,
    held: JoinHandle<Resp>,
    queued: Vec<JoinHandle<Resp>>,
) -> (Vec<String>, Vec<Resp>) {
    upstream.release_stalled();
    assert_eq!(held.await.unwrap().status, StatusCode::OK);
    let mut answers = Vec::new();
    for request in queued {
        answers.push(request.await.unwrap());
    }
    let order = upstream
        .recorded()
        .into_iter()
        .map(|r| r.path().to_string())
        .filter(|path| path != "/stall")
        .collect();
    (order, answers)
}

const GREEDY: Client = Client {
    from: "127.0.0.2",
    header: Some(("x-api-key", "greedy")),
};
const POLITE: Client = Client {
    from: "127.0.0.3",
    header: Some(("x-api-key", "polite")),
};

#[tokio::test]
async fn with_fair_sharing_a_polite_client_waits_behind_one_greedy_request_not_all_of_them() {
    let greedy_paths = ["/g1", "/g2", "/g3", "/g4"];
    for (fair_key, expected) in [
        ("", vec!["/g1", "/g2", "/g3", "/g4", "/p1"]),
        ("header:x-api-key", vec!["/g1", "/p1", "/g2", "/g3", "/g4"]),
        ("client_ip", vec!["/g1", "/p1", "/g2", "/g3", "/g4"]),
    ] {
        let upstream = Upstream::start().await;
        let file = TempConfig::new(&config(&upstream.url(), &format!("fair_key = \"{fair_key}\""), ""));
        let proxy = Proxy::start(&["--config", &file.path_str()]).await;
        let held = hold_the_slot(&proxy, &upstream).await;
        let mut queued = queue(&proxy, &GREEDY, &greedy_paths).await;
        queued.extend(queue(&proxy, &POLITE, &["/p1"]).await);
        let (order, answers) = release_and_order(&upstream, held, queued).await;
        assert!(answers.iter().all(|r| r.status == StatusCode::OK), "{fair_key:?}");
        assert_eq!(order, expected, "fair_key = {fair_key:?}");
    }
}

#[tokio::test]
async fn weights_give_a_key_that_many_turns_in_a_row() {
    let upstream = Upstream::start().await;
    let file = TempConfig::new(&config(
        &upstream.url(),
        "fair_key = \"header:x-api-key\"\nfair_weights = { greedy = 2 }",
        "",
    ));
    let proxy = Proxy::start(&["--config", &file.path_str()]).await;
    let held = hold_the_slot(&proxy, &upstream).await;
    let mut queued = queue(&proxy, &GREEDY, &["/g1", "/g2", "/g3", "/g4"]).await;
    queued.extend(queue(&proxy, &POLITE, &["/p1", "/p2"]).await);
    let (order, _) = release_and_order(&upstream, held, queued).await;
    assert_eq!(order, ["/g1", "/g2", "/p1", "/g3", "/g4", "/p2"]);
}

#[tokio::test]
async fn a_client_over_its_queue_quota_gets_429_while_others_still_queue() {
    let upstream = Upstream::start().await;
    let file = TempConfig::new(&config(
        &upstream.url(),
        "fair_key = \"header:x-api-key\"\nfair_max_queue = 2",
        "",
    ));
    let proxy = Proxy::start(&["--config", &file.path_str()]).await;
    let held = hold_the_slot(&proxy, &upstream).await;
    let queued = queue(&proxy, &GREEDY, &["/g1", "/g2"]).await;
    let over = GREEDY.send(&proxy, "/g3".to_string()).await.unwrap();
    assert_eq!(over.status, StatusCode::TOO_MANY_REQUESTS, "{}", over.text());
    assert_eq!(over.header("x-floodgate-shed-reason"), Some("quota"));
    assert!(over.header("retry-after").is_some());
    let mut queued = queued;
    queued.extend(queue(&proxy, &POLITE, &["/p1"]).await);
    let (order, answers) = release_and_order(&upstream, held, queued).await;
    assert!(answers.iter().all(|r| r.status == StatusCode::OK));
    assert_eq!(order, ["/g1", "/p1", "/g2"]);
    assert_eq!(proxy.outcome_count("a", "shed_quota").await, 1.0);
}

#[tokio::test]
async fn a_higher_priority_class_is_served_first_from_a_header_or_its_route() {
    let upstream = Upstream::start().await;
    let routes =
        "[[routes]]\nupstream = \"a\"\n\n[[routes]]\npath_prefix = \"/urgent\"\nupstream = \"a\"\npriority = 5\n";
    let file = TempConfig::new(&config(&upstream.url(), "priority_header = \"x-priority\"", routes));
    let proxy = Proxy::start(&["--config", &file.path_str()]).await;
    let held = hold_the_slot(&proxy, &upstream).await;
    let plain = Client {
        from: "127.0.0.1",
        header: None,
    };
    let flagged = Client {
        from: "127.0.0.1",
        header: Some(("x-priority", "7")),
    };
    let bogus = Client {
        from: "127.0.0.1",
        header: Some(("x-priority", "high")),
    };
    let mut queued = queue(&proxy, &plain, &["/low1", "/low2"]).await;
    queued.extend(queue(&proxy, &bogus, &["/low3"]).await);
    queued.extend(queue(&proxy, &plain, &["/urgent/1"]).await);
    queued.extend(queue(&proxy, &flagged, &["/flagged"]).await);
    let (order, _) = release_and_order(&upstream, held, queued).await;
    assert_eq!(order, ["/flagged", "/urgent/1", "/low1", "/low2", "/low3"]);

    let samples = parse_metrics(&proxy.metrics().await);
    let waited = |class: &str| {
        metric_sum(
            &samples,
            "floodgate_queue_wait_by_class_seconds_count",
            &[("upstream", "a"), ("class", class)],
        )
    };
    assert_eq!(waited("7"), 1.0);
    assert_eq!(waited("5"), 1.0);
    // The held request and the three plain ones.
    assert_eq!(waited("0"), 4.0);
}

#[test]
fn bad_fairness_settings_stop_start_up_naming_the_key() {
    for (line, key) in [
        ("fair_key = \"cookie\"", "upstreams.a.fair_key"),
        ("fair_key = \"header:bad name\"", "upstreams.a.fair_key"),
        ("fair_weights = { x = 0 }", "upstreams.a.fair_weights.x"),
        ("quota_status = 302", "upstreams.a.quota_status"),
        ("priority_header = \"a b\"", "upstreams.a.priority_header"),
    ] {
        pki::assert_refused(&config("http://127.0.0.1:9", line, ""), key);
    }
    let routes = "[[routes]]\nupstream = \"a\"\npriority = 10\n";
    pki::assert_refused(&config("http://127.0.0.1:9", "", routes), "routes[0].priority");
}

#[tokio::test]
async fn behind_a_trusted_proxy_the_client_is_the_address_that_proxy_saw_not_what_the_client_wrote() {
    let upstream = Upstream::start().await;
    let file = TempConfig::new(&format!(
        "trusted_proxies = [\"127.0.0.4/32\"]\n{}",
        config(&upstream.url(), "fair_key = \"client_ip\"\nfair_max_queue = 2", "")
    ));
    let proxy = Proxy::start(&["--config", &file.path_str()]).await;
    let held = hold_the_slot(&proxy, &upstream).await;
    // The load balancer (127.0.0.4) appends the address it saw; the client made up whatever came before.
    let via_balancer = |forwarded: &str, path: &str| {
        tokio::spawn(request(
            proxy.listen,
            "127.0.0.4",
            path.to_string(),
            vec![("x-forwarded-for", forwarded.to_string())],
        ))
    };
    let mut queued = Vec::new();
    for (depth, spoofed) in ["1.1.1.1", "2.2.2.2"].iter().enumerate() {
        queued.push(via_balancer(
            &format!("{spoofed}, 10.0.0.1"),
            &format!("/greedy{depth}"),
        ));
        proxy.wait_queue_depth("a", depth as u64 + 1, WAIT).await;
    }
    let over = via_balancer("3.3.3.3, 10.0.0.1", "/greedy2").await.unwrap();
    assert_eq!(
        over.status,
        StatusCode::TOO_MANY_REQUESTS,
        "a made-up address is not a new client"
    );
    queued.push(via_balancer("10.0.0.2", "/other"));
    proxy.wait_queue_depth("a", 3, WAIT).await;
    let (order, answers) = release_and_order(&upstream, held, queued).await;
    assert!(answers.iter().all(|r| r.status == StatusCode::OK));
    assert_eq!(order, ["/greedy0", "/other", "/greedy1"]);
}
