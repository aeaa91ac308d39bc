//! One request's record: made when the request arrives, noted on as it goes (routed, admitted, answered, body
//! bytes handed on), and finished once, when its answer's body ends or the request is abandoned. Finishing counts
//! the outcome, writes the access-log line, records the outcome on the request's span, observes the route's time
//! and bytes, ends the exported span and ends the request's in-flight mark on its client connection: every
//! request the proxy answers, or loses to its client, is finished exactly once, by its answer or by being dropped
//! (a client abort). It never answers, forwards or admits anything.

use std::sync::Arc;
use std::time::Instant;

use http::StatusCode;

use crate::access::Entry;
use crate::activity::InFlight;
use crate::error::Outcome;
use crate::metrics::{Metrics, RouteMetrics};
use crate::pool::UpstreamPool;
use crate::trace::RequestSpan;

/// What is known of one request until it ends; dropped unfinished, it ends as a client abort.
pub(crate) struct Record {
    /// Where an outcome is counted before the request has an upstream (`client_side`).
    metrics: Arc<Metrics>,
    /// Its upstream, once routed: its outcome is counted there.
    pool: Option<Arc<UpstreamPool>>,
    /// Its route's time and bytes as the client sees them, once routed.
    route: Option<RouteMetrics>,
    arrived: Instant,
    status: Option<StatusCode>,
    /// Body bytes handed on to the client.
    bytes: u64,
    /// Present only while the access log is on.
    access: Option<Box<Entry>>,
    /// The request's span, on which the outcome is recorded.
    span: tracing::Span,
    /// The request's exported span (with `otlp_endpoint`), ended with the record.
    exported: Option<RequestSpan>,
    /// The request's mark on its client connection (hyper's HTTP/2 server), ended with the record.
    in_flight: Option<InFlight>,
    finished: bool,
    /// A gRPC call (`content-type: application/grpc…`): floodgate's own answers to it are gRPC's.
    grpc: bool,
}

impl Record {
    pub(crate) fn open(metrics: Arc<Metrics>, in_flight: Option<InFlight>) -> Self {
        Record {
            metrics,
            pool: None,
            route: None,
            arrived: Instant::now(),
            status: None,
            bytes: 0,
            access: None,
            span: tracing::Span::none(),
            exported: None,
            in_flight,
            finished: false,
            grpc: false,
        }
    }

    /// The request is a gRPC call: a shed is answered in gRPC's terms.
    pub(crate) fn is_grpc_call(&mut self) {
        self.grpc = true;
    }

    pub(crate) fn grpc(&self) -> bool {
        self.grpc
    }

    /// The access-log entry (made once the target is resolved, so the line shows the path that went upstream),
    /// the request's span and its exported one.
    pub(crate) fn described(&mut self, access: Option<Box<Entry>>, span: tracing::Span, exported: Option<RequestSpan>) {
        self.access = access;
        self.span = span;
        self.exported = exported;
    }

    /// Its upstream and route are known: its outcome is counted there.
    pub(crate) fn routed(&mut self, pool: Arc<UpstreamPool>, route: RouteMetrics, label: &Arc<str>) {
        if let Some(entry) = self.access.as_mut() {
            entry.routed(&pool.name, label);
        }
        self.pool = Some(pool);
        self.route = Some(route);
    }

    /// Its upstream, once routed.
    pub(crate) fn pool(&self) -> Option<&UpstreamPool> {
        self.pool.as_deref()
    }

    /// The request left the queue at `at`.
    pub(crate) fn admitted(&mut self, at: Option<Instant>) {
        if let (Some(entry), Some(at)) = (self.access.as_mut(), at) {
            entry.admitted_at(at);
        }
    }

    /// With the access log on, a counter the request body's bytes are counted in for the line.
    pub(crate) fn request_body_counter(&mut self) -> Option<prometheus_client::metrics::counter::Counter> {
        self.access.as_mut().map(|entry| entry.request_body_counter())
    }

    /// The answer's status, as the client gets it.
    pub(crate) fn answered(&mut self, status: StatusCode) {
        self.status = Some(status);
    }

    /// The answer's head fields, for the header fields the access log captures.
    pub(crate) fn answered_with(&mut self, headers: &http::HeaderMap) {
        if let Some(entry) = self.access.as_mut() {
            entry.answered_with(headers);
        }
    }

    /// Body bytes handed on to the client.
    pub(crate) fn relayed(&mut self, bytes: usize) {
        self.bytes += bytes as u64;
    }

    pub(crate) fn is_finished(&self) -> bool {
        self.finished
    }

    /// The request is over with `outcome`; a second call does nothing.
    pub(crate) fn finish(&mut self, outcome: Outcome) {
        if let Some(entry) = self.close(outcome) {
            entry.write(outcome, self.status, self.bytes);
        }
    }

    /// A `101` switched the request to a tunnel: counted now, as the request's answer; its access-log entry goes to
    /// the tunnel, whose line is written when it ends.
    pub(crate) fn switched(&mut self, status: StatusCode) -> Option<Box<Entry>> {
        self.status = Some(status);
        self.close(Outcome::Ok)
    }

    /// The mark of a request that becomes a tunnel: the tunnel holds it for its life, not the answer.
    pub(crate) fn take_in_flight(&mut self) -> Option<InFlight> {
        self.in_flight.take()
    }

    /// Everything but the access-log line, which is handed back.
    fn close(&mut self, outcome: Outcome) -> Option<Box<Entry>> {
        if std::mem::replace(&mut self.finished, true) {
            return None;
        }
        match &self.pool {
            Some(pool) => pool.metrics.requests.record(outcome, self.status),
            None => self.metrics.client_side(outcome, self.status),
        }
        self.span.record("outcome", tracing::field::display(outcome.as_str()));
        // A request that got no answer (its client left first) is no sample of the route's answers.
        if let (Some(route), Some(_)) = (&self.route, self.status) {
            route.duration.observe(self.arrived.elapsed().as_secs_f64());
            route.response_bytes.inc_by(self.bytes);
        }
        if let (Some(exported), Some(status)) = (self.exported.take(), self.status) {
            exported.set_status(status);
        }
        self.in_flight = None;
        self.access.take()
    }
}

impl Drop for Record {
    fn drop(&mut self) {
        self.finish(Outcome::ClientAbort);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn counted(metrics: &Metrics) -> Vec<(Outcome, u64)> {
        metrics.client_side_counters().totals().collect()
    }

    #[test]
    fn a_record_dropped_unfinished_counts_one_client_abort() {
        let metrics = Arc::new(Metrics::new());
        drop(Record::open(metrics.clone(), None));
        assert_eq!(counted(&metrics), vec![(Outcome::ClientAbort, 1)]);
    }

    #[test]
    fn a_record_is_finished_once_whatever_comes_after() {
        let metrics = Arc::new(Metrics::new());
        let mut record = Record::open(metrics.clone(), None);
        record.answered(StatusCode::INTERNAL_SERVER_ERROR);
        record.finish(Outcome::Internal);
        assert!(record.is_finished());
        record.finish(Outcome::Ok);
        assert!(record.switched(StatusCode::SWITCHING_PROTOCOLS).is_none());
        drop(record);
        assert_eq!(counted(&metrics), vec![(Outcome::Internal, 1)]);
    }

    /// The proxy keeps a request's record outside the future that serves it, so a panic in that future leaves
    /// the record to be finished by the `500` that answers it.
    #[tokio::test]
    async fn a_record_outlives_a_panicking_future_and_is_finished_by_its_answer() {
        use futures_util::FutureExt;
        let metrics = Arc::new(Metrics::new());
        let mut record = Record::open(metrics.clone(), None);
        let bug = std::hint::black_box(true);
        let serving = async {
            record.answered(StatusCode::OK);
            assert!(!bug, "a bug in floodgate's own code");
        };
        let served = std::panic::AssertUnwindSafe(serving).catch_unwind().await;
        assert!(served.is_err());
        assert!(!record.is_finished());
        record.finish(Outcome::Internal);
        drop(record);
        assert_eq!(counted(&metrics), vec![(Outcome::Internal, 1)]);
    }
}
