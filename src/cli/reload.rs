//! `floodgate reload`: has the running floodgate that the configuration describes read its configuration again
//! (`POST /reload` on its admin listener, with the configuration's `admin_token` when it has one) and prints what the
//! reload changed or why it was refused. Exit 0 when it was put in force, 1 otherwise; a configuration with
//! problems is reported as `check` reports it (exit 2) and never sent.

use std::process::ExitCode;
use std::time::Duration;

use floodgate::config::Config;

use super::healthcheck::{ask, on_loopback_if_unspecified};

/// How long to wait for the running floodgate's answer: a reload reads files and may wait for a replica count.
const ANSWER_WITHIN: Duration = Duration::from_secs(30);

pub fn run(config: &Config) -> ExitCode {
    let target = on_loopback_if_unspecified(config.admin);
    let token = config.admin_token.as_ref().map(|token| token.expose());
    match ask(target, "POST", "/reload", token, ANSWER_WITHIN) {
        Ok((200, body)) => {
            print!("{body}");
            ExitCode::SUCCESS
        }
        Ok((status, body)) => {
            eprint!("floodgate reload: {target} answered {status}: {body}");
            ExitCode::from(1)
        }
        Err(err) => {
            eprintln!("floodgate reload: {target}: {err}");
            ExitCode::from(1)
        }
    }
}
