//! The trace types of a build without the `otlp` feature: uninhabited, so that the code that would use them
//! compiles unchanged and none of it can run.

use std::sync::Arc;

/// Never made: [`Tracing::start`] refuses.
pub(crate) enum Tracing {}

impl Tracing {
    pub(crate) fn start(_endpoint: &str, _service_name: &str) -> Result<Arc<Tracing>, String> {
        Err("this floodgate was built without the `otlp` feature".to_string())
    }

    pub(crate) fn request<B>(
        &self,
        _request: &mut http::Request<B>,
        _client: std::net::IpAddr,
        _route: Option<(&str, &str)>,
    ) -> RequestSpan {
        match *self {}
    }
}

/// Never made: there is no [`Tracing`] to make one.
#[derive(Clone)]
pub(crate) enum Marks {}

impl Marks {
    pub(crate) fn admitted(&self, _waited: std::time::Duration) {
        match *self {}
    }

    pub(crate) fn answered(&self) {
        match *self {}
    }
}

/// Never made: there is no [`Tracing`] to make one.
pub(crate) enum RequestSpan {}

impl RequestSpan {
    pub(crate) fn ids(&self) -> (String, String) {
        match *self {}
    }

    pub(crate) fn set_status(&self, _status: http::StatusCode) {
        match *self {}
    }
}
