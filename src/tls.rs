//! TLS termination on the client listener: the certificate chain and key named by `tls_cert` / `tls_key`, read
//! into a rustls server configuration that offers ALPN `h2` and `http/1.1`.
//!
//! Owns reading and checking the PEM files, and the wording of what is wrong with them: each problem names the
//! key whose file is at fault and never quotes the file, so a private key cannot reach a terminal or a log.
//! The crypto provider is *ring*: it builds with the Rust toolchain and a C compiler alone, where aws-lc-rs
//! needs cmake (and, on some targets, clang) on the build machine.

use std::path::Path;
use std::sync::Arc;

use rustls::ServerConfig;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};

use crate::config::ConfigError;

/// What the listener negotiates, most preferred first; the client's pick decides HTTP/2 or HTTP/1.
pub const ALPN_H2: &[u8] = b"h2";
pub const ALPN_HTTP1: &[u8] = b"http/1.1";

/// The listener's TLS configuration from the whole configuration, certificates read now; `None` when TLS is off.
pub fn listener_config(config: &crate::config::Config) -> Result<Option<Arc<ServerConfig>>, ConfigError> {
    match (&config.tls_cert, &config.tls_key) {
        (Some(cert), Some(key)) => server_config(cert, key).map(Some),
        // Validation refuses one without the other.
        _ => Ok(None),
    }
}

/// Reads `cert` (a PEM chain, leaf first) and `key` (a PEM private key: PKCS#8, PKCS#1 or SEC1) and builds the
/// listener's TLS configuration. Each error names `tls_cert` or `tls_key`.
pub fn server_config(cert: &Path, key: &Path) -> Result<Arc<ServerConfig>, ConfigError> {
    let chain = read_chain(cert)?;
    let private_key = read_key(key)?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|err| problem("tls_cert", format!("no usable TLS version ({err})")))?
        .with_no_client_auth();
    let mut config = builder.with_single_cert(chain, private_key).map_err(|err| match err {
        rustls::Error::InconsistentKeys(_) => problem(
            "tls_key",
            format!(
                "{} is not the private key of the first certificate in tls_cert",
                key.display()
            ),
        ),
        // rustls says which kind of problem it met, never the key's bytes.
        other => problem("tls_key", format!("{} cannot be used: {other}", key.display())),
    })?;
    config.alpn_protocols = vec![ALPN_H2.to_vec(), ALPN_HTTP1.to_vec()];
    Ok(Arc::new(config))
}

fn read_chain(path: &Path) -> Result<Vec<CertificateDer<'static>>, ConfigError> {
    let bytes = read("tls_cert", path)?;
    let chain = CertificateDer::pem_slice_iter(&bytes)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|err| {
            problem(
                "tls_cert",
                format!(
                    "{} is not a PEM certificate chain ({})",
                    path.display(),
                    pem_problem(&err)
                ),
            )
        })?;
    if chain.is_empty() {
        return Err(problem(
            "tls_cert",
            format!(
                "{} holds no PEM certificate (-----BEGIN CERTIFICATE-----)",
                path.display()
            ),
        ));
    }
    Ok(chain)
}

fn read_key(path: &Path) -> Result<PrivateKeyDer<'static>, ConfigError> {
    let bytes = read("tls_key", path)?;
    PrivateKeyDer::from_pem_slice(&bytes).map_err(|err| match err {
        rustls_pki_types::pem::Error::NoItemsFound => problem(
            "tls_key",
            format!(
                "{} holds no PEM private key (-----BEGIN PRIVATE KEY-----)",
                path.display()
            ),
        ),
        err => problem(
            "tls_key",
            format!("{} is not a PEM private key ({})", path.display(), pem_problem(&err)),
        ),
    })
}

fn read(key: &str, path: &Path) -> Result<Vec<u8>, ConfigError> {
    std::fs::read(path).map_err(|err| problem(key, format!("cannot read {}: {err}", path.display())))
}

/// The kind of PEM problem only: the library's own messages quote lines of the file, which for `tls_key` would
/// be the secret itself.
fn pem_problem(err: &rustls_pki_types::pem::Error) -> &'static str {
    use rustls_pki_types::pem::Error;
    match err {
        Error::MissingSectionEnd { .. } => "a section has no END line",
        Error::IllegalSectionStart { .. } => "a malformed BEGIN line",
        Error::Base64Decode(_) => "a section is not valid base64",
        Error::Io(_) => "unreadable",
        Error::NoItemsFound => "nothing of the expected type",
        Error::SectionTooLarge => "a section is too large",
        _ => "malformed",
    }
}

fn problem(key: &str, message: String) -> ConfigError {
    ConfigError {
        key: key.to_string(),
        message,
    }
}
