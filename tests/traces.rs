//! Traces: with `otlp_endpoint`, floodgate's own span of a request is exported over OTLP/HTTP to an in-process
//! receiver, a child of the client's `traceparent`, and the upstream sees that span as its parent.

mod support;

use std::time::Duration;

use bytes::Bytes;
use http::StatusCode;
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::trace::v1::Span;
use prost::Message;
use support::*;
use tokio::net::TcpListener;
use tokio::sync::mpsc;

/// An OTLP/HTTP receiver: every span of every export it is sent.
async fn receiver() -> (std::net::SocketAddr, mpsc::UnboundedReceiver<Span>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (spans, received) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                return;
            };
            let spans = spans.clone();
            tokio::spawn(async move {
                let service = hyper::service::service_fn(move |request: http::Request<hyper::body::Incoming>| {
                    let spans = spans.clone();
                    async move {
                        assert_eq!(request.uri().path(), "/v1/traces");
                        let body = request.into_body().collect().await.unwrap().to_bytes();
                        let export = ExportTraceServiceRequest::decode(body).expect("an OTLP export");
                        for resource in export.resource_spans {
                            for scope in resource.scope_spans {
                                for span in scope.spans {
                                    let _ = spans.send(span);
                                }
                            }
                        }
                        Ok::<_, std::convert::Infallible>(http::Response::new(Full::new(Bytes::new())))
                    }
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    (addr, received)
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn floodgates_span_is_exported_as_the_childs_of_the_clients_and_the_parent_the_upstream_sees() {
    let (collector, mut spans) = receiver().await;
    let upstream = Upstream::start().await;
    let endpoint = format!("http://{collector}/v1/traces");
    let proxy = Proxy::start_with_env(
        &["--upstream", &upstream.url(), "--log-format", "json"],
        &[
            ("FLOODGATE__OTLP_ENDPOINT", &endpoint),
            ("FLOODGATE__OTLP_SERVICE_NAME", "gateway"),
            ("FLOODGATE__ACCESS_LOG", "stdout"),
            // The batch goes out every 100 ms rather than every 5 s.
            ("OTEL_BSP_SCHEDULE_DELAY", "100"),
        ],
    )
    .await;
    let trace = "4bf92f3577b34da6a3ce929d0e0e4736";
    let client_span = "00f067aa0ba902b7";
    let mut conn = H1Conn::connect(proxy.listen).await;
    let request = http::Request::get("/traced")
        .header("traceparent", format!("00-{trace}-{client_span}-01"))
        .header("tracestate", "vendor=1")
        .body(body_empty())
        .unwrap();
    assert_eq!(
        collect(conn.send(request).await.unwrap()).await.unwrap().status,
        StatusCode::OK
    );

    let span = tokio::time::timeout(Duration::from_secs(10), spans.recv())
        .await
        .expect("no span exported within 10 s")
        .unwrap();
    assert_eq!(hex(&span.trace_id), trace, "the client's trace");
    assert_eq!(
        hex(&span.parent_span_id),
        client_span,
        "the client's span is its parent"
    );
    assert_eq!(span.name, "GET *");
    assert!(span.end_time_unix_nano > span.start_time_unix_nano);
    let attribute = |key: &str| {
        span.attributes
            .iter()
            .find(|kv| kv.key == key)
            .and_then(|kv| kv.value.as_ref())
            .map(|value| format!("{:?}", value.value))
    };
    assert!(
        attribute("http.response.status_code").is_some_and(|v| v.contains("200")),
        "{:?}",
        span.attributes
    );
    assert!(
        attribute("floodgate.upstream").is_some_and(|v| v.contains("default")),
        "{:?}",
        span.attributes
    );
    // The queue wait and the exchange, marked on it.
    let events: Vec<&str> = span.events.iter().map(|event| event.name.as_str()).collect();
    assert_eq!(events, ["admitted", "upstream answered"], "{:?}", span.events);
    assert!(span.events[0]
        .attributes
        .iter()
        .any(|kv| kv.key == "floodgate.queue.duration_us"));
    assert!(span.events[0].time_unix_nano <= span.events[1].time_unix_nano);

    // The upstream's parent is floodgate's span, in the same trace, with the client's trace state.
    let seen = upstream.recorded().into_iter().find(|r| r.path() == "/traced").unwrap();
    let parent = seen.header("traceparent").expect("a traceparent upstream");
    assert_eq!(parent, format!("00-{trace}-{}-01", hex(&span.span_id)));
    assert_eq!(seen.header("tracestate"), Some("vendor=1"));

    // The access line names the same trace and span, to be joined to it.
    let lines = proxy.access_lines(1).await;
    assert_eq!(lines[0]["trace_id"], trace, "{}", lines[0]);
    assert_eq!(lines[0]["span_id"], hex(&span.span_id), "{}", lines[0]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_otlp_endpoint_trace_headers_pass_through_untouched() {
    let upstream = Upstream::start().await;
    let proxy = Proxy::for_upstream(&upstream, 1, &[]).await;
    let parent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    let mut conn = H1Conn::connect(proxy.listen).await;
    let request = http::Request::get("/untraced")
        .header("traceparent", parent)
        .body(body_empty())
        .unwrap();
    assert_eq!(
        collect(conn.send(request).await.unwrap()).await.unwrap().status,
        StatusCode::OK
    );
    let seen = upstream
        .recorded()
        .into_iter()
        .find(|r| r.path() == "/untraced")
        .unwrap();
    assert_eq!(seen.header("traceparent"), Some(parent));
}

#[test]
fn an_otlp_endpoint_that_is_not_an_http_url_stops_start_up_naming_the_key() {
    for endpoint in ["https://collector:4318/v1/traces", "collector:4318", "not a url"] {
        let (status, _, stderr) = run_to_exit_with_env(
            &["check", "--upstream", "http://127.0.0.1:9"],
            &[("FLOODGATE__OTLP_ENDPOINT", endpoint)],
            Duration::from_secs(10),
        );
        assert_eq!(status.code(), Some(2), "{endpoint}: {stderr}");
        assert!(
            stderr.contains("invalid configuration: otlp_endpoint"),
            "{endpoint}: {stderr}"
        );
    }
}
