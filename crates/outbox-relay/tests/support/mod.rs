//! Shared by the binary's HTTP tests: a free local address and a minimal
//! HTTP GET for the metrics listener.
#![allow(dead_code, unreachable_pub)]

use std::io::{Read, Write};
use std::time::Duration;

/// `127.0.0.1:<port>` of a port that was free a moment ago.
pub fn free_addr() -> String {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .expect("bind a free port")
        .local_addr()
        .expect("local address")
        .port();
    format!("127.0.0.1:{port}")
}

/// `GET path` on `addr`: status and body, `None` when nothing answers.
pub fn get(addr: &str, path: &str) -> Option<(u16, String)> {
    let mut s = std::net::TcpStream::connect(addr).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut text = String::new();
    s.read_to_string(&mut text).ok()?;
    let status = text.split_whitespace().nth(1)?.parse().ok()?;
    let body = text.split_once("\r\n\r\n")?.1.to_owned();
    Some((status, body))
}
