//! The proxy launcher: the `floodgate` binary on ephemeral ports, and its admin listener.

use super::*;

pub fn floodgate_bin() -> &'static str {
    env!("CARGO_BIN_EXE_floodgate")
}

/// A running `floodgate` process (killed on drop).
pub struct Proxy {
    child: Child,
    pub listen: SocketAddr,
    pub admin: SocketAddr,
    output: Arc<Mutex<String>>,
    /// The threads copying stdout and stderr into `output`; they end at end of file.
    readers: [std::thread::JoinHandle<()>; 2],
    exit: Option<ExitStatus>,
}

pub(super) const OUTPUT_CAP: usize = 4 << 20;

pub(super) fn append_capped(buf: &Mutex<String>, text: &str) {
    let mut buf = buf.lock().unwrap();
    buf.push_str(text);
    if buf.len() > OUTPUT_CAP {
        let mut cut = buf.len() - OUTPUT_CAP / 2;
        while !buf.is_char_boundary(cut) {
            cut += 1;
        }
        buf.drain(..cut);
    }
}

pub(super) fn parse_ready_line(line: &str) -> Option<(SocketAddr, SocketAddr)> {
    let rest = line.trim().strip_prefix("floodgate ready ")?;
    let mut listen = None;
    let mut admin = None;
    for token in rest.split_whitespace() {
        if let Some(v) = token.strip_prefix("listen=") {
            listen = v.parse().ok();
        } else if let Some(v) = token.strip_prefix("admin=") {
            admin = v.parse().ok();
        }
    }
    Some((listen?, admin?))
}

impl Proxy {
    /// The access-log lines (JSON) the proxy wrote to stdout, once `count` of them are there; other stdout lines
    /// (the ready line) are skipped.
    pub async fn access_lines(&self, count: usize) -> Vec<serde_json::Value> {
        let parse = |output: String| -> Vec<serde_json::Value> {
            output
                .lines()
                .filter_map(|line| line.strip_prefix("[stdout] "))
                .filter_map(|line| serde_json::from_str(line).ok())
                .collect()
        };
        wait_until_sync("the access lines", Duration::from_secs(10), || {
            parse(self.output()).len() >= count
        })
        .await;
        parse(self.output())
    }

    /// Starts floodgate with `--listen 127.0.0.1:0 --admin 127.0.0.1:0`
    /// followed by `args`; panics (with its stderr) when it is not ready in
    /// 10 s.
    pub async fn start<S: AsRef<str>>(args: &[S]) -> Proxy {
        match Self::try_start(args).await {
            Ok(p) => p,
            Err(e) => panic!("floodgate did not start: {e}"),
        }
    }

    /// `--upstream URL --max-connections N` plus `extra`.
    pub async fn for_upstream(upstream: &Upstream, max_connections: usize, extra: &[&str]) -> Proxy {
        Self::for_upstream_with_env(upstream, max_connections, extra, &[]).await
    }

    /// floodgate in front of the HTTP/2 upstream at `url`, with `connections` connections of `streams` streams
    /// each, plus `extra`.
    pub async fn for_h2_upstream(url: &str, connections: usize, streams: usize, extra: &[&str]) -> Proxy {
        Self::for_h2_upstream_with_env(url, connections, streams, extra, &[]).await
    }

    /// [`Proxy::for_h2_upstream`] with `env` added to floodgate's environment.
    pub async fn for_h2_upstream_with_env(
        url: &str,
        connections: usize,
        streams: usize,
        extra: &[&str],
        env: &[(&str, &str)],
    ) -> Proxy {
        let mut args = vec![
            "--upstream".to_owned(),
            url.to_owned(),
            "--max-connections".to_owned(),
            connections.to_string(),
            "--upstream-protocol".to_owned(),
            "http2".to_owned(),
            "--max-streams-per-connection".to_owned(),
            streams.to_string(),
        ];
        args.extend(extra.iter().map(|arg| arg.to_string()));
        Self::start_with_env(&args, env).await
    }

    /// [`Proxy::for_upstream`] with `env` added to floodgate's environment (settings without a flag).
    pub async fn for_upstream_with_env(
        upstream: &Upstream,
        max_connections: usize,
        extra: &[&str],
        env: &[(&str, &str)],
    ) -> Proxy {
        let mut args = vec![
            "--upstream".to_owned(),
            upstream.url(),
            "--max-connections".to_owned(),
            max_connections.to_string(),
        ];
        args.extend(extra.iter().map(|s| s.to_string()));
        Self::start_with_env(&args, env).await
    }

    pub async fn try_start<S: AsRef<str>>(args: &[S]) -> Result<Proxy, String> {
        Self::try_start_with_fd_limit(args, None).await
    }

    /// Like [`Proxy::start`], with the process's soft limit on open files set to `limit` (through the shell's
    /// `ulimit -n`, then `exec`, so the pid is floodgate's).
    pub async fn start_with_fd_limit<S: AsRef<str>>(args: &[S], limit: u64) -> Proxy {
        match Self::try_start_with_fd_limit(args, Some(limit)).await {
            Ok(p) => p,
            Err(e) => panic!("floodgate did not start: {e}"),
        }
    }

    pub async fn try_start_with_fd_limit<S: AsRef<str>>(args: &[S], fd_limit: Option<u64>) -> Result<Proxy, String> {
        Self::try_start_with(args, fd_limit, &[]).await
    }

    /// Like [`Proxy::start`], with `env` added to the environment floodgate inherits.
    pub async fn start_with_env<S: AsRef<str>>(args: &[S], env: &[(&str, &str)]) -> Proxy {
        match Self::try_start_with(args, None, env).await {
            Ok(p) => p,
            Err(e) => panic!("floodgate did not start: {e}"),
        }
    }

    pub async fn try_start_with<S: AsRef<str>>(
        args: &[S],
        fd_limit: Option<u64>,
        env: &[(&str, &str)],
    ) -> Result<Proxy, String> {
        let mut command = match fd_limit {
            None => Command::new(floodgate_bin()),
            Some(limit) => {
                let mut sh = Command::new("sh");
                sh.args([
                    "-c",
                    &format!("ulimit -n {limit} && exec \"$0\" \"$@\""),
                    floodgate_bin(),
                ]);
                sh
            }
        };
        // A test that places the admin listener itself (say on 0.0.0.0) gives --admin in `args`.
        if !args.iter().any(|arg| arg.as_ref() == "--admin") {
            command.args(["--admin", "127.0.0.1:0"]);
        }
        let mut child = command
            .args(["--listen", "127.0.0.1:0"])
            .args(args.iter().map(|a| a.as_ref()))
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| format!("spawning {}: {e}", floodgate_bin()))?;
        let output = Arc::new(Mutex::new(String::new()));

        // The ready line comes on stdout, or on stderr when the access log writes to stdout.
        let (ready_tx, ready_rx) = tokio::sync::oneshot::channel::<String>();
        let ready_tx = Arc::new(Mutex::new(Some(ready_tx)));
        let is_ready = {
            let ready_tx = ready_tx.clone();
            move |line: &str| {
                if !line.starts_with("floodgate ready") {
                    return false;
                }
                match ready_tx.lock().unwrap().take() {
                    Some(tx) => {
                        let _ = tx.send(line.to_string());
                        true
                    }
                    None => false,
                }
            }
        };

        let stderr = child.stderr.take().unwrap();
        let err_buf = output.clone();
        let stderr_ready = is_ready.clone();
        let stderr_reader = std::thread::spawn(move || {
            let mut reader = BufReader::new(stderr);
            let mut line = Vec::new();
            loop {
                line.clear();
                match reader.read_until(b'\n', &mut line) {
                    Ok(0) | Err(_) => break,
                    Ok(_) => {
                        let text = String::from_utf8_lossy(&line);
                        if !stderr_ready(text.trim_end()) {
                            append_capped(&err_buf, &text);
                        }
                    }
                }
            }
        });

        let stdout = child.stdout.take().unwrap();
        let out_buf = output.clone();
        let stdout_reader = std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if is_ready(&line) {
                    continue;
                }
                append_capped(&out_buf, &format!("[stdout] {line}\n"));
            }
        });

        let failure = |child: &mut Child, why: String| {
            let _ = child.kill();
            let status = child.wait().ok();
            // Give the reader thread a moment to collect the last words.
            let deadline = Instant::now() + Duration::from_millis(500);
            while Instant::now() < deadline && output.lock().unwrap().is_empty() {
                std::thread::sleep(Duration::from_millis(10));
            }
            format!("{why}; exit status {status:?}; output:\n{}", output.lock().unwrap())
        };
        match tokio::time::timeout(Duration::from_secs(10), ready_rx).await {
            Ok(Ok(line)) => match parse_ready_line(&line) {
                Some((listen, admin)) => Ok(Proxy {
                    child,
                    listen,
                    admin,
                    output,
                    readers: [stdout_reader, stderr_reader],
                    exit: None,
                }),
                None => Err(failure(&mut child, format!("unparsable ready line {line:?}"))),
            },
            Ok(Err(_)) => Err(failure(&mut child, "stdout closed before the ready line".into())),
            Err(_) => Err(failure(&mut child, "no ready line within 10 s".into())),
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Everything the process wrote to stderr (and unexpected stdout lines).
    pub fn output(&self) -> String {
        self.output.lock().unwrap().clone()
    }

    /// Waits until stdout and stderr have both reached their end (the process has exited), so that
    /// [`Proxy::output`] holds everything it wrote.
    pub async fn wait_output_closed(&self, timeout: Duration) {
        wait_until_sync("floodgate's stdout and stderr closed", timeout, || {
            self.readers.iter().all(|reader| reader.is_finished())
        })
        .await;
    }

    /// Current resident set (VmRSS) in KiB.
    pub fn rss_kib(&self) -> u64 {
        proc_status_kib(self.pid(), "VmRSS").expect("VmRSS")
    }

    /// Peak resident set (VmHWM) in KiB.
    pub fn peak_rss_kib(&self) -> u64 {
        proc_status_kib(self.pid(), "VmHWM").expect("VmHWM")
    }

    /// Sends SIGTERM (through `kill(1)`).
    pub fn sigterm(&self) {
        let status = Command::new("kill")
            .args(["-TERM", &self.pid().to_string()])
            .status()
            .expect("running kill");
        assert!(status.success(), "kill -TERM failed: {status}");
    }

    /// Sends SIGHUP (through `kill(1)`): reload the configuration.
    pub fn sighup(&self) {
        let status = Command::new("kill")
            .args(["-HUP", &self.pid().to_string()])
            .status()
            .expect("running kill");
        assert!(status.success(), "kill -HUP failed: {status}");
    }

    /// A request to the admin listener with `body` and, when given, `Authorization: Bearer {token}`.
    pub async fn admin_request(&self, method: Method, path: &str, body: &str, token: Option<&str>) -> Resp {
        let mut request = Request::builder().method(method).uri(path);
        if let Some(token) = token {
            request = request.header("authorization", format!("Bearer {token}"));
        }
        let request = request.body(body_full(body.to_string())).unwrap();
        let mut conn = H1Conn::connect(self.admin).await;
        let resp = conn.send(request).await.unwrap_or_else(|e| panic!("{path}: {e}"));
        collect(resp).await.unwrap_or_else(|e| panic!("{path}: {e}"))
    }

    /// Waits for the process to exit; `None` when it is still running at
    /// the deadline.
    pub async fn wait_exit(&mut self, timeout: Duration) -> Option<ExitStatus> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.exit {
                return Some(status);
            }
            if let Ok(Some(status)) = self.child.try_wait() {
                self.exit = Some(status);
                return Some(status);
            }
            if Instant::now() >= deadline {
                return None;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// `http://127.0.0.1:PORT{path}` on the proxy listener.
    pub fn url(&self, path: &str) -> String {
        format!("http://{}{}", self.listen, path)
    }

    pub async fn admin_get(&self, path: &str) -> Resp {
        get(self.admin, path).await
    }

    /// Waits, within `timeout`, until `/readyz` says `503`: a drain has begun, and the admin listener still answers.
    pub async fn wait_not_ready(&self, timeout: Duration) {
        wait_until("/readyz says 503", timeout, || async {
            try_get(self.admin, "/readyz")
                .await
                .is_ok_and(|r| r.status == StatusCode::SERVICE_UNAVAILABLE)
        })
        .await;
    }

    pub async fn status(&self) -> serde_json::Value {
        let resp = self.admin_get("/status").await;
        assert_eq!(resp.status, StatusCode::OK, "GET /status: {}", resp.text());
        serde_json::from_slice(&resp.body).unwrap_or_else(|e| panic!("GET /status is not JSON ({e}): {}", resp.text()))
    }

    /// `/status` → `upstreams.{name}`.
    pub async fn upstream_status(&self, name: &str) -> serde_json::Value {
        let status = self.status().await;
        status["upstreams"][name].clone()
    }

    /// `/status` → `upstreams.{name}.{field}` as u64 (panics when missing).
    pub async fn upstream_field(&self, name: &str, field: &str) -> u64 {
        let up = self.upstream_status(name).await;
        up[field]
            .as_u64()
            .unwrap_or_else(|| panic!("/status upstreams.{name}.{field} missing or not a number: {up}"))
    }

    pub async fn metrics(&self) -> String {
        let resp = self.admin_get("/metrics").await;
        assert_eq!(resp.status, StatusCode::OK, "GET /metrics");
        resp.text()
    }

    /// `floodgate_requests_total` summed over status classes for one upstream and outcome.
    pub async fn outcome_count(&self, upstream: &str, outcome: &str) -> f64 {
        let samples = parse_metrics(&self.metrics().await);
        metric_sum(
            &samples,
            "floodgate_requests_total",
            &[("upstream", upstream), ("outcome", outcome)],
        )
    }

    /// `floodgate_client_connections`: client connections the proxy has open.
    pub async fn client_connections(&self) -> f64 {
        metric_sum(
            &parse_metrics(&self.metrics().await),
            "floodgate_client_connections",
            &[],
        )
    }

    /// Waits until `upstreams.{name}.in_use` is 0.
    pub async fn wait_in_use_zero(&self, name: &str, timeout: Duration) {
        wait_until(&format!("upstreams.{name}.in_use == 0"), timeout, || async {
            self.upstream_field(name, "in_use").await == 0
        })
        .await
    }

    /// Waits until `upstreams.{name}.{field}` equals `value`.
    pub async fn wait_until_field(&self, name: &str, field: &str, value: u64, timeout: Duration) {
        wait_until(&format!("upstreams.{name}.{field} == {value}"), timeout, || async {
            self.upstream_field(name, field).await == value
        })
        .await
    }

    /// Waits until `upstreams.{name}.queue_depth` equals `depth`.
    pub async fn wait_queue_depth(&self, name: &str, depth: u64, timeout: Duration) {
        wait_until(&format!("upstreams.{name}.queue_depth == {depth}"), timeout, || async {
            self.upstream_field(name, "queue_depth").await == depth
        })
        .await
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        if self.exit.is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
        if std::thread::panicking() {
            let out = self.output();
            let tail_start = out.len().saturating_sub(16 * 1024);
            let mut start = tail_start;
            while !out.is_char_boundary(start) {
                start += 1;
            }
            eprintln!(
                "---- floodgate (pid {}) output, last {} bytes ----\n{}\n---- end ----",
                self.child.id(),
                out.len() - start,
                &out[start..]
            );
        }
    }
}

/// A field of /proc/PID/status in KiB.
pub fn proc_status_kib(pid: u32, key: &str) -> Option<u64> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    text.lines().find_map(|line| {
        let rest = line.strip_prefix(key)?.strip_prefix(':')?;
        rest.split_whitespace().next()?.parse().ok()
    })
}

/// A config file in the temp dir, removed on drop.
pub struct TempConfig {
    pub path: PathBuf,
}

impl TempConfig {
    pub fn new(contents: &str) -> TempConfig {
        static SEQ: AtomicUsize = AtomicUsize::new(0);
        let path = std::env::temp_dir().join(format!(
            "floodgate-test-{}-{}.toml",
            std::process::id(),
            SEQ.fetch_add(1, Ordering::SeqCst)
        ));
        std::fs::write(&path, contents).expect("writing config");
        TempConfig { path }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn path_str(&self) -> String {
        self.path.display().to_string()
    }
}

impl Drop for TempConfig {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// Runs floodgate with `args` expecting it to exit by itself within
/// `timeout` (it is killed and the test fails otherwise). Returns exit
/// status, stdout, stderr.
pub fn run_to_exit(args: &[&str], timeout: Duration) -> (ExitStatus, String, String) {
    run_to_exit_with_env(args, &[], timeout)
}

/// [`run_to_exit`] with `env` added to the environment floodgate inherits.
pub fn run_to_exit_with_env(args: &[&str], env: &[(&str, &str)], timeout: Duration) -> (ExitStatus, String, String) {
    let mut command = Command::new(floodgate_bin());
    command.args(args).envs(env.iter().copied());
    run_command_to_exit(command, timeout)
}

/// [`run_to_exit`] for a command built by the caller (floodgate behind `setpriv`, `sh -c 'ulimit …; exec …'`).
pub fn run_command_to_exit(mut command: Command, timeout: Duration) -> (ExitStatus, String, String) {
    let args: Vec<String> = command
        .get_args()
        .map(|arg| arg.to_string_lossy().into_owned())
        .collect();
    let mut child = command
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawning floodgate");
    let mut stdout = child.stdout.take().unwrap();
    let mut stderr = child.stderr.take().unwrap();
    let out_thread = std::thread::spawn(move || {
        let mut s = Vec::new();
        let _ = stdout.read_to_end(&mut s);
        String::from_utf8_lossy(&s).into_owned()
    });
    let err_thread = std::thread::spawn(move || {
        let mut s = Vec::new();
        let _ = stderr.read_to_end(&mut s);
        String::from_utf8_lossy(&s).into_owned()
    });
    let deadline = Instant::now() + timeout;
    let status = loop {
        if let Some(status) = child.try_wait().expect("try_wait") {
            break status;
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            let out = out_thread.join().unwrap_or_default();
            let err = err_thread.join().unwrap_or_default();
            panic!("floodgate {args:?} was still running after {timeout:?}\nstdout:\n{out}\nstderr:\n{err}");
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    let out = out_thread.join().unwrap_or_default();
    let err = err_thread.join().unwrap_or_default();
    (status, out, err)
}
