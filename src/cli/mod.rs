//! The binary's own parts, kept out of the library: what only the `floodgate` command needs.

pub mod demo;
pub mod healthcheck;
pub mod reload;
pub mod signals;
