//! The request's tracing span as a program embedding floodgate sees it, through its own tracing layer: one span
//! per request carrying its ID, route, upstream and outcome, open until the response's last byte.

mod support;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::LazyLock;
use std::time::Duration;

use floodgate::config::{Config, Env, Overrides};
use floodgate::server::Floodgate;
use http::StatusCode;
use http_body_util::BodyExt;
use support::*;
use tokio::sync::watch;
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing::Subscriber;
use tracing_subscriber::layer::{Context, SubscriberExt};
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::Layer;

type Fields = HashMap<String, String>;

/// Every `request` span closed so far, with its fields as recorded over its life.
static CLOSED: LazyLock<watch::Sender<Vec<Fields>>> = LazyLock::new(|| watch::Sender::new(Vec::new()));

struct Capture;

struct Visitor<'a>(&'a mut Fields);

impl Visit for Visitor<'_> {
    fn record_str(&mut self, field: &Field, value: &str) {
        self.0.insert(field.name().to_owned(), value.to_owned());
    }

    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        self.0.insert(field.name().to_owned(), format!("{value:?}"));
    }
}

impl<S: Subscriber + for<'a> LookupSpan<'a>> Layer<S> for Capture {
    fn on_new_span(&self, attrs: &Attributes<'_>, id: &Id, ctx: Context<'_, S>) {
        let mut fields = Fields::new();
        attrs.record(&mut Visitor(&mut fields));
        if let Some(span) = ctx.span(id) {
            span.extensions_mut().insert(fields);
        }
    }

    fn on_record(&self, id: &Id, values: &Record<'_>, ctx: Context<'_, S>) {
        if let Some(span) = ctx.span(id) {
            if let Some(fields) = span.extensions_mut().get_mut::<Fields>() {
                values.record(&mut Visitor(fields));
            }
        }
    }

    fn on_close(&self, id: Id, ctx: Context<'_, S>) {
        let Some(span) = ctx.span(&id) else { return };
        if span.name() != "request" {
            return;
        }
        let fields = span.extensions_mut().remove::<Fields>();
        if let Some(fields) = fields {
            CLOSED.send_modify(|closed| closed.push(fields));
        }
    }
}

/// The closed `request` span whose ID is `id`, once it has closed.
async fn closed_span(id: &str) -> Fields {
    let mut closed = CLOSED.subscribe();
    let found = tokio::time::timeout(
        Duration::from_secs(10),
        closed.wait_for(|spans| spans.iter().any(|span| span.get("id").map(String::as_str) == Some(id))),
    )
    .await
    .unwrap_or_else(|_| panic!("no closed span for request {id}: {:?}", *CLOSED.borrow()))
    .unwrap_or_else(|_| unreachable!("CLOSED is never dropped"));
    found
        .iter()
        .find(|span| span.get("id").map(String::as_str) == Some(id))
        .cloned()
        .unwrap_or_default()
}

fn is_closed(id: &str) -> bool {
    CLOSED
        .borrow()
        .iter()
        .any(|span| span.get("id").map(String::as_str) == Some(id))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_requests_span_carries_route_upstream_and_outcome_and_stays_open_until_the_last_byte() {
    tracing::subscriber::set_global_default(tracing_subscriber::registry().with(Capture))
        .unwrap_or_else(|_| panic!("another subscriber is installed"));
    let upstream = Upstream::start().await;
    let mut flags = Overrides::default();
    flags.upstream.upstream = Some(upstream.url());
    flags.upstream.max_connections = Some(1);
    flags.upstream.max_queue = Some(0);
    // Bodies stream as they come rather than being read whole before the head goes out.
    flags.upstream.buffer_response_bytes = Some(0);
    flags.global.listen = Some(SocketAddr::from(([127, 0, 0, 1], 0)));
    flags.global.admin = Some(SocketAddr::from(([127, 0, 0, 1], 0)));
    let config = Config::load(None, &Env::none(), &flags).unwrap_or_else(|e| panic!("{e}"));
    let floodgate = Floodgate::bind(config).await.unwrap_or_else(|e| panic!("{e}"));
    let listen = floodgate.listen_addr();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(floodgate.run(async move {
        let _ = stopped.await;
    }));

    // A response whose body stalls halfway: its head has reached the client, its last byte has not.
    let mut conn = H1Conn::connect(listen).await;
    let request = http::Request::get("/stall-body/1000").body(body_empty()).unwrap();
    let mut streaming = conn.send(request).await.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(streaming.status(), StatusCode::OK);
    let streaming_id = streaming.headers()["x-request-id"]
        .to_str()
        .unwrap_or_default()
        .to_owned();
    let first = streaming.body_mut().frame().await;
    let first_bytes = first
        .and_then(|frame| frame.ok())
        .and_then(|frame| frame.into_data().ok())
        .map_or(0, |data| data.len());
    assert!(first_bytes > 0, "the body's first half did not arrive");

    // The only slot is held and there is no queue: the next request is shed, and its span closes with the answer.
    let shed = get(listen, "/").await;
    assert_eq!(shed.status, StatusCode::SERVICE_UNAVAILABLE);
    let shed_id = shed.header("x-request-id").unwrap_or_default().to_owned();
    let span = closed_span(&shed_id).await;
    assert_eq!(
        span.get("outcome").map(String::as_str),
        Some("shed_queue_full"),
        "{span:?}"
    );
    assert_eq!(span.get("route").map(String::as_str), Some("*"), "{span:?}");
    assert_eq!(span.get("upstream").map(String::as_str), Some("default"), "{span:?}");
    assert!(
        !is_closed(&streaming_id),
        "the streaming request's span closed before its last byte"
    );

    upstream.release_stalled();
    let body = streaming.into_body().collect().await.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        first_bytes + body.to_bytes().len(),
        2000,
        "the body did not arrive whole"
    );
    let span = closed_span(&streaming_id).await;
    assert_eq!(span.get("outcome").map(String::as_str), Some("ok"), "{span:?}");
    assert_eq!(span.get("route").map(String::as_str), Some("*"), "{span:?}");
    assert_eq!(span.get("upstream").map(String::as_str), Some("default"), "{span:?}");

    let _ = stop.send(());
    server
        .await
        .unwrap_or_else(|e| panic!("{e}"))
        .unwrap_or_else(|e| panic!("{e}"));
}
