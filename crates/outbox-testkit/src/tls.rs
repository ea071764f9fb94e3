//! [`TestPki`]: a private CA and a server certificate made by the test, for
//! TLS tests against real servers (no OpenSSL, no files in the repository).

use std::net::{IpAddr, Ipv4Addr};
use std::path::{Path, PathBuf};

/// A certificate authority and a server certificate it signed, for
/// `localhost` and `127.0.0.1`, written as PEM files into a temporary
/// directory that lives as long as the value. The directory and files are
/// world-readable, so a server running as another user (RabbitMQ's
/// `rabbitmq`) can read them; the key is a throwaway.
#[derive(Debug)]
pub struct TestPki {
    dir: tempfile::TempDir,
    /// The CA certificate (PEM): what a client trusts.
    pub ca: PathBuf,
    /// The server certificate (PEM), signed by the CA.
    pub cert: PathBuf,
    /// The server's private key (PEM).
    pub key: PathBuf,
}

impl TestPki {
    /// Makes a fresh CA (`common_name`) and a server certificate.
    pub fn new(common_name: &str) -> Self {
        use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, KeyPair, SanType};
        let mut ca_params = CertificateParams::new(Vec::<String>::new()).expect("CA params");
        ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca_params
            .distinguished_name
            .push(DnType::CommonName, common_name);
        let ca_key = KeyPair::generate().expect("CA key");
        let ca = ca_params.self_signed(&ca_key).expect("CA certificate");

        let mut params =
            CertificateParams::new(vec!["localhost".to_owned()]).expect("server params");
        params
            .subject_alt_names
            .push(SanType::IpAddress(IpAddr::V4(Ipv4Addr::LOCALHOST)));
        params
            .distinguished_name
            .push(DnType::CommonName, "localhost");
        let key = KeyPair::generate().expect("server key");
        let cert = params
            .signed_by(&key, &ca, &ca_key)
            .expect("server certificate");

        let dir = tempfile::Builder::new()
            .prefix("outbox-pki-")
            .tempdir()
            .expect("temporary directory");
        let write = |name: &str, pem: String| -> PathBuf {
            let path = dir.path().join(name);
            std::fs::write(&path, pem).expect("write PEM");
            readable(&path, 0o644);
            path
        };
        let pki = Self {
            ca: write("ca.pem", ca.pem()),
            cert: write("server.pem", cert.pem()),
            key: write("server.key", key.serialize_pem()),
            dir,
        };
        readable(pki.dir.path(), 0o755);
        pki
    }

    /// The directory holding the files.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }
}

#[cfg(unix)]
fn readable(path: &Path, mode: u32) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).expect("chmod");
}

#[cfg(not(unix))]
fn readable(_: &Path, _: u32) {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_a_ca_and_a_server_certificate() {
        let pki = TestPki::new("outbox test CA");
        for p in [&pki.ca, &pki.cert, &pki.key] {
            let pem = std::fs::read_to_string(p).unwrap();
            assert!(pem.starts_with("-----BEGIN"), "{}", p.display());
        }
        assert_ne!(
            std::fs::read(&pki.ca).unwrap(),
            std::fs::read(&TestPki::new("other").ca).unwrap()
        );
    }
}
