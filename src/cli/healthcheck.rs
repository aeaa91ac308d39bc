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
    let target = match admin.ip() {
        IpAddr::V4(ip) if ip.is_unspecified() => SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), admin.port()),
        IpAddr::V6(ip) if ip.is_unspecified() => SocketAddr::new(IpAddr::V6(Ipv6Addr::LOCALHOST), admin.port()),
        _ => admin,
    };
    match ask(target, &args.path, args.timeout) {
        Ok(200) => ExitCode::SUCCESS,
        Ok(status) => {
            eprintln!("floodgate healthcheck: {target}{} answered {status}", args.path);
            ExitCode::from(1)
        }
        Err(err) => {
            eprintln!("floodgate healthcheck: {target}{}: {err}", args.path);
            ExitCode::from(1)
        }
    }
}

fn ask(target: SocketAddr, path: &str, timeout: Duration) -> std::io::Result<u16> {
    let mut stream = TcpStream::connect_timeout(&target, timeout)?;
    stream.set_read_timeout(Some(timeout))?;
    stream.set_write_timeout(Some(timeout))?;
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: floodgate\r\nConnection: close\r\n\r\n"
    )?;
    let mut head = Vec::new();
    stream.take(1024).read_to_end(&mut head)?;
    let mut lines = [httparse::EMPTY_HEADER; 32];
    let mut response = httparse::Response::new(&mut lines);
    match response.parse(&head) {
        Ok(_) => response
            .code
            .ok_or_else(|| std::io::Error::other("no status line in the answer")),
        Err(err) => Err(std::io::Error::other(format!("unreadable answer: {err}"))),
    }
}
