//! `log_level` (and `RUST_LOG`): comma-separated directives, each `LEVEL` (the default) or `TARGET=LEVEL`, read
//! strictly into the filter logging uses. A word that is no level is refused rather than taken for a target name,
//! which would silently filter every other line away. Lines a dependency writes once per frame a peer sends are
//! kept out unless their target is named ([`PEER_PACED_TARGETS`]).

use tracing_subscriber::filter::{LevelFilter, Targets};

const LEVELS: &str = "trace, debug, info, warn, error or off";

/// Targets that write a line for each of some frame a peer sends, so that a client could write floodgate's log at
/// the rate it sends frames: h2's `recv PING ack that we never sent` (a WARN per PING ACK nobody asked for).
/// They are held to errors unless a directive names them; floodgate counts such frames itself and closes a
/// connection that keeps sending them (`server::h2_frames`).
pub(super) const PEER_PACED_TARGETS: [&str; 1] = ["h2::proto::ping_pong"];

/// The filter `directives` describe (`info`, `warn,floodgate::pool=debug`), or what is wrong with the first
/// directive that is not one.
pub fn log_filter(directives: &str) -> Result<Targets, String> {
    let mut filter = Targets::new();
    let mut default = None;
    let mut named = Vec::new();
    for directive in directives.split(',').map(str::trim).filter(|d| !d.is_empty()) {
        match directive.split_once('=') {
            None => default = Some(level(directive)?),
            Some((target, wanted)) => {
                let target = target.trim();
                if target.is_empty() {
                    return Err(format!("`{directive}` names no target before `=`"));
                }
                if !target
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':' || c == '-')
                {
                    return Err(format!(
                        "`{target}` is not a target (a module path such as floodgate::pool)"
                    ));
                }
                filter = filter.with_target(target, level(wanted.trim())?);
                named.push(target);
            }
        }
    }
    for target in PEER_PACED_TARGETS {
        if !named.contains(&target) {
            filter = filter.with_target(target, LevelFilter::ERROR);
        }
    }
    Ok(filter.with_default(default.unwrap_or(LevelFilter::OFF)))
}

fn level(word: &str) -> Result<LevelFilter, String> {
    match word.to_ascii_lowercase().as_str() {
        "trace" => Ok(LevelFilter::TRACE),
        "debug" => Ok(LevelFilter::DEBUG),
        "info" => Ok(LevelFilter::INFO),
        "warn" => Ok(LevelFilter::WARN),
        "error" => Ok(LevelFilter::ERROR),
        "off" => Ok(LevelFilter::OFF),
        _ => Err(format!(
            "`{word}` is not a level ({LEVELS}); a directive is LEVEL or TARGET=LEVEL"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::log_filter;
    use tracing::Level;

    #[test]
    fn levels_and_targets_are_read_and_a_word_that_is_no_level_is_refused() {
        let filter = log_filter("warn, floodgate::pool=debug").expect("valid");
        assert!(filter.would_enable("floodgate::pool", &Level::DEBUG));
        assert!(!filter.would_enable("floodgate::admin", &Level::INFO));
        assert!(filter.would_enable("floodgate::admin", &Level::WARN));
        assert!(log_filter("INFO").expect("valid").would_enable("x", &Level::INFO));
        for bad in ["verbose", "floodgate=loud", "=info", "a b=info", "info,floodgate"] {
            assert!(log_filter(bad).is_err(), "{bad} accepted");
        }
        assert!(log_filter("verbose").unwrap_err().contains("`verbose` is not a level"));
    }

    #[test]
    fn lines_a_peer_paces_are_kept_out_at_any_level_unless_their_target_is_named() {
        for directives in ["info", "trace", "warn,h2=trace"] {
            let filter = log_filter(directives).expect("valid");
            assert!(
                !filter.would_enable("h2::proto::ping_pong", &Level::WARN),
                "{directives}"
            );
            assert!(
                filter.would_enable("h2::proto::ping_pong", &Level::ERROR),
                "{directives}"
            );
            assert!(filter.would_enable("floodgate::server", &Level::WARN), "{directives}");
        }
        let named = log_filter("info,h2::proto::ping_pong=warn").expect("valid");
        assert!(named.would_enable("h2::proto::ping_pong", &Level::WARN));
    }
}
