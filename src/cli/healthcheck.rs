//! `floodgate healthcheck`: asks a running floodgate's admin listener whether it is ready (`/readyz`) or alive
//! (`/healthz`), for container health checks without curl in the image. Exit 0 on a `200`, 1 on anything else.

use std::io::{Read, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpStream};
use std::process::ExitCode;
use std::time::Duration;

/// What `healthcheck` asks.
#[derive(clap::Args, Debug)]
pub struct HealthcheckArgs {
    /// The admin path to ask: /readyz (ready to take traffic; 503 while draining) or /healthz (the process answers).
    #[arg(long, default_value = "/readyz")]
    path: String,
    /// How long to wait for the answer.
    #[arg(long, default_value = "2s", value_parser = humantime::parse_duration)]
    timeout: Duration,
}

/// Asks the admin listener at `admin` (the configuration's `admin`; an unspecified address is asked on loopback).
pub fn run(args: &HealthcheckArgs, admin: SocketAddr) -> ExitCode {
    let target = on_loopback_if_unspecified(admin);
    match ask(target, "GET", &args.path, None, args.timeout) {
        Ok((200, _)) => ExitCode::SUCCESS,
        Ok((status, _)) => {
            eprintln!("floodgate healthcheck: {target}{} answered {status}", args.path);
            ExitCode::from(1)
        }
        Err(err) => {
            eprintln!("floodgate healthcheck: {target}{}: {err}", args.path);
            ExitCode::from(1)
        }
    }
}

/// Where to reach an admin listener bound to `admin`: an unspecified address (all interfaces) on loopback.
pub fn on_loopback_if_unspecified(admin: SocketAddr) -> SocketAddr {
    match admin.ip() {
        IpAddr::V4(ip) if ip.is_unspecified() => SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), admin.port()),
        IpAddr::V6(ip) if ip.is_unspecified() => SocketAddr::new(IpAddr::V6(Ipv6Addr::LOCALHOST), admin.port()),
        _ => admin,
    }
}

/// The most of an admin answer read: its head and a body of a few lines (a reload's changes or problems).
const MAX_ANSWER_BYTES: u64 = 64 * 1024;

/// One request to the admin listener at `target`, with the bearer `token` if there is one: the answer's status and
/// its body as text.
pub fn ask(
    target: SocketAddr,
    method: &str,
    path: &str,
    token: Option<&str>,
    timeout: Duration,
) -> std::io::Result<(u16, String)> {
    let mut stream = TcpStream::connect_timeout(&target, timeout)?;
    stream.set_read_timeout(Some(timeout))?;
    stream.set_write_timeout(Some(timeout))?;
    let authorization = token.map_or_else(String::new, |token| format!("Authorization: Bearer {token}\r\n"));
    write!(
        stream,
        "{method} {path} HTTP/1.1\r\nHost: floodgate\r\n{authorization}Content-Length: 0\r\nConnection: close\r\n\r\n"
    )?;
    let mut answer = Vec::new();
    stream.take(MAX_ANSWER_BYTES).read_to_end(&mut answer)?;
    let mut lines = [httparse::EMPTY_HEADER; 32];
    let mut response = httparse::Response::new(&mut lines);
    match response.parse(&answer) {
        Ok(httparse::Status::Complete(head_len)) => {
            let status = response
                .code
                .ok_or_else(|| std::io::Error::other("no status line in the answer"))?;
            let body = answer.get(head_len..).unwrap_or_default();
            Ok((status, String::from_utf8_lossy(body).into_owned()))
        }
        Ok(httparse::Status::Partial) => Err(std::io::Error::other("the answer ended within its head")),
        Err(err) => Err(std::io::Error::other(format!("unreadable answer: {err}"))),
    }
}
