//! Traces exported over OTLP (the `otlp` feature): with `otlp_endpoint` set, each request gets a span of floodgate's own (from its arrival to the end of its
//! answer), a child of the trace context its client sent (`traceparent`/`tracestate`, W3C Trace Context), and the
//! request goes upstream carrying that span as its parent, so a trace shows the time spent in floodgate between the
//! client's span and the upstream's. Spans are exported over OTLP/HTTP (protobuf) in batches by the OpenTelemetry
//! SDK's own thread. Off (the default), a request pays one `None` (and one look for the span's marks among its extensions) and its
//! trace headers pass through untouched.

use std::sync::Arc;

use http::{HeaderMap, HeaderName, HeaderValue};
use opentelemetry::propagation::{Extractor, Injector, TextMapPropagator};
use opentelemetry::trace::{SpanKind, TraceContextExt, Tracer as _, TracerProvider as _};
use opentelemetry::{Context, KeyValue};
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::{SdkTracer, SdkTracerProvider};
use opentelemetry_sdk::Resource;

/// The tracer and exporter of a process that exports traces.
pub(crate) struct Tracing {
    provider: SdkTracerProvider,
    tracer: SdkTracer,
    propagator: TraceContextPropagator,
}

impl Tracing {
    /// Exports to `endpoint` (an OTLP/HTTP traces URL, `http://collector:4318/v1/traces`) as `service_name`.
    pub(crate) fn start(endpoint: &str, service_name: &str) -> Result<Arc<Tracing>, String> {
        use opentelemetry_otlp::WithExportConfig;
        let exporter = opentelemetry_otlp::SpanExporter::builder()
            .with_http()
            .with_endpoint(endpoint)
            .build()
            .map_err(|err| err.to_string())?;
        let provider = SdkTracerProvider::builder()
            .with_batch_exporter(exporter)
            .with_resource(Resource::builder().with_service_name(service_name.to_string()).build())
            .build();
        let tracer = provider.tracer("floodgate");
        Ok(Arc::new(Tracing {
            provider,
            tracer,
            propagator: TraceContextPropagator::new(),
        }))
    }

    /// Starts the span of `request` from `client` (`route`: its upstream and route label, when it has one), a child
    /// of the context its headers carry; puts the span in them for the upstream to see as its parent, and its marks
    /// (see [`Marks`]) in the request's extensions for the exchange.
    pub(crate) fn request<B>(
        &self,
        request: &mut http::Request<B>,
        client: std::net::IpAddr,
        route: Option<(&str, &str)>,
    ) -> RequestSpan {
        let method = request.method().to_string();
        let name = match route {
            Some((_, label)) => format!("{method} {label}"),
            None => method.clone(),
        };
        let mut attributes = vec![
            KeyValue::new("http.request.method", method),
            KeyValue::new("url.path", request.uri().path().to_string()),
            KeyValue::new("client.address", client.to_string()),
        ];
        if let Some((upstream, label)) = route {
            attributes.push(KeyValue::new("http.route", label.to_string()));
            attributes.push(KeyValue::new("floodgate.upstream", upstream.to_string()));
        }
        let parent = self.propagator.extract(&Headers(request.headers()));
        let span = self
            .tracer
            .span_builder(name)
            .with_kind(SpanKind::Server)
            .with_attributes(attributes)
            .start_with_context(&self.tracer, &parent);
        let context = parent.with_span(span);
        self.propagator
            .inject_context(&context, &mut HeadersMut(request.headers_mut()));
        request.extensions_mut().insert(Marks(context.clone()));
        RequestSpan(context)
    }
}

/// A request's span, as the exchange on the upstream side marks its steps on it (a request extension).
#[derive(Clone)]
pub(crate) struct Marks(Context);

impl Marks {
    /// The request left the queue after `waited`: the rest of the span is the exchange with the upstream.
    pub(crate) fn admitted(&self, waited: std::time::Duration) {
        let waited = i64::try_from(waited.as_micros()).unwrap_or(i64::MAX);
        self.0
            .span()
            .add_event("admitted", vec![KeyValue::new("floodgate.queue.duration_us", waited)]);
    }

    /// The upstream's answer head came.
    pub(crate) fn answered(&self) {
        self.0.span().add_event("upstream answered", Vec::new());
    }
}

impl Drop for Tracing {
    fn drop(&mut self) {
        // The spans still in the batch go out before the process ends.
        let _ = self.provider.shutdown();
    }
}

/// A request's span, ended when it is dropped (with its answer).
pub(crate) struct RequestSpan(Context);

impl RequestSpan {
    /// Its trace ID and span ID in hex, as W3C Trace Context writes them: what an access line is joined by.
    pub(crate) fn ids(&self) -> (String, String) {
        let span = self.0.span();
        let context = span.span_context();
        (context.trace_id().to_string(), context.span_id().to_string())
    }

    pub(crate) fn set_status(&self, status: http::StatusCode) {
        let span = self.0.span();
        span.set_attribute(KeyValue::new("http.response.status_code", i64::from(status.as_u16())));
        if status.is_server_error() {
            span.set_status(opentelemetry::trace::Status::error(status.as_str().to_string()));
        }
    }
}

impl Drop for RequestSpan {
    fn drop(&mut self) {
        self.0.span().end();
    }
}

struct Headers<'a>(&'a HeaderMap);

impl Extractor for Headers<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|value| value.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(HeaderName::as_str).collect()
    }
}

struct HeadersMut<'a>(&'a mut HeaderMap);

impl Injector for HeadersMut<'_> {
    fn set(&mut self, key: &str, value: String) {
        if let (Ok(name), Ok(value)) = (HeaderName::from_bytes(key.as_bytes()), HeaderValue::from_str(&value)) {
            self.0.insert(name, value);
        }
    }
}
