//! The `process_*` families every Prometheus client exports (resident and virtual memory, open and maximum file
//! descriptors, CPU seconds, start time), read from `/proc/self` at each scrape, as the Go and Java clients do.
//! Off Linux, or when `/proc` cannot be read, the families that could not be read are left out of that scrape.

use procfs_core::process::{LimitValue, Limits, Stat, Status};
use procfs_core::FromRead;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::registry::Unit;

/// Clock ticks per second in `/proc`'s CPU times: the kernel reports them in `USER_HZ`, which is 100 on every
/// architecture floodgate builds for (reading `sysconf(_SC_CLK_TCK)` would need `unsafe`).
const USER_HZ: f64 = 100.0;

#[derive(Debug)]
pub(super) struct ProcessCollector {
    /// Seconds since the epoch when the metrics were set up, at start-up.
    start_time: f64,
}

impl ProcessCollector {
    pub(super) fn new() -> Self {
        ProcessCollector {
            start_time: super::unix_time(),
        }
    }
}

fn gauge(encoder: &mut DescriptorEncoder, name: &str, help: &str, unit: Option<&Unit>, value: f64) -> std::fmt::Result {
    let metric = ConstGauge::new(value);
    metric.encode(encoder.encode_descriptor(name, help, unit, metric.metric_type())?)
}

impl Collector for ProcessCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> std::fmt::Result {
        if let Ok(stat) = Stat::from_file("/proc/self/stat") {
            let cpu = ConstCounter::new((stat.utime + stat.stime) as f64 / USER_HZ);
            let help = "Total user and system CPU time spent in seconds";
            cpu.encode(encoder.encode_descriptor("process_cpu", help, Some(&Unit::Seconds), cpu.metric_type())?)?;
            let help = "Virtual memory size in bytes";
            gauge(
                &mut encoder,
                "process_virtual_memory",
                help,
                Some(&Unit::Bytes),
                stat.vsize as f64,
            )?;
        }
        if let Some(rss) = Status::from_file("/proc/self/status")
            .ok()
            .and_then(|status| status.vmrss)
        {
            let help = "Resident memory size in bytes";
            gauge(
                &mut encoder,
                "process_resident_memory",
                help,
                Some(&Unit::Bytes),
                (rss * 1024) as f64,
            )?;
        }
        if let Ok(fds) = std::fs::read_dir("/proc/self/fd") {
            // The directory's own descriptor, open while it is listed, is not counted.
            let open = fds.count().saturating_sub(1);
            gauge(
                &mut encoder,
                "process_open_fds",
                "Number of open file descriptors",
                None,
                open as f64,
            )?;
        }
        if let Ok(limits) = Limits::from_file("/proc/self/limits") {
            if let LimitValue::Value(max) = limits.max_open_files.soft_limit {
                let help = "Maximum number of open file descriptors";
                gauge(&mut encoder, "process_max_fds", help, None, max as f64)?;
            }
        }
        let help = "Start time of the process since unix epoch in seconds";
        gauge(
            &mut encoder,
            "process_start_time",
            help,
            Some(&Unit::Seconds),
            self.start_time,
        )
    }
}
