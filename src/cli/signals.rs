//! What the running process hears from outside: `SIGHUP` and a changed file reload, `SIGTERM` and Ctrl-C drain,
//! and systemd is told how the service stands. It decides nothing about what a reload changes (`reload` does).

use std::path::PathBuf;

/// SIGHUP reloads the configuration, as for most daemons; the reload logs what it changed or why it refused.
pub fn reload_on_hangup(reloader: floodgate::server::Reloader) {
    use tokio::signal::unix::{signal, SignalKind};
    let mut hangups = match signal(SignalKind::hangup()) {
        Ok(hangups) => hangups,
        Err(err) => {
            tracing::warn!(error = %err, "cannot watch SIGHUP; reload through POST /reload only");
            return;
        }
    };
    tokio::spawn(async move {
        while hangups.recv().await.is_some() {
            tracing::info!("SIGHUP: reloading the configuration");
            reload(&reloader).await;
        }
    });
}

/// Reloads the configuration, telling systemd (Type=notify-reload, or ExecReload's caller) when the reload
/// starts and ends. The reload logs what it changed or why it refused.
async fn reload(reloader: &floodgate::server::Reloader) {
    let mut reloading = vec![sd_notify::NotifyState::Reloading];
    reloading.extend(sd_notify::NotifyState::monotonic_usec_now().ok());
    notify_systemd(&reloading);
    let _ = reloader.reload().await;
    notify_systemd(&[sd_notify::NotifyState::Ready]);
}

/// Looks at the configuration file every `interval` and reloads, as on SIGHUP, once a change has stayed for one
/// more look: a Kubernetes ConfigMap is swapped in whole, but an editor may write a file twice. Reading the file's
/// bytes through its path follows the symbolic links a ConfigMap volume swaps.
pub fn reload_on_change(reloader: floodgate::server::Reloader, file: PathBuf, interval: std::time::Duration) {
    use std::hash::{DefaultHasher, Hash, Hasher};
    let fingerprint = |file: &std::path::Path| {
        std::fs::read(file).ok().map(|bytes| {
            let mut hasher = DefaultHasher::new();
            bytes.hash(&mut hasher);
            hasher.finish()
        })
    };
    tokio::spawn(async move {
        let mut loaded = fingerprint(&file);
        let mut seen = loaded;
        let mut ticks = tokio::time::interval(interval);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            ticks.tick().await;
            let now = fingerprint(&file);
            // A file that cannot be read (mid-swap, say) is looked at again next time; one that changed is
            // reloaded once two looks in a row agree, so a half-written file is not taken.
            if now.is_none() {
                continue;
            }
            let settled = now == seen;
            seen = now;
            if !settled || now == loaded {
                continue;
            }
            loaded = now;
            tracing::info!(file = %file.display(), "the configuration file changed: reloading it");
            reload(&reloader).await;
        }
    });
}

/// SIGTERM or SIGINT. The handlers are installed when this is called, not when the future is first polled: a
/// signal that arrives right after the ready line must start a drain, not kill the process.
pub fn shutdown_signal() -> impl std::future::Future<Output = ()> + Send + 'static {
    use tokio::signal::unix::{signal, SignalKind};
    let term = signal(SignalKind::terminate());
    let interrupt = signal(SignalKind::interrupt());
    async move {
        match (term, interrupt) {
            (Ok(mut term), Ok(mut interrupt)) => {
                tokio::select! {
                    _ = term.recv() => {}
                    _ = interrupt.recv() => {}
                }
            }
            (Ok(mut only), Err(_)) | (Err(_), Ok(mut only)) => {
                only.recv().await;
            }
            (Err(_), Err(_)) => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
        tracing::info!("shutdown signal received");
        notify_systemd(&[sd_notify::NotifyState::Stopping]);
    }
}

/// Tells systemd (when it started floodgate with `Type=notify`: `NOTIFY_SOCKET` is set) how the service stands;
/// without it, nothing is sent.
pub fn notify_systemd(states: &[sd_notify::NotifyState<'_>]) {
    if std::env::var_os("NOTIFY_SOCKET").is_none() {
        return;
    }
    if let Err(err) = sd_notify::notify(states) {
        tracing::warn!(error = %err, "cannot notify systemd");
    }
}
