//! TLS both ways, built from the configuration: termination on the client listener (certificates picked by SNI,
//! ALPN `h2` and `http/1.1`) and the client side of `https://` upstreams. A step of start-up, of a reload and of
//! `floodgate check` ([`check`]), which refuses what start-up would; the configuration itself only names the files.
//!
//! Owns reading the PEM files and the choice of certificate by SNI; a problem names its key and never quotes the
//! file, so a private key cannot reach a log. It never opens a socket. The crypto provider is *ring*, which needs
//! no cmake on the build machine (aws-lc-rs does).

use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rustls::crypto::CryptoProvider;
use rustls::server::{ClientHello, ParsedCertificate, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use rustls::{ClientConfig, RootCertStore, ServerConfig};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, DnsName, PrivateKeyDer, ServerName};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio_rustls::client::TlsStream;
use tokio_rustls::TlsConnector;

use crate::config::{Config, ConfigError, Origin, Scheme, UpstreamConfig};

/// What the listener negotiates, most preferred first; the client's pick decides HTTP/2 or HTTP/1.
pub const ALPN_H2: &[u8] = b"h2";
pub const ALPN_HTTP1: &[u8] = b"http/1.1";

/// Every TLS problem of `config`, each naming its key: the listener's certificates and each `https://` upstream's
/// client settings, built as start-up builds them (the files are read).
pub fn check(config: &Config) -> Vec<ConfigError> {
    let mut problems = listener_config(config).err().unwrap_or_default();
    for (name, upstream) in &config.upstreams {
        // An upstream whose endpoints do not parse has its own problems already.
        if let Some((origin, _)) = upstream
            .endpoint_problems(name)
            .ok()
            .and_then(|endpoints| endpoints.first().cloned())
        {
            if let Err(found) = upstream_client(name, upstream, &origin) {
                problems.extend(found);
            }
        }
    }
    problems
}

/// The client listener's TLS configuration from the whole configuration: `None` when the listener is plain
/// (neither `tls_cert`/`tls_key` nor `[[tls_certificates]]`). Reads every file it names, each time it is
/// called; the error is the first problem found (validation lists them all).
pub fn server_config(config: &Config) -> Result<Option<Arc<ServerConfig>>, ConfigError> {
    listener_config(config).map_err(first_problem)
}

/// [`server_config`] with every problem, for validation.
fn listener_config(config: &Config) -> Result<Option<Arc<ServerConfig>>, Vec<ConfigError>> {
    let provider = provider();
    let mut problems = Vec::new();
    let default = match (&config.tls_cert, &config.tls_key) {
        (Some(cert), Some(key)) => certified_key(&provider, ("tls_cert", cert), ("tls_key", key))
            .map_err(|problem| problems.push(problem))
            .ok(),
        (Some(_), None) => {
            problems.push(problem("tls_key", "missing: tls_cert is set, and TLS needs both"));
            None
        }
        (None, Some(_)) => {
            problems.push(problem("tls_cert", "missing: tls_key is set, and TLS needs both"));
            None
        }
        (None, None) => None,
    };
    let mut by_name = BySni {
        exact: HashMap::new(),
        wildcard: HashMap::new(),
        default,
    };
    // Which entry gave each name, so that a name given twice names both entries.
    let mut given_by: HashMap<SniName, usize> = HashMap::new();
    for (index, entry) in config.tls_certificates.iter().enumerate() {
        let at = |field: &str| format!("tls_certificates[{index}].{field}");
        if entry.names.is_empty() {
            problems.push(problem(
                &at("names"),
                "empty: give the SNI names this certificate is for",
            ));
        }
        let mut names = Vec::new();
        for text in &entry.names {
            match SniName::parse(text) {
                Ok(name) => match given_by.get(&name) {
                    Some(&other) if other == index => {}
                    Some(&other) => problems.push(problem(
                        &at("names"),
                        format!("`{text}` is already given by tls_certificates[{other}]"),
                    )),
                    None => {
                        given_by.insert(name.clone(), index);
                        names.push(name);
                    }
                },
                Err(message) => problems.push(problem(&at("names"), format!("`{text}` {message}"))),
            }
        }
        let cert_key = at("cert");
        let key_key = at("key");
        let key = match certified_key(&provider, (&cert_key, &entry.cert), (&key_key, &entry.key)) {
            Ok(key) => key,
            Err(found) => {
                problems.push(found);
                continue;
            }
        };
        if let Some(message) = invalid_for(&key, &names) {
            problems.push(problem(&cert_key, format!("{} {message}", entry.cert.display())));
        }
        for name in names {
            match name {
                SniName::Exact(name) => by_name.exact.insert(name, key.clone()),
                SniName::Wildcard(parent) => by_name.wildcard.insert(parent, key.clone()),
            };
        }
    }
    if !problems.is_empty() {
        return Err(problems);
    }
    if by_name.default.is_none() && by_name.exact.is_empty() && by_name.wildcard.is_empty() {
        return Ok(None);
    }
    let mut server = ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|err| vec![problem("tls_cert", format!("no usable TLS version ({err})"))])?
        .with_no_client_auth()
        .with_cert_resolver(Arc::new(by_name));
    server.alpn_protocols = vec![ALPN_H2.to_vec(), ALPN_HTTP1.to_vec()];
    Ok(Some(Arc::new(server)))
}

/// A name of a `[[tls_certificates]]` entry, lower-cased; a wildcard keeps the part after `*.`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
enum SniName {
    Exact(String),
    Wildcard(String),
}

impl SniName {
    fn parse(text: &str) -> Result<SniName, &'static str> {
        let lower = text.to_ascii_lowercase();
        let (wildcard, name) = match lower.strip_prefix("*.") {
            Some(parent) => (true, parent),
            None => (false, lower.as_str()),
        };
        if name.contains('*') {
            return Err("has a * other than as the whole first label (*.example.org)");
        }
        // SNI carries DNS names only: a client that dialled an address sends none, and gets the default.
        if name.parse::<std::net::IpAddr>().is_ok() {
            return Err("is an IP address, which clients never send as SNI");
        }
        if DnsName::try_from(name).is_err() || name.ends_with('.') {
            return Err("is not a DNS name");
        }
        Ok(if wildcard {
            SniName::Wildcard(name.to_string())
        } else {
            SniName::Exact(name.to_string())
        })
    }
}

/// Why `key`'s leaf certificate would fail a client that asked for one of `names`, if it would.
fn invalid_for(key: &CertifiedKey, names: &[SniName]) -> Option<String> {
    let leaf = key.cert.first()?;
    let parsed = match ParsedCertificate::try_from(leaf) {
        Ok(parsed) => parsed,
        Err(err) => return Some(format!("is not a certificate rustls can use ({err})")),
    };
    names.iter().find_map(|name| {
        // A wildcard entry is checked with one name it stands for: a certificate for `*.example.org` covers it,
        // one for a single host below example.org does not (the label is one no real host would have).
        let (shown, checked) = match name {
            SniName::Exact(name) => (name.clone(), name.clone()),
            SniName::Wildcard(parent) => (format!("*.{parent}"), format!("floodgate-wildcard-check.{parent}")),
        };
        let server_name = ServerName::try_from(checked).ok()?;
        rustls::client::verify_server_name(&parsed, &server_name)
            .err()
            .map(|_| format!("is not valid for {shown} (its first certificate does not name it)"))
    })
}

/// Certificates by SNI name: an exact name first, then a wildcard for the name's parent, then the default.
#[derive(Debug)]
struct BySni<T> {
    exact: HashMap<String, T>,
    /// Keyed by the part after `*.`.
    wildcard: HashMap<String, T>,
    default: Option<T>,
}

impl<T> BySni<T> {
    fn pick(&self, server_name: Option<&str>) -> Option<&T> {
        let Some(name) = server_name else {
            return self.default.as_ref();
        };
        // rustls hands over the name as sent; DNS names compare case-insensitively and may end in a dot.
        let name = name.trim_end_matches('.').to_ascii_lowercase();
        self.exact
            .get(&name)
            .or_else(|| name.split_once('.').and_then(|(_, parent)| self.wildcard.get(parent)))
            .or(self.default.as_ref())
    }
}

/// `None` refuses the handshake: rustls then sends an `access_denied` alert.
impl ResolvesServerCert for BySni<Arc<CertifiedKey>> {
    fn resolve(&self, client_hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        self.pick(client_hello.server_name()).cloned()
    }
}

/// The TLS client of one `https://` upstream, built once per pool; every dial runs its handshake with it.
pub struct UpstreamTls {
    connector: TlsConnector,
    server_name: ServerName<'static>,
    /// When a failed handshake was last logged as a warning.
    warned: Mutex<Option<Instant>>,
}

impl UpstreamTls {
    /// Runs the client handshake over `io`: SNI and the verified name are the URL's host or
    /// `tls_server_name` (an IP address is verified against the certificate's addresses and sent as no SNI).
    pub async fn connect<IO>(&self, io: IO) -> std::io::Result<TlsStream<IO>>
    where
        IO: AsyncRead + AsyncWrite + Unpin,
    {
        self.connector.connect(self.server_name.clone(), io).await
    }

    /// Logs a failed handshake as a warning at most once a second: a certificate problem is an operator's to fix
    /// and would otherwise only show at debug level, one line per request.
    pub fn handshake_failed(&self, upstream: &str, error: &std::io::Error) {
        let mut warned = self.warned.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let quiet = warned.is_some_and(|at| at.elapsed() < Duration::from_secs(1));
        if quiet {
            tracing::debug!(upstream, %error, "TLS handshake with the upstream failed");
        } else {
            *warned = Some(Instant::now());
            tracing::warn!(upstream, %error, "TLS handshake with the upstream failed");
        }
    }
}

/// The TLS client for upstream `name` when its URL is `https://`, `None` for `http://`; reads `tls_ca` (or the
/// system's roots) and the client certificate. Every problem names its key under `upstreams.NAME`. A TLS key
/// on an `http://` upstream is refused rather than ignored: it says the operator expected TLS.
pub fn upstream_client(
    name: &str,
    upstream: &UpstreamConfig,
    origin: &Origin,
) -> Result<Option<UpstreamTls>, Vec<ConfigError>> {
    let key = |field: &str| format!("upstreams.{name}.{field}");
    let mut problems = Vec::new();
    // The TLS keys on an http:// upstream are refused by the configuration's validation.
    if origin.scheme == Scheme::Http {
        return Ok(None);
    }
    let roots = match &upstream.tls_ca {
        Some(path) => read_roots(&key("tls_ca"), path),
        None => system_roots(&key("tls_ca")),
    }
    .map_err(|found| problems.push(found))
    .ok();
    let server_name = match &upstream.tls_server_name {
        Some(text) => ServerName::try_from(text.clone())
            .map_err(|_| {
                problems.push(problem(
                    &key("tls_server_name"),
                    format!("`{text}` is not a DNS name or an IP address"),
                ))
            })
            .ok(),
        None => ServerName::try_from(origin.host.clone())
            .map_err(|_| {
                problems.push(problem(
                    &key("url"),
                    format!(
                        "host `{}` cannot be verified in a certificate (set tls_server_name)",
                        origin.host
                    ),
                ))
            })
            .ok(),
    };
    let cert_key = key("tls_client_cert");
    let key_key = key("tls_client_key");
    let client_auth = match (&upstream.tls_client_cert, &upstream.tls_client_key) {
        (Some(cert), Some(private_key)) => {
            let chain = read_chain(&cert_key, cert).map_err(|found| problems.push(found)).ok();
            let private_key = read_key(&key_key, private_key)
                .map_err(|found| problems.push(found))
                .ok();
            chain.zip(private_key)
        }
        (Some(_), None) => {
            problems.push(problem(
                &key_key,
                "missing: tls_client_cert is set, and a client certificate needs both",
            ));
            None
        }
        (None, Some(_)) => {
            problems.push(problem(
                &cert_key,
                "missing: tls_client_key is set, and a client certificate needs both",
            ));
            None
        }
        (None, None) => None,
    };
    let (Some(roots), Some(server_name), true) = (roots, server_name, problems.is_empty()) else {
        return Err(problems);
    };
    let builder = ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|err| vec![problem(&key("url"), format!("no usable TLS version ({err})"))])?
        .with_root_certificates(roots);
    let mut client = match (client_auth, &upstream.tls_client_key) {
        (Some((chain, private_key)), Some(path)) => builder
            .with_client_auth_cert(chain, private_key)
            .map_err(|err| vec![key_mismatch(&cert_key, &key_key, path, err)])?,
        _ => builder.with_no_client_auth(),
    };
    // The pool speaks the upstream's configured protocol, whatever the client spoke; a dial checks what the
    // upstream chose.
    client.alpn_protocols = match upstream.protocol {
        crate::config::UpstreamProtocol::Http1 => vec![ALPN_HTTP1.to_vec()],
        crate::config::UpstreamProtocol::Http2 => vec![ALPN_H2.to_vec()],
    };
    Ok(Some(UpstreamTls {
        connector: TlsConnector::from(Arc::new(client)),
        server_name,
        warned: Mutex::new(None),
    }))
}

fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn first_problem(problems: Vec<ConfigError>) -> ConfigError {
    problems
        .into_iter()
        .next()
        .unwrap_or_else(|| problem("tls", "invalid TLS configuration"))
}

/// A certificate chain and its private key, checked to belong together; `(key name, path)` for each file.
fn certified_key(
    provider: &CryptoProvider,
    (cert_key, cert): (&str, &Path),
    (key_key, key): (&str, &Path),
) -> Result<Arc<CertifiedKey>, ConfigError> {
    let chain = read_chain(cert_key, cert)?;
    let private_key = read_key(key_key, key)?;
    CertifiedKey::from_der(chain, private_key, provider)
        .map(Arc::new)
        .map_err(|err| key_mismatch(cert_key, key_key, key, err))
}

fn key_mismatch(cert_key: &str, key_key: &str, key: &Path, err: rustls::Error) -> ConfigError {
    match err {
        rustls::Error::InconsistentKeys(_) => problem(
            key_key,
            format!(
                "{} is not the private key of the first certificate in {cert_key}",
                key.display()
            ),
        ),
        // rustls says which kind of problem it met, never the key's bytes.
        other => problem(key_key, format!("{} cannot be used: {other}", key.display())),
    }
}

fn read_chain(key: &str, path: &Path) -> Result<Vec<CertificateDer<'static>>, ConfigError> {
    let bytes = read(key, path)?;
    let chain = CertificateDer::pem_slice_iter(&bytes)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|err| {
            problem(
                key,
                format!(
                    "{} is not a PEM certificate chain ({})",
                    path.display(),
                    pem_problem(&err)
                ),
            )
        })?;
    if chain.is_empty() {
        return Err(problem(
            key,
            format!(
                "{} holds no PEM certificate (-----BEGIN CERTIFICATE-----)",
                path.display()
            ),
        ));
    }
    Ok(chain)
}

fn read_key(key: &str, path: &Path) -> Result<PrivateKeyDer<'static>, ConfigError> {
    let bytes = read(key, path)?;
    PrivateKeyDer::from_pem_slice(&bytes).map_err(|err| match err {
        rustls_pki_types::pem::Error::NoItemsFound => problem(
            key,
            format!(
                "{} holds no PEM private key (-----BEGIN PRIVATE KEY-----)",
                path.display()
            ),
        ),
        err => problem(
            key,
            format!("{} is not a PEM private key ({})", path.display(), pem_problem(&err)),
        ),
    })
}

/// The CAs of a `tls_ca` bundle: every certificate in it must be usable as a trust anchor.
fn read_roots(key: &str, path: &Path) -> Result<RootCertStore, ConfigError> {
    let mut roots = RootCertStore::empty();
    for cert in read_chain(key, path)? {
        roots.add(cert).map_err(|err| {
            problem(
                key,
                format!(
                    "{} holds a certificate that cannot be a trust anchor ({err})",
                    path.display()
                ),
            )
        })?;
    }
    Ok(roots)
}

/// The system's roots (`SSL_CERT_FILE`/`SSL_CERT_DIR` when set, else the platform's store), for an `https://`
/// upstream without `tls_ca`. Read once per pool, not per dial: on some systems it is a few hundred KB of PEM.
fn system_roots(key: &str) -> Result<RootCertStore, ConfigError> {
    let found = rustls_native_certs::load_native_certs();
    let mut roots = RootCertStore::empty();
    let (added, _unusable) = roots.add_parsable_certificates(found.certs);
    if added == 0 {
        let why = found.errors.first().map(|err| format!(" ({err})")).unwrap_or_default();
        return Err(problem(
            key,
            format!(
                "not set, and the system has no root certificates to use instead{why}; give a PEM bundle of the \
                 CAs to trust"
            ),
        ));
    }
    Ok(roots)
}

fn read(key: &str, path: &Path) -> Result<Vec<u8>, ConfigError> {
    std::fs::read(path).map_err(|err| problem(key, format!("cannot read {}: {err}", path.display())))
}

/// The kind of PEM problem only: the library's own messages quote lines of the file, which for a key file
/// would be the secret itself.
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

fn problem(key: &str, message: impl Into<String>) -> ConfigError {
    ConfigError::new(key, message)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table(entries: &[(&str, &'static str)], default: Option<&'static str>) -> BySni<&'static str> {
        let mut by_name = BySni {
            exact: HashMap::new(),
            wildcard: HashMap::new(),
            default,
        };
        for (name, value) in entries {
            match SniName::parse(name).unwrap() {
                SniName::Exact(name) => by_name.exact.insert(name, *value),
                SniName::Wildcard(parent) => by_name.wildcard.insert(parent, *value),
            };
        }
        by_name
    }

    #[test]
    fn sni_picks_exact_then_one_label_wildcard_then_the_default() {
        let by_name = table(
            &[
                ("API.example.com", "api"),
                ("*.example.org", "wild"),
                ("www.example.org", "www"),
            ],
            Some("default"),
        );
        assert_eq!(by_name.pick(Some("api.example.com")), Some(&"api"));
        assert_eq!(
            by_name.pick(Some("Api.Example.COM.")),
            Some(&"api"),
            "case and a final dot"
        );
        assert_eq!(by_name.pick(Some("a.example.org")), Some(&"wild"));
        assert_eq!(
            by_name.pick(Some("www.example.org")),
            Some(&"www"),
            "exact wins over wildcard"
        );
        assert_eq!(
            by_name.pick(Some("a.b.example.org")),
            Some(&"default"),
            "one label only"
        );
        assert_eq!(
            by_name.pick(Some("example.org")),
            Some(&"default"),
            "not the parent itself"
        );
        assert_eq!(by_name.pick(Some("other.test")), Some(&"default"));
        assert_eq!(by_name.pick(None), Some(&"default"));
        let without_default = table(&[("api.example.com", "api")], None);
        assert_eq!(without_default.pick(Some("other.test")), None);
        assert_eq!(without_default.pick(None), None);
    }

    #[test]
    fn sni_names_are_dns_names_with_at_most_a_leading_wildcard_label() {
        for good in ["example.com", "*.example.org", "a-b.c", "localhost"] {
            assert!(SniName::parse(good).is_ok(), "{good}");
        }
        for bad in [
            "",
            "*",
            "a.*.example.org",
            "*example.org",
            "**.example.org",
            "127.0.0.1",
            "a b",
            "x.",
        ] {
            assert!(SniName::parse(bad).is_err(), "{bad}");
        }
    }
}
