//! Closed-loop load: many clients at once against the proxy.

use super::*;

/// Clients in a closed loop, each on its own keep-alive connection, counting every answer that is not a 200.
pub struct Load {
    stop: Arc<AtomicBool>,
    served: Arc<AtomicUsize>,
    failed: Arc<std::sync::Mutex<Vec<String>>>,
    clients: Vec<JoinHandle<()>>,
}

impl Load {
    pub fn start(addr: std::net::SocketAddr, clients: usize, path: &'static str) -> Load {
        let stop = Arc::new(AtomicBool::new(false));
        let served = Arc::new(AtomicUsize::new(0));
        let failed = Arc::new(std::sync::Mutex::new(Vec::new()));
        let clients = (0..clients)
            .map(|_| {
                let (stop, served, failed) = (stop.clone(), served.clone(), failed.clone());
                tokio::spawn(async move {
                    let mut conn = H1Conn::connect(addr).await;
                    while !stop.load(Ordering::SeqCst) {
                        match conn.try_get(path).await {
                            Ok(resp) if resp.status == StatusCode::OK => {
                                served.fetch_add(1, Ordering::SeqCst);
                            }
                            Ok(resp) => failed.lock().unwrap().push(format!("{} {}", resp.status, resp.text())),
                            Err(err) => {
                                failed.lock().unwrap().push(err.to_string());
                                conn = H1Conn::connect(addr).await;
                            }
                        }
                    }
                })
            })
            .collect();
        Load {
            stop,
            served,
            failed,
            clients,
        }
    }

    pub fn served(&self) -> usize {
        self.served.load(Ordering::SeqCst)
    }

    /// Waits until `more` further requests have been served.
    pub async fn serve_more(&self, more: usize) {
        let target = self.served() + more;
        wait_until_sync(&format!("{more} more requests served"), Duration::from_secs(10), || {
            self.served() >= target
        })
        .await;
    }

    /// Stops the clients after their current request, failing the test when any answer was not a 200.
    pub async fn finish_without_failures(self) {
        self.stop.store(true, Ordering::SeqCst);
        for client in self.clients {
            client.await.unwrap();
        }
        let failed = self.failed.lock().unwrap();
        let served = self.served.load(Ordering::SeqCst);
        assert!(
            failed.is_empty(),
            "{} failed of {}: {:?}",
            failed.len(),
            served + failed.len(),
            &failed[..failed.len().min(5)]
        );
    }
}
