//! The shipping files under docker/ (Dockerfile, compose, Prometheus, Grafana, Kubernetes), checked as far as
//! a machine without a Docker engine or a cluster can: every YAML and JSON file parses, every floodgate
//! configuration they mount passes `floodgate check` on the real binary, the paths and ports they name agree
//! with each other and with that configuration, and the Grafana dashboard queries only metrics that a running
//! floodgate exports. Nothing here builds an image or applies a manifest.

mod support;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::time::Duration;

use floodgate::error::Outcome;
use http::StatusCode;
use serde::Deserialize;
use serde_yaml_ng::Value as Yaml;
use support::*;

fn repo() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn docker_dir() -> PathBuf {
    repo().join("docker")
}

fn files_under(dir: &Path, extensions: &[&str]) -> Vec<PathBuf> {
    let mut found = Vec::new();
    let mut pending = vec![dir.to_path_buf()];
    while let Some(dir) = pending.pop() {
        for entry in std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("reading {}: {e}", dir.display())) {
            let path = entry.expect("directory entry").path();
            if path.is_dir() {
                pending.push(path);
            } else if path
                .extension()
                .and_then(|e| e.to_str())
                .is_some_and(|e| extensions.contains(&e))
            {
                found.push(path);
            }
        }
    }
    found.sort();
    found
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()))
}

/// Every document of a YAML file (Kubernetes files may hold several).
fn yaml_documents(path: &Path) -> Vec<Yaml> {
    let text = read(path);
    serde_yaml_ng::Deserializer::from_str(&text)
        .map(|doc| Yaml::deserialize(doc).unwrap_or_else(|e| panic!("{}: {e}", path.display())))
        .collect()
}

fn yaml(path: &Path) -> Yaml {
    let mut docs = yaml_documents(path);
    assert_eq!(docs.len(), 1, "{}: expected one YAML document", path.display());
    docs.remove(0)
}

fn str_of<'a>(value: &'a Yaml, what: &str) -> &'a str {
    value
        .as_str()
        .unwrap_or_else(|| panic!("{what}: expected a string, got {value:?}"))
}

fn seq_of<'a>(value: &'a Yaml, what: &str) -> &'a [Yaml] {
    value
        .as_sequence()
        .map(Vec::as_slice)
        .unwrap_or_else(|| panic!("{what}: expected a list, got {value:?}"))
}

/// What `floodgate check` makes of a configuration file: the effective configuration it prints, parsed.
fn checked_config(path: &Path) -> toml::Table {
    let path = path.display().to_string();
    let (status, stdout, stderr) = run_to_exit(&["check", "--config", &path], Duration::from_secs(10));
    assert!(status.success(), "floodgate check --config {path} failed: {stderr}");
    stdout
        .parse()
        .unwrap_or_else(|e| panic!("floodgate check printed no TOML for {path}: {e}\n{stdout}"))
}

fn port_of(address: &toml::Value) -> u16 {
    let address = address.as_str().expect("an address string");
    address
        .rsplit_once(':')
        .and_then(|(_, port)| port.parse().ok())
        .unwrap_or_else(|| panic!("no port in {address:?}"))
}

fn listen_port(config: &toml::Table) -> u16 {
    port_of(&config["listen"])
}

fn admin_port(config: &toml::Table) -> u16 {
    port_of(&config["admin"])
}

fn shutdown_timeout(config: &toml::Table) -> Duration {
    humantime::parse_duration(config["shutdown_timeout"].as_str().expect("shutdown_timeout")).expect("a duration")
}

/// The one upstream's URL split into host and port (every shipped config has exactly one).
fn single_upstream(config: &toml::Table) -> (String, u16, toml::Table) {
    let upstreams = config["upstreams"].as_table().expect("upstreams");
    assert_eq!(upstreams.len(), 1, "expected one upstream: {upstreams:?}");
    let upstream = upstreams.values().next().unwrap().as_table().unwrap().clone();
    let url = upstream["url"].as_str().expect("url");
    let authority = url.strip_prefix("http://").unwrap_or(url).trim_end_matches('/');
    let (host, port) = authority.rsplit_once(':').expect("an explicit port");
    (host.to_string(), port.parse().expect("a port"), upstream)
}

fn docker_config() -> PathBuf {
    docker_dir().join("floodgate.toml")
}

/// The ConfigMap's floodgate.toml, written to a temporary file for `floodgate check`.
fn k8s_config() -> TempConfig {
    let configmap = yaml(&docker_dir().join("k8s/configmap.yaml"));
    assert_eq!(configmap["kind"], "ConfigMap");
    TempConfig::new(str_of(
        &configmap["data"]["floodgate.toml"],
        "ConfigMap data floodgate.toml",
    ))
}

#[test]
fn every_yaml_and_json_file_under_docker_parses() {
    let yaml_files = files_under(&docker_dir(), &["yaml", "yml"]);
    // compose, prometheus, two Grafana provisioning files, three Kubernetes manifests: a file that went
    // missing (or a renamed extension nothing parses any more) would otherwise pass unnoticed.
    assert!(yaml_files.len() >= 7, "found only {yaml_files:?}");
    for path in &yaml_files {
        let docs = yaml_documents(path);
        assert!(
            docs.iter().all(|doc| doc.is_mapping()),
            "{}: every document should be a mapping",
            path.display()
        );
    }
    let json_files = files_under(&docker_dir(), &["json"]);
    assert!(!json_files.is_empty(), "no JSON file under docker/");
    for path in &json_files {
        serde_json::from_str::<serde_json::Value>(&read(path)).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    }
}

#[test]
fn mounted_configurations_pass_floodgate_check() {
    for config in [checked_config(&docker_config()), checked_config(k8s_config().path())] {
        // In a container or a pod the listeners must not stay on loopback, where nothing outside can reach
        // them (the kubelet's probes and Prometheus included).
        for key in ["listen", "admin"] {
            let address = config[key].as_str().unwrap();
            assert!(address.starts_with("0.0.0.0:"), "{key} = {address}");
        }
    }
}

/// Dockerfile instructions, continuation lines joined, comments dropped.
fn dockerfile_instructions() -> Vec<(String, String)> {
    let text = read(&docker_dir().join("Dockerfile"));
    let mut instructions = Vec::new();
    let mut current = String::new();
    for line in text.lines() {
        let trimmed = line.trim();
        if trimmed.starts_with('#') || (trimmed.is_empty() && current.is_empty()) {
            continue;
        }
        if let Some(head) = trimmed.strip_suffix('\\') {
            current.push_str(head);
            current.push(' ');
            continue;
        }
        current.push_str(trimmed);
        let (keyword, rest) = current.split_once(' ').unwrap_or((&current, ""));
        instructions.push((keyword.to_ascii_uppercase(), rest.trim().to_string()));
        current.clear();
    }
    instructions
}

fn exec_form(args: &str) -> Vec<String> {
    serde_json::from_str(args).unwrap_or_else(|e| panic!("not exec (JSON) form: {args}: {e}"))
}

#[test]
fn dockerfile_agrees_with_the_repository_and_its_configuration() {
    let config = checked_config(&docker_config());
    let instructions = dockerfile_instructions();
    let ignored: Vec<String> = read(&repo().join(".dockerignore"))
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .map(str::to_string)
        .collect();

    let stages: Vec<usize> = (0..instructions.len())
        .filter(|&i| instructions[i].0 == "FROM")
        .collect();
    assert!(stages.len() >= 2, "expected a multi-stage build");
    // Base images by their full names (no registry alias needed), the builder on floodgate's rust-version.
    let manifest: toml::Table = read(&repo().join("Cargo.toml")).parse().unwrap();
    let rust_version = manifest["package"]["rust-version"].as_str().unwrap();
    for &stage in &stages {
        let image = instructions[stage].1.split_whitespace().next().unwrap();
        assert!(
            image.starts_with("docker.io/library/"),
            "FROM {image}: not fully qualified"
        );
        assert!(
            !image.ends_with(":latest") && image.contains(':'),
            "FROM {image}: a floating tag"
        );
    }
    let builder = instructions[stages[0]].1.split_whitespace().next().unwrap();
    assert!(
        builder.starts_with(&format!("docker.io/library/rust:{rust_version}-")),
        "the builder {builder} is not on rust-version {rust_version}"
    );
    // Everything cargo builds floodgate from is in the image's context.
    for needed in ["Cargo.toml", "Cargo.lock", "build.rs", "src"] {
        assert!(
            instructions.iter().any(|(k, args)| k == "COPY"
                && args
                    .split_whitespace()
                    .any(|word| word == needed || word.trim_end_matches('/') == needed)),
            "the build does not COPY {needed}"
        );
    }
    // The cached dependency layer is built as the real build is (same profile, same features), or the real build
    // would rebuild every dependency; and that build is the shipped profile with the OTLP exporter.
    let builds: Vec<Vec<&str>> = instructions[stages[0]..stages[stages.len() - 1]]
        .iter()
        .filter(|(k, _)| k == "RUN")
        .flat_map(|(_, args)| args.split("&&"))
        .map(|command| command.split_whitespace().collect::<Vec<_>>())
        .filter(|words| words.starts_with(&["cargo", "build"]))
        .collect();
    assert_eq!(
        builds.len(),
        2,
        "expected a dependency build and the real one: {builds:?}"
    );
    assert_eq!(
        builds[0], builds[1],
        "the cached layer is built otherwise than the image's binary"
    );
    for expected in [["--profile", "dist"], ["--features", "otlp"]] {
        assert!(
            builds[1].windows(2).any(|pair| pair == expected),
            "the image's build lacks {expected:?}: {:?}",
            builds[1]
        );
    }
    let runtime = &instructions[*stages.last().unwrap()..];

    // Every COPY from the build context names something that exists and that .dockerignore lets through.
    let mut copied_to = Vec::new();
    for (keyword, args) in &instructions {
        if keyword != "COPY" || args.starts_with("--from") {
            continue;
        }
        let parts: Vec<&str> = args.split_whitespace().collect();
        let (destination, sources) = parts.split_last().expect("COPY with arguments");
        for source in sources {
            assert!(repo().join(source).exists(), "COPY {source}: not in the repository");
            let first = source.split('/').next().unwrap();
            assert!(
                !ignored.iter().any(|pattern| pattern == source || pattern == first),
                "COPY {source}: excluded by .dockerignore"
            );
        }
        copied_to.push((sources.to_vec(), destination.to_string()));
    }
    let config_path = "/etc/floodgate/floodgate.toml";
    assert!(
        copied_to
            .iter()
            .any(|(sources, destination)| sources == &["docker/floodgate.toml"] && destination == config_path),
        "docker/floodgate.toml is not copied to {config_path}: {copied_to:?}"
    );

    let last = |keyword: &str| {
        runtime
            .iter()
            .rev()
            .find(|(k, _)| k == keyword)
            .map(|(_, args)| args.clone())
            .unwrap_or_else(|| panic!("no {keyword} in the runtime stage"))
    };
    let cmd = exec_form(&last("CMD"));
    assert_eq!(cmd, ["--config", config_path], "CMD");
    let entrypoint = exec_form(&last("ENTRYPOINT"));
    assert!(
        copied_to.iter().any(|(_, destination)| destination == &entrypoint[0])
            || runtime.iter().any(|(k, a)| k == "COPY" && a.ends_with(&entrypoint[0])),
        "ENTRYPOINT {} is not what the runtime stage copies in",
        entrypoint[0]
    );

    let exposed: BTreeSet<u16> = last("EXPOSE")
        .split_whitespace()
        .map(|p| p.trim_end_matches("/tcp").parse().expect("a port"))
        .collect();
    assert_eq!(
        exposed,
        BTreeSet::from([listen_port(&config), admin_port(&config)]),
        "EXPOSE against docker/floodgate.toml"
    );

    let user = last("USER");
    let uid = user.split(':').next().unwrap();
    assert!(uid != "root" && uid != "0", "runs as root: USER {user}");
    assert_eq!(last("STOPSIGNAL"), "SIGTERM");

    // HEALTHCHECK [options] CMD [...]: floodgate's own healthcheck against /healthz, at the admin address of the
    // configuration the image runs with (no shell form: the probe must not depend on /bin/sh; no curl needed).
    let healthcheck = last("HEALTHCHECK");
    let (_, probe) = healthcheck.split_once("CMD ").expect("HEALTHCHECK ... CMD");
    let probe = exec_form(probe.trim());
    assert_eq!(
        probe,
        [
            &entrypoint[0],
            "healthcheck",
            "--config",
            config_path,
            "--path",
            "/healthz"
        ],
        "HEALTHCHECK"
    );
    assert!(
        !runtime
            .iter()
            .any(|(k, args)| k == "RUN" && args.contains("apt-get install")),
        "the runtime stage installs packages it does not need"
    );
}

#[test]
fn compose_agrees_with_its_files_and_floodgate_configuration() {
    let dir = docker_dir();
    let compose = yaml(&dir.join("compose.yaml"));
    let config = checked_config(&docker_config());
    let services = compose["services"].as_mapping().expect("services");

    // Every bind mount's source exists, relative to the compose file.
    let mut mounts = Vec::new();
    for (name, service) in services {
        let name = str_of(name, "service name");
        for volume in service["volumes"].as_sequence().into_iter().flatten() {
            let volume = str_of(volume, "volume");
            let mut parts = volume.split(':');
            let (source, target) = (parts.next().unwrap(), parts.next().expect("source:target"));
            assert!(
                dir.join(source).exists(),
                "{name}: mounts {source}, which does not exist"
            );
            mounts.push((name.to_string(), source.to_string(), target.to_string()));
        }
    }
    let mounted = |service: &str, target: &str| {
        mounts
            .iter()
            .find(|(s, _, t)| s == service && t == target)
            .map(|(_, source, _)| dir.join(source))
            .unwrap_or_else(|| panic!("{service} mounts nothing on {target}: {mounts:?}"))
    };

    let floodgate = &compose["services"]["floodgate"];
    let build = &floodgate["build"];
    let context = dir.join(str_of(&build["context"], "build.context"));
    assert!(context.join(str_of(&build["dockerfile"], "build.dockerfile")).is_file());
    assert_eq!(
        mounted("floodgate", "/etc/floodgate/floodgate.toml")
            .canonicalize()
            .unwrap(),
        docker_config().canonicalize().unwrap()
    );
    let published: BTreeSet<u16> = seq_of(&floodgate["ports"], "floodgate ports")
        .iter()
        .map(|p| str_of(p, "port").rsplit(':').next().unwrap().parse().expect("a port"))
        .collect();
    assert!(published.contains(&listen_port(&config)) && published.contains(&admin_port(&config)));
    let grace = humantime::parse_duration(str_of(&floodgate["stop_grace_period"], "stop_grace_period")).unwrap();
    assert!(
        grace > shutdown_timeout(&config),
        "stop_grace_period {grace:?} does not cover shutdown_timeout"
    );

    // The upstream is a compose service, listening where the config dials it.
    let (host, port, _) = single_upstream(&config);
    let upstream = &compose["services"][host.as_str()];
    assert!(upstream.is_mapping(), "the upstream {host} is not a compose service");
    let command: Vec<&str> = seq_of(&upstream["command"], "upstream command")
        .iter()
        .map(|a| str_of(a, "argument"))
        .collect();
    assert_eq!(
        command,
        ["--port", &port.to_string()],
        "{host}'s port against the config"
    );

    // Prometheus scrapes floodgate's admin port, at the path the admin listener serves.
    let prometheus = yaml(&mounted("prometheus", "/etc/prometheus/prometheus.yml"));
    let job = &seq_of(&prometheus["scrape_configs"], "scrape_configs")[0];
    assert_eq!(job["metrics_path"], "/metrics");
    let targets: Vec<&str> = seq_of(&job["static_configs"][0]["targets"], "targets")
        .iter()
        .map(|t| str_of(t, "target"))
        .collect();
    assert_eq!(targets, [format!("floodgate:{}", admin_port(&config))]);

    // Grafana: the datasource points at the prometheus service, the dashboard provider at the directory the
    // dashboards are mounted on, and the dashboard at the datasource's uid.
    let provisioning = mounted("grafana", "/etc/grafana/provisioning");
    let datasources = yaml(&provisioning.join("datasources/prometheus.yaml"));
    let datasource = &seq_of(&datasources["datasources"], "datasources")[0];
    assert_eq!(datasource["url"], "http://prometheus:9090");
    assert!(services.contains_key("prometheus"));
    let providers = yaml(&provisioning.join("dashboards/floodgate.yaml"));
    let dashboards_at = str_of(
        &seq_of(&providers["providers"], "providers")[0]["options"]["path"],
        "path",
    );
    let dashboards = mounted("grafana", dashboards_at);
    let dashboard: serde_json::Value = serde_json::from_str(&read(&dashboards.join("floodgate.json"))).unwrap();
    // Every panel reads the dashboard's datasource variable, a Prometheus one, which the provisioned datasource
    // (the default) fills: the same file works provisioned here and imported into another Grafana.
    assert_eq!(datasource["isDefault"].as_bool(), Some(true), "{datasource:?}");
    assert_eq!(datasource["type"], "prometheus");
    let variables = dashboard["templating"]["list"].as_array().unwrap();
    let variable = variables
        .iter()
        .find(|v| v["name"] == "datasource")
        .expect("a datasource variable");
    assert_eq!(
        (&variable["type"], &variable["query"]),
        (&"datasource".into(), &"prometheus".into())
    );
    for panel in dashboard["panels"].as_array().unwrap() {
        assert_eq!(panel["datasource"]["uid"], "${datasource}", "panel {}", panel["title"]);
    }
}

fn container<'a>(pod: &'a Yaml, name: &str) -> &'a Yaml {
    seq_of(&pod["containers"], "containers")
        .iter()
        .find(|c| c["name"] == name)
        .unwrap_or_else(|| panic!("no container {name}"))
}

fn container_port(container: &Yaml, name: &str) -> u16 {
    seq_of(&container["ports"], "ports")
        .iter()
        .find(|p| p["name"] == name)
        .and_then(|p| p["containerPort"].as_u64())
        .unwrap_or_else(|| panic!("no port named {name}")) as u16
}

fn pre_stop_sleep(container: &Yaml) -> u64 {
    container["lifecycle"]["preStop"]["sleep"]["seconds"]
        .as_u64()
        .unwrap_or(0)
}

#[test]
fn kubernetes_sidecar_agrees_with_its_configuration() {
    let dir = docker_dir().join("k8s");
    let config = checked_config(k8s_config().path());
    let deployment = yaml(&dir.join("deployment.yaml"));
    let service = yaml(&dir.join("service.yaml"));
    let configmap = yaml(&dir.join("configmap.yaml"));
    assert_eq!(deployment["kind"], "Deployment");
    assert_eq!(service["kind"], "Service");
    let template = &deployment["spec"]["template"];
    let pod = &template["spec"];
    assert_eq!(pod["enableServiceLinks"], false);

    let floodgate = container(pod, "floodgate");
    let app = container(pod, "app");
    assert_eq!(container_port(floodgate, "http"), listen_port(&config));
    assert_eq!(container_port(floodgate, "admin"), admin_port(&config));

    // floodgate dials the application container over the pod's loopback.
    let (host, port, _) = single_upstream(&config);
    assert!(host == "127.0.0.1" || host == "localhost", "upstream host {host}");
    assert_eq!(container_port(app, "app"), port);

    // The config is the ConfigMap's, mounted where the args point.
    let volume = seq_of(&pod["volumes"], "volumes")
        .iter()
        .find(|v| v["configMap"]["name"] == configmap["metadata"]["name"])
        .expect("a volume from the ConfigMap");
    let mount = seq_of(&floodgate["volumeMounts"], "volumeMounts")
        .iter()
        .find(|m| m["name"] == volume["name"])
        .expect("the ConfigMap volume mounted in floodgate");
    let config_path = format!("{}/floodgate.toml", str_of(&mount["mountPath"], "mountPath"));
    let args: Vec<&str> = seq_of(&floodgate["args"], "args")
        .iter()
        .map(|a| str_of(a, "arg"))
        .collect();
    assert_eq!(args, ["--config", config_path.as_str()]);

    // Probes: readiness on /readyz (503 while draining takes the pod out of the endpoints), liveness on
    // /healthz, both on the admin port.
    for (probe, path) in [("readinessProbe", "/readyz"), ("livenessProbe", "/healthz")] {
        let get = &floodgate[probe]["httpGet"];
        assert_eq!(get["path"], path, "{probe}");
        let port = &get["port"];
        let port = port
            .as_u64()
            .map_or_else(|| container_port(floodgate, str_of(port, "port")), |p| p as u16);
        assert_eq!(port, admin_port(&config), "{probe} port");
        // One missed probe (a lost packet, a flood at the admin port) must not take the pod out or restart it.
        let threshold = floodgate[probe]["failureThreshold"].as_u64().unwrap_or(3);
        assert!(
            threshold >= 2,
            "{probe}: failureThreshold {threshold} fails the pod at the first missed probe"
        );
    }

    // Termination: floodgate's preStop sleep, then its drain, fit in the grace period, and the application
    // outlives both so that the requests floodgate is finishing still have somewhere to go.
    let drain = pre_stop_sleep(floodgate) + shutdown_timeout(&config).as_secs();
    let grace = pod["terminationGracePeriodSeconds"]
        .as_u64()
        .expect("terminationGracePeriodSeconds");
    assert!(
        grace > drain,
        "grace {grace}s does not cover preStop + shutdown_timeout ({drain}s)"
    );
    assert!(
        pre_stop_sleep(app) >= drain,
        "the application stops before floodgate has drained"
    );
    assert!(
        grace > pre_stop_sleep(app),
        "the application's preStop outlasts the grace period"
    );

    // The Service reaches floodgate's listener, never the application's port.
    let selector = service["spec"]["selector"].as_mapping().expect("selector");
    for (key, value) in selector {
        assert_eq!(
            &template["metadata"]["labels"][str_of(key, "label")],
            value,
            "selector {key:?}"
        );
    }
    for port in seq_of(&service["spec"]["ports"], "Service ports") {
        let target = &port["targetPort"];
        let target = target
            .as_u64()
            .map_or_else(|| container_port(floodgate, str_of(target, "targetPort")), |p| p as u16);
        assert_eq!(target, listen_port(&config), "Service targetPort");
    }

    // Prometheus annotations point at the admin listener.
    let annotations = &template["metadata"]["annotations"];
    assert_eq!(annotations["prometheus.io/scrape"], "true");
    assert_eq!(
        annotations["prometheus.io/port"],
        admin_port(&config).to_string().as_str()
    );
    assert_eq!(annotations["prometheus.io/path"], "/metrics");
}

/// Every PromQL string of the dashboard (panel targets and template variable queries).
fn promql_strings(value: &serde_json::Value, out: &mut Vec<String>) {
    match value {
        serde_json::Value::Object(map) => {
            for (key, value) in map {
                match (key.as_str(), value) {
                    ("expr" | "definition", serde_json::Value::String(s)) => out.push(s.clone()),
                    ("query", serde_json::Value::String(s)) if s.contains('(') => out.push(s.clone()),
                    _ => promql_strings(value, out),
                }
            }
        }
        serde_json::Value::Array(items) => items.iter().for_each(|v| promql_strings(v, out)),
        _ => {}
    }
}

/// `floodgate_*` identifiers in a PromQL string, each with the label names its selector matches on and the
/// values of its `outcome` matchers.
fn metric_references(promql: &str) -> Vec<(String, Vec<(String, String)>)> {
    let mut found = Vec::new();
    let mut rest = promql;
    while let Some(at) = rest.find("floodgate_") {
        rest = &rest[at..];
        let end = rest
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(rest.len());
        let name = rest[..end].to_string();
        rest = &rest[end..];
        let mut matchers = Vec::new();
        if let Some(selector) = rest.strip_prefix('{') {
            let close = selector.find('}').expect("unclosed selector");
            for matcher in selector[..close].split(',').map(str::trim).filter(|m| !m.is_empty()) {
                let op = matcher.find(['=', '!']).expect("a matcher operator");
                let value = matcher[op..]
                    .trim_start_matches(['=', '!', '~'])
                    .trim()
                    .trim_matches('"');
                matchers.push((matcher[..op].trim().to_string(), value.to_string()));
            }
        }
        found.push((name, matchers));
    }
    found
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dashboard_queries_only_metrics_floodgate_exports() {
    let dashboard: serde_json::Value =
        serde_json::from_str(&read(&docker_dir().join("grafana/dashboards/floodgate.json"))).unwrap();
    let mut queries = Vec::new();
    promql_strings(&dashboard, &mut queries);
    assert!(queries.len() >= 6, "found only {queries:?}");

    // One request through, so that the counters that appear on first use are there too.
    let upstream = Upstream::start().await;
    let proxy = Proxy::for_upstream(&upstream, 2, &[]).await;
    assert_eq!(get(proxy.listen, "/").await.status, StatusCode::OK);
    proxy.wait_in_use_zero("default", Duration::from_secs(5)).await;
    let samples = parse_metrics(&proxy.metrics().await);

    let outcomes: Vec<&str> = Outcome::ALL.iter().map(|o| o.as_str()).collect();
    let mut referenced = 0;
    for query in &queries {
        for (name, matchers) in metric_references(query) {
            referenced += 1;
            let series: Vec<&Sample> = samples.iter().filter(|s| s.name == name).collect();
            assert!(
                !series.is_empty(),
                "the dashboard queries {name}, which /metrics does not export ({query})"
            );
            for (label, value) in matchers {
                // Prometheus adds its target's labels as it scrapes: every query is filtered by them.
                if label == "job" || label == "instance" {
                    continue;
                }
                assert!(
                    series.iter().any(|s| s.labels.contains_key(&label)),
                    "{name} has no label {label} ({query})"
                );
                // A regex such as shed_.* must match an outcome floodgate can record.
                if label == "outcome" && !value.starts_with('$') {
                    let prefix = value.strip_suffix(".*").unwrap_or(&value);
                    let exact = !value.ends_with(".*");
                    assert!(
                        outcomes
                            .iter()
                            .any(|o| if exact { *o == prefix } else { o.starts_with(prefix) }),
                        "outcome {value} matches no outcome floodgate records ({query})"
                    );
                }
            }
        }
    }
    assert!(referenced >= 6, "only {referenced} metric references in {queries:?}");

    // In a shared Prometheus: each query keeps to floodgate's own targets, and each legend says which replica.
    for panel in dashboard["panels"].as_array().unwrap() {
        for target in panel["targets"].as_array().unwrap() {
            let (expr, legend) = (
                target["expr"].as_str().unwrap(),
                target["legendFormat"].as_str().unwrap_or(""),
            );
            for (name, matchers) in metric_references(expr) {
                let labels: Vec<&str> = matchers.iter().map(|(label, _)| label.as_str()).collect();
                assert!(
                    labels.contains(&"job") && labels.contains(&"instance"),
                    "{name} unfiltered by job and instance in {expr}"
                );
            }
            assert!(
                expr.contains(r#"job=~"$job""#) && expr.contains(r#"instance=~"$instance""#),
                "{expr}"
            );
            assert!(
                legend.contains("{{instance}}"),
                "a legend without the instance: {legend}"
            );
            assert!(!expr.contains("[1m]"), "a fixed window, not $__rate_interval: {expr}");
        }
    }

    // The cap line is the metric, not a constant to keep in step with the config.
    assert!(
        queries.iter().any(|q| q.contains("floodgate_upstream_max_connections")),
        "no cap line in {queries:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn healthcheck_exits_0_while_ready_and_1_while_draining_or_gone() {
    let upstream = Upstream::start().await;
    let mut proxy = Proxy::for_upstream(&upstream, 1, &["--shutdown-timeout", "5s"]).await;
    let admin = proxy.admin.to_string();
    let check = |path: &'static str| {
        let admin = admin.clone();
        tokio::task::spawn_blocking(move || {
            run_to_exit(
                &["healthcheck", "--admin", &admin, "--path", path],
                Duration::from_secs(10),
            )
        })
    };
    let (status, _, stderr) = check("/readyz").await.unwrap();
    assert!(status.success(), "ready: {stderr}");
    // Draining, held open by a request at the upstream: alive, not ready.
    let stalled = tokio::spawn(get(proxy.listen, "/stall"));
    wait_until_sync("the request at the upstream", Duration::from_secs(5), || {
        upstream.inflight() == 1
    })
    .await;
    proxy.sigterm();
    proxy.wait_not_ready(Duration::from_secs(5)).await;
    let (status, _, stderr) = check("/readyz").await.unwrap();
    assert_eq!(status.code(), Some(1), "draining: {stderr}");
    assert!(stderr.contains("503"), "{stderr}");
    let (status, _, stderr) = check("/healthz").await.unwrap();
    assert!(status.success(), "alive while draining: {stderr}");
    upstream.release_stalled();
    let _ = stalled.await;
    proxy
        .wait_exit(Duration::from_secs(10))
        .await
        .expect("floodgate exited");
    let (status, _, stderr) = check("/healthz").await.unwrap();
    assert_eq!(status.code(), Some(1), "gone: {stderr}");
    assert!(stderr.starts_with("floodgate healthcheck: "), "{stderr}");
}

#[test]
fn completions_and_the_manual_page_are_generated_from_the_command_line() {
    for (shell, marker) in [
        ("bash", "_floodgate()"),
        ("zsh", "#compdef floodgate"),
        ("fish", "complete -c floodgate"),
    ] {
        let (status, stdout, stderr) = run_to_exit(&["completions", shell], Duration::from_secs(10));
        assert!(status.success(), "{shell}: {stderr}");
        assert!(stdout.contains(marker), "{shell}: {stdout}");
        for word in [
            "check",
            "demo",
            "healthcheck",
            "reload",
            "max-connections",
            "max-tunnels",
        ] {
            assert!(stdout.contains(word), "{shell} completion lacks {word}");
        }
    }
    let (status, page, stderr) = run_to_exit(&["man"], Duration::from_secs(10));
    assert!(status.success(), "{stderr}");
    assert!(
        page.starts_with(".ie") || page.contains(".TH floodgate 1"),
        "{}",
        &page[..page.len().min(300)]
    );
    for word in ["max\\-connections", "healthcheck", "completions"] {
        assert!(page.contains(word), "the manual page lacks {word}");
    }
    let (status, _, stderr) = run_to_exit(&["completions", "tcsh"], Duration::from_secs(10));
    assert_eq!(status.code(), Some(2), "an unknown shell is a usage error: {stderr}");
}

/// `KEY=value` lines of one `[section]` of a systemd unit file, in order (keys may repeat).
fn unit_section(text: &str, section: &str) -> Vec<(String, String)> {
    let mut inside = false;
    let mut entries = Vec::new();
    for line in text.lines().map(str::trim) {
        if line.starts_with('[') {
            inside = line == format!("[{section}]");
            continue;
        }
        if !inside || line.is_empty() || line.starts_with('#') {
            continue;
        }
        let (key, value) = line.split_once('=').unwrap_or_else(|| panic!("not KEY=value: {line}"));
        entries.push((key.to_string(), value.to_string()));
    }
    entries
}

#[test]
fn the_deb_and_its_systemd_unit_agree_with_the_binary_and_its_configuration() {
    let manifest: toml::Table = read(&repo().join("Cargo.toml")).parse().unwrap();
    let deb = &manifest["package"]["metadata"]["deb"];
    let script = read(&repo().join("packaging/deb.sh"));
    // Every asset is in the repository or made by the script that builds the package.
    let mut installed = Vec::new();
    for asset in deb["assets"].as_array().unwrap() {
        let asset = asset.as_array().unwrap();
        let (source, destination) = (asset[0].as_str().unwrap(), asset[1].as_str().unwrap());
        if let Some(made) = source.strip_prefix("target/") {
            let name = made.rsplit('/').next().unwrap();
            let stem = name.split('.').next().unwrap();
            assert!(
                script.contains(stem) && (made.starts_with("release/") || made.starts_with("packaging/")),
                "{source} is not made by packaging/deb.sh"
            );
        } else {
            assert!(repo().join(source).exists(), "{source} is not in the repository");
        }
        let destination = if destination.ends_with('/') {
            format!("/{destination}{}", source.rsplit('/').next().unwrap())
        } else {
            format!("/{destination}")
        };
        installed.push(destination);
    }
    for path in [
        "/usr/bin/floodgate",
        "/etc/floodgate/floodgate.toml",
        "/usr/share/man/man1/floodgate.1.gz",
        "/usr/share/bash-completion/completions/floodgate",
    ] {
        assert!(
            installed.iter().any(|p| p == path),
            "the package does not install {path}: {installed:?}"
        );
    }
    let conf_files: Vec<&str> = deb["conf-files"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap())
        .collect();
    assert_eq!(
        conf_files,
        ["/etc/floodgate/floodgate.toml"],
        "the configuration survives upgrades"
    );
    let units = &deb["systemd-units"];
    assert_eq!(units["unit-scripts"].as_str(), Some("packaging/"));

    let unit = read(&repo().join("packaging/floodgate.service"));
    let service = unit_section(&unit, "Service");
    let value = |key: &str| {
        service
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
            .unwrap_or_else(|| panic!("no {key} in [Service]"))
    };
    assert_eq!(value("Type"), "notify", "floodgate tells systemd when it is ready");
    assert_eq!(
        value("ExecStart"),
        "/usr/bin/floodgate --config /etc/floodgate/floodgate.toml"
    );
    // A reload runs `floodgate check` first, which says nothing for a good file and refuses a bad one (exit 2,
    // the problems on stderr: the journal), so `systemctl reload` fails visibly and the signal is never sent.
    let reloads: Vec<&str> = service
        .iter()
        .filter(|(k, _)| k == "ExecReload")
        .map(|(_, v)| v.as_str())
        .collect();
    let unit_config = "/etc/floodgate/floodgate.toml";
    assert_eq!(
        reloads,
        [
            format!("/usr/bin/floodgate check --quiet --config {unit_config}").as_str(),
            "/bin/kill -HUP $MAINPID"
        ]
    );
    let check_args: Vec<&str> = reloads[0].split_whitespace().skip(1).collect();
    let with_config = |path: &str| -> Vec<String> {
        check_args
            .iter()
            .map(|arg| {
                if *arg == unit_config {
                    path.to_string()
                } else {
                    arg.to_string()
                }
            })
            .collect()
    };
    let good = with_config(&repo().join("config/floodgate.toml").display().to_string());
    let good: Vec<&str> = good.iter().map(String::as_str).collect();
    let (status, stdout, stderr) = run_to_exit(&good, Duration::from_secs(10));
    assert!(status.success(), "{stderr}");
    assert!(
        stdout.is_empty() && stderr.is_empty(),
        "check --quiet printed {stdout}{stderr}"
    );
    let broken = TempConfig::new("listen = \"nowhere\"\n");
    let bad = with_config(&broken.path_str());
    let bad: Vec<&str> = bad.iter().map(String::as_str).collect();
    let (status, stdout, stderr) = run_to_exit(&bad, Duration::from_secs(10));
    assert_eq!(status.code(), Some(2), "{stdout}{stderr}");
    assert!(stderr.contains("listen = \"nowhere\""), "{stderr}");
    // The same configuration at start-up exits 2 too, which the unit does not restart: a restart cannot mend it.
    let (status, _, _) = run_to_exit(&["--config", &broken.path_str()], Duration::from_secs(10));
    let prevented: Vec<i32> = value("RestartPreventExitStatus")
        .split_whitespace()
        .map(|code| code.parse().expect("an exit status"))
        .collect();
    assert!(
        status.code().is_some_and(|code| prevented.contains(&code)),
        "a refused configuration exits {status:?}, which the unit restarts (RestartPreventExitStatus={prevented:?})"
    );
    assert_eq!(value("Restart"), "on-failure");
    assert_eq!(value("KillSignal"), "SIGTERM");
    // The drain must finish before systemd kills what is left.
    let config = checked_config(&repo().join("config/floodgate.toml"));
    let stop: u64 = value("TimeoutStopSec").parse().unwrap();
    assert!(
        Duration::from_secs(stop) > shutdown_timeout(&config),
        "TimeoutStopSec {stop}"
    );
    for (key, expected) in [
        ("NoNewPrivileges", "yes"),
        ("ProtectSystem", "strict"),
        ("ProtectHome", "yes"),
        ("PrivateTmp", "yes"),
        ("DynamicUser", "yes"),
        ("CapabilityBoundingSet", ""),
    ] {
        assert_eq!(value(key), expected, "{key}");
    }
    let install = unit_section(&unit, "Install");
    assert!(install.iter().any(|(k, v)| k == "WantedBy" && v == "multi-user.target"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn floodgate_tells_systemd_when_it_is_ready_reloading_and_stopping() {
    let dir = pki::TempDir::new();
    let path = dir.0.join("notify.sock");
    let socket = tokio::net::UnixDatagram::bind(&path).unwrap();
    let upstream = Upstream::start().await;
    let notify = path.display().to_string();
    let mut proxy = Proxy::start_with_env(&["--upstream", &upstream.url()], &[("NOTIFY_SOCKET", &notify)]).await;
    let receive = || async {
        let mut message = vec![0u8; 1024];
        let n = tokio::time::timeout(Duration::from_secs(10), socket.recv(&mut message))
            .await
            .expect("no notification within 10 s")
            .unwrap();
        String::from_utf8_lossy(&message[..n]).into_owned()
    };
    let ready = receive().await;
    assert!(ready.lines().any(|line| line == "READY=1"), "{ready}");
    assert!(
        ready.contains(&format!("STATUS=serving listen={}", proxy.listen)),
        "{ready}"
    );
    proxy.sighup();
    let reloading = receive().await;
    assert!(reloading.lines().any(|line| line == "RELOADING=1"), "{reloading}");
    assert!(
        reloading.lines().any(|line| line.starts_with("MONOTONIC_USEC=")),
        "{reloading}"
    );
    assert_eq!(receive().await.trim(), "READY=1");
    proxy.sigterm();
    assert_eq!(receive().await.trim(), "STOPPING=1");
    assert!(proxy
        .wait_exit(Duration::from_secs(10))
        .await
        .expect("exited")
        .success());
}

/// A `major.minor[.patch]` version as numbers, for comparing.
fn version_of(text: &str) -> (u64, u64, u64) {
    let mut parts = text.split('.').map(|part| part.parse::<u64>().unwrap_or(0));
    (
        parts.next().unwrap_or(0),
        parts.next().unwrap_or(0),
        parts.next().unwrap_or(0),
    )
}

#[test]
fn rust_version_is_at_least_what_every_dependency_it_builds_declares() {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_string());
    // This machine's platform only: offline, cargo can describe only the crates this build fetched, and a crate
    // only another platform builds (Windows' console support, say) was never fetched on a fresh machine.
    let host = std::process::Command::new(&cargo)
        .arg("-vV")
        .output()
        .expect("cargo -vV");
    let host = String::from_utf8_lossy(&host.stdout)
        .lines()
        .find_map(|line| line.strip_prefix("host: ").map(str::to_string))
        .expect("cargo -vV names its host");
    let output = std::process::Command::new(&cargo)
        .args([
            "metadata",
            "--format-version",
            "1",
            "--locked",
            "--offline",
            "--filter-platform",
            &host,
        ])
        .current_dir(repo())
        .output()
        .expect("cargo metadata");
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    let metadata: serde_json::Value = serde_json::from_slice(&output.stdout).unwrap();
    let packages: std::collections::HashMap<&str, &serde_json::Value> = metadata["packages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|package| (package["id"].as_str().unwrap(), package))
        .collect();
    let nodes: std::collections::HashMap<&str, &serde_json::Value> = metadata["resolve"]["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|node| (node["id"].as_str().unwrap(), node))
        .collect();
    let root = metadata["resolve"]["root"].as_str().unwrap();
    let ours = version_of(
        packages[root]["rust_version"]
            .as_str()
            .expect("a rust-version in Cargo.toml"),
    );
    // What a build of floodgate compiles: normal and build dependencies, not the tests' own.
    let (mut seen, mut stack) = (BTreeSet::new(), vec![root]);
    while let Some(id) = stack.pop() {
        if !seen.insert(id) {
            continue;
        }
        for dep in nodes[id]["deps"].as_array().unwrap() {
            let built = dep["dep_kinds"]
                .as_array()
                .unwrap()
                .iter()
                .any(|kind| kind["kind"].is_null() || kind["kind"] == "build");
            if built {
                stack.push(dep["pkg"].as_str().unwrap());
            }
        }
    }
    for id in seen {
        let package = packages[id];
        if let Some(needed) = package["rust_version"].as_str() {
            assert!(
                version_of(needed) <= ours,
                "{} {} needs Rust {needed}, above floodgate's rust-version",
                package["name"],
                package["version"]
            );
        }
    }
}

/// Pod Security Standards, "restricted" profile (Kubernetes' own list of its checks): what `pod` (a pod spec) breaks.
fn restricted_violations(pod: &Yaml) -> Vec<String> {
    let mut found = Vec::new();
    let mut check = |ok: bool, what: String| {
        if !ok {
            found.push(what);
        }
    };
    for host in ["hostNetwork", "hostPID", "hostIPC"] {
        check(pod[host].as_bool() != Some(true), host.to_string());
    }
    let pod_context = &pod["securityContext"];
    let pod_non_root = pod_context["runAsNonRoot"].as_bool() == Some(true);
    let pod_seccomp = pod_context["seccompProfile"]["type"].as_str();
    let allowed_volumes = [
        "configMap",
        "csi",
        "downwardAPI",
        "emptyDir",
        "ephemeral",
        "persistentVolumeClaim",
        "projected",
        "secret",
    ];
    for volume in pod["volumes"].as_sequence().map(Vec::as_slice).unwrap_or_default() {
        let kinds: Vec<&str> = volume
            .as_mapping()
            .unwrap()
            .keys()
            .filter_map(|key| key.as_str())
            .filter(|key| *key != "name")
            .collect();
        check(
            kinds.iter().all(|kind| allowed_volumes.contains(kind)),
            format!("volume kinds {kinds:?}"),
        );
    }
    let containers = pod["containers"].as_sequence().map(Vec::as_slice).unwrap_or_default();
    let init = pod["initContainers"]
        .as_sequence()
        .map(Vec::as_slice)
        .unwrap_or_default();
    for container in containers.iter().chain(init) {
        let name = container["name"].as_str().unwrap_or("?");
        let context = &container["securityContext"];
        check(
            context["privileged"].as_bool() != Some(true),
            format!("{name}: privileged"),
        );
        check(
            context["allowPrivilegeEscalation"].as_bool() == Some(false),
            format!("{name}: allowPrivilegeEscalation is not false"),
        );
        let non_root = context["runAsNonRoot"].as_bool().unwrap_or(pod_non_root);
        check(non_root, format!("{name}: runAsNonRoot"));
        check(context["runAsUser"].as_u64() != Some(0), format!("{name}: runAsUser 0"));
        let seccomp = context["seccompProfile"]["type"].as_str().or(pod_seccomp);
        check(
            matches!(seccomp, Some("RuntimeDefault" | "Localhost")),
            format!("{name}: seccompProfile {seccomp:?}"),
        );
        let drops: Vec<&str> = context["capabilities"]["drop"]
            .as_sequence()
            .map(|drop| drop.iter().filter_map(Yaml::as_str).collect())
            .unwrap_or_default();
        check(drops.contains(&"ALL"), format!("{name}: capabilities.drop lacks ALL"));
        let adds: Vec<&str> = context["capabilities"]["add"]
            .as_sequence()
            .map(|add| add.iter().filter_map(Yaml::as_str).collect())
            .unwrap_or_default();
        check(
            adds.iter().all(|add| *add == "NET_BIND_SERVICE"),
            format!("{name}: capabilities.add {adds:?}"),
        );
        for port in container["ports"].as_sequence().map(Vec::as_slice).unwrap_or_default() {
            check(
                port["hostPort"].as_u64().is_none_or(|p| p == 0),
                format!("{name}: hostPort"),
            );
        }
    }
    found
}

#[test]
fn kubernetes_manifests_pass_pod_security_restricted_and_a_disruption_budget_keeps_replicas_up() {
    let dir = docker_dir().join("k8s");
    let deployment = yaml(&dir.join("deployment.yaml"));
    let pod = &deployment["spec"]["template"]["spec"];
    let violations = restricted_violations(pod);
    assert!(
        violations.is_empty(),
        "Pod Security \"restricted\" refuses: {violations:?}"
    );
    // The check itself refuses what it must.
    let mut loose = pod.clone();
    loose["securityContext"] = serde_yaml_ng::from_str("{}").unwrap();
    assert!(
        !restricted_violations(&loose).is_empty(),
        "the check passes a pod without seccomp or runAsNonRoot"
    );

    let budget = yaml(&dir.join("pdb.yaml"));
    assert_eq!(budget["kind"], "PodDisruptionBudget");
    assert_eq!(
        budget["spec"]["selector"]["matchLabels"], deployment["spec"]["selector"]["matchLabels"],
        "the budget covers the Deployment's pods"
    );
    let replicas = deployment["spec"]["replicas"].as_u64().unwrap();
    let unavailable = budget["spec"]["maxUnavailable"].as_u64().unwrap();
    assert!(
        unavailable >= 1 && unavailable < replicas,
        "maxUnavailable {unavailable} of {replicas}"
    );

    // A ConfigMap change is reloaded without a signal.
    let config = checked_config(k8s_config().path());
    let interval = config["config_watch_interval"].as_str().unwrap();
    assert!(interval != "0s", "the sidecar does not watch its configuration");
}

#[test]
fn the_gateway_example_splits_one_cap_between_autoscaled_replicas_counted_by_a_headless_service() {
    let dir = docker_dir().join("k8s-gateway");
    let configmap = yaml(&dir.join("configmap.yaml"));
    let text = str_of(&configmap["data"]["floodgate.toml"], "floodgate.toml");
    let file = TempConfig::new(text);
    let config = checked_config(file.path());
    let upstream = config["upstreams"]["app"].as_table().unwrap();
    let dns = upstream["replicas"]["dns"].as_str().expect("replicas counted by DNS");
    let deployment = yaml(&dir.join("deployment.yaml"));
    let pod = &deployment["spec"]["template"]["spec"];
    assert!(
        restricted_violations(pod).is_empty(),
        "{:?}",
        restricted_violations(pod)
    );
    let selector = &deployment["spec"]["selector"]["matchLabels"];
    let services = yaml_documents(&dir.join("service.yaml"));
    let peers = services
        .iter()
        .find(|service| service["spec"]["clusterIP"] == "None")
        .expect("a headless Service");
    let peers_name = str_of(&peers["metadata"]["name"], "name");
    assert!(
        dns == peers_name || dns.starts_with(&format!("{peers_name}.")),
        "replicas.dns {dns} is not the headless Service {peers_name}"
    );
    assert_eq!(
        &peers["spec"]["selector"], selector,
        "the headless Service lists the gateway's pods"
    );
    assert_eq!(
        peers["spec"]["publishNotReadyAddresses"], true,
        "a starting replica is counted at once"
    );
    let hpa = yaml(&dir.join("hpa.yaml"));
    assert_eq!(hpa["spec"]["scaleTargetRef"]["name"], deployment["metadata"]["name"]);
    let budget = yaml(&dir.join("pdb.yaml"));
    assert_eq!(&budget["spec"]["selector"]["matchLabels"], selector);
    // The config is the ConfigMap's, mounted where the args point.
    let floodgate = container(pod, "floodgate");
    let args: Vec<&str> = seq_of(&floodgate["args"], "args")
        .iter()
        .map(|a| str_of(a, "arg"))
        .collect();
    assert_eq!(args, ["--config", "/etc/floodgate/floodgate.toml"]);
    assert!(seq_of(&pod["volumes"], "volumes")
        .iter()
        .any(|volume| volume["configMap"]["name"] == configmap["metadata"]["name"]));
}

/// The `--flag` names in a text: `--max-connections <N>` and `` `--max-connections N` `` alike.
fn flag_names(text: &str) -> BTreeSet<String> {
    text.split(|c: char| c.is_whitespace() || c == '`' || c == ',' || c == '|')
        .filter_map(|word| word.strip_prefix("--"))
        .map(|name| name.trim_end_matches(|c: char| !c.is_ascii_alphanumeric()))
        .filter(|name| !name.is_empty() && name.chars().all(|c| c.is_ascii_lowercase() || c == '-'))
        .map(str::to_string)
        .collect()
}

#[test]
fn the_flag_table_in_operations_md_names_every_flag_the_binary_takes() {
    let (status, help, stderr) = run_to_exit(&["--help"], Duration::from_secs(10));
    assert!(status.success(), "{stderr}");
    let mut taken = flag_names(&help);
    for own in ["help", "version"] {
        assert!(taken.remove(own), "--{own} not in --help: {help}");
    }
    let docs = read(&repo().join("docs/operations.md"));
    let table: String = docs
        .lines()
        .filter(|line| line.starts_with("| `--"))
        .map(|line| line.split('|').nth(1).unwrap_or_default())
        .collect::<Vec<_>>()
        .join(" ");
    assert_eq!(
        flag_names(&table),
        taken,
        "docs/operations.md's flag table against floodgate --help"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_build_runs_with_the_allocators_tuning_as_the_running_process_reports_it() {
    // Nothing at build time sets it (a `.cargo/config.toml` beside the checkout reaches no `cargo install` run from
    // elsewhere, nor the image's build): the binary sets it itself, at start.
    assert!(
        !repo().join(".cargo/config.toml").exists()
            || !read(&repo().join(".cargo/config.toml")).contains("JEMALLOC_SYS_WITH_MALLOC_CONF"),
        "the allocator's tuning is back in a build-time file"
    );
    let upstream = Upstream::start().await;
    let allocator = |status: serde_json::Value| status["allocator"].clone();
    let proxy = Proxy::for_upstream(&upstream, 1, &[]).await;
    assert_eq!(
        allocator(proxy.status().await),
        serde_json::json!({"name": "jemalloc", "dirty_decay_ms": 1000, "muzzy_decay_ms": 0, "background_thread": true}),
        "read from the allocator of the running process (pid {})",
        proxy.pid()
    );
    // An operator's own settings are left as they are.
    let own = Proxy::for_upstream_with_env(&upstream, 1, &[], &[("_RJEM_MALLOC_CONF", "dirty_decay_ms:5000")]).await;
    let settings = allocator(own.status().await);
    assert_eq!(settings["dirty_decay_ms"], 5000, "{settings}");
}
