//! Certificates made at test time with rcgen, for the TLS tests: a CA, leaf certificates it signs (for DNS names or
//! IP addresses), each written as PEM files in a temporary directory that is removed on drop; TLS clients that
//! trust the CA or accept anything (to look at what a server presents); and the check that a configuration is
//! refused by `floodgate check` and by start-up alike, with one line naming its key.

use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair, KeyUsagePurpose};
use tokio_rustls::rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use tokio_rustls::rustls::crypto::{verify_tls12_signature, verify_tls13_signature, CryptoProvider};
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer, ServerName, UnixTime};
use tokio_rustls::rustls::{ClientConfig, DigitallySignedStruct, RootCertStore, SignatureScheme};
use tokio_rustls::TlsConnector;

use super::{run_to_exit_with_env, TempConfig};

pub fn provider() -> Arc<CryptoProvider> {
    Arc::new(tokio_rustls::rustls::crypto::ring::default_provider())
}

/// A temporary directory, removed on drop.
pub struct TempDir(pub PathBuf);

impl TempDir {
    pub fn new() -> TempDir {
        static SEQ: AtomicUsize = AtomicUsize::new(0);
        let dir = std::env::temp_dir().join(format!(
            "floodgate-pki-{}-{}",
            std::process::id(),
            SEQ.fetch_add(1, Ordering::SeqCst)
        ));
        std::fs::create_dir_all(&dir).unwrap();
        TempDir(dir)
    }

    /// Writes `contents` to `name` in the directory; returns its path.
    pub fn write(&self, name: &str, contents: &str) -> String {
        let path = self.0.join(name);
        std::fs::write(&path, contents).unwrap();
        path.display().to_string()
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A certificate authority whose certificate is `ca.pem` in its own directory.
pub struct TestCa {
    pub dir: TempDir,
    issuer: Issuer<'static, KeyPair>,
    pub der: CertificateDer<'static>,
    pub cert_path: String,
    issued: AtomicUsize,
}

/// A certificate the CA signed, with its key, as DER and as files.
pub struct Leaf {
    pub der: CertificateDer<'static>,
    pub key_der: Vec<u8>,
    pub key_pem: String,
    pub cert_path: String,
    pub key_path: String,
}

impl Leaf {
    pub fn chain(&self) -> Vec<CertificateDer<'static>> {
        vec![self.der.clone()]
    }

    pub fn key(&self) -> PrivateKeyDer<'static> {
        PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(self.key_der.clone()))
    }
}

impl TestCa {
    pub fn new(common_name: &str) -> TestCa {
        let dir = TempDir::new();
        let key = KeyPair::generate().unwrap();
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.distinguished_name.push(DnType::CommonName, common_name);
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let cert = params.self_signed(&key).unwrap();
        let cert_path = dir.write("ca.pem", &cert.pem());
        TestCa {
            dir,
            issuer: Issuer::new(params, key),
            der: cert.der().clone(),
            cert_path,
            issued: AtomicUsize::new(0),
        }
    }

    /// A leaf for `names` (DNS names or IP addresses), written as `leafN.pem` and `leafN-key.pem`.
    pub fn issue(&self, names: &[&str]) -> Leaf {
        let key = KeyPair::generate().unwrap();
        let mut params = CertificateParams::new(names.iter().map(|n| n.to_string()).collect::<Vec<_>>()).unwrap();
        params
            .distinguished_name
            .push(DnType::CommonName, names.first().copied().unwrap_or("client"));
        let cert = params.signed_by(&key, &self.issuer).unwrap();
        let n = self.issued.fetch_add(1, Ordering::SeqCst);
        let key_pem = key.serialize_pem();
        Leaf {
            der: cert.der().clone(),
            key_der: key.serialize_der(),
            cert_path: self.dir.write(&format!("leaf{n}.pem"), &cert.pem()),
            key_path: self.dir.write(&format!("leaf{n}-key.pem"), &key_pem),
            key_pem,
        }
    }

    pub fn roots(&self) -> RootCertStore {
        let mut roots = RootCertStore::empty();
        roots.add(self.der.clone()).unwrap();
        roots
    }

    /// A client that trusts this CA alone and offers `alpn`.
    pub fn connector(&self, alpn: &[&[u8]]) -> TlsConnector {
        let mut config = ClientConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_root_certificates(self.roots())
            .with_no_client_auth();
        config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
        TlsConnector::from(Arc::new(config))
    }
}

/// A client that completes a handshake whatever certificate the server presents, so a test can look at it.
pub fn accept_any_connector() -> TlsConnector {
    let provider = provider();
    let config = ClientConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .unwrap()
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(AcceptAny(provider)))
        .with_no_client_auth();
    TlsConnector::from(Arc::new(config))
}

/// Accepts any certificate but still checks the handshake's signatures, so the server proves it holds the key.
#[derive(Debug)]
struct AcceptAny(Arc<CryptoProvider>);

impl ServerCertVerifier for AcceptAny {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, tokio_rustls::rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, tokio_rustls::rustls::Error> {
        verify_tls12_signature(message, cert, dss, &self.0.signature_verification_algorithms)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, tokio_rustls::rustls::Error> {
        verify_tls13_signature(message, cert, dss, &self.0.signature_verification_algorithms)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

/// Runs `floodgate check` and a start-up with `config` (and `env`); both must exit 2 with exactly one line,
/// naming `key`. Returns that line.
pub fn assert_refused_with_env(config: &str, key: &str, env: &[(&str, &str)]) -> String {
    let config = TempConfig::new(config);
    let path = config.path_str();
    let mut lines = Vec::new();
    for args in [
        vec!["check", "--config", path.as_str()],
        vec!["--config", path.as_str()],
    ] {
        let (status, _, stderr) = run_to_exit_with_env(&args, env, Duration::from_secs(10));
        assert_eq!(status.code(), Some(2), "{args:?}: {stderr}");
        let problems: Vec<&str> = stderr.lines().filter(|line| !line.trim().is_empty()).collect();
        assert_eq!(problems.len(), 1, "{args:?}: {stderr}");
        assert!(
            problems[0].contains(&format!(" {key}: ")) || problems[0].contains(&format!(" {key} = ")),
            "{args:?}: the line does not name {key}: {stderr}"
        );
        lines.push(problems[0].to_string());
    }
    lines.swap_remove(0)
}

pub fn assert_refused(config: &str, key: &str) -> String {
    assert_refused_with_env(config, key, &[])
}
