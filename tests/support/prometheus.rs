//! Prometheus text: reading the metrics the admin listener serves.

use super::*;

#[derive(Debug, Clone)]
pub struct Sample {
    pub name: String,
    pub labels: BTreeMap<String, String>,
    pub value: f64,
}

/// Parses Prometheus / OpenMetrics text exposition (comments skipped).
pub fn parse_metrics(text: &str) -> Vec<Sample> {
    let mut samples = Vec::new();
    for line in text.lines() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let (name, labels, rest) = match line.find('{') {
            Some(open) if line[..open].find(' ').is_none() => {
                let name = &line[..open];
                let mut labels = BTreeMap::new();
                let bytes = line.as_bytes();
                let mut i = open + 1;
                loop {
                    while i < bytes.len() && (bytes[i] == b',' || bytes[i] == b' ') {
                        i += 1;
                    }
                    if i >= bytes.len() || bytes[i] == b'}' {
                        i += 1;
                        break;
                    }
                    let eq = i + line[i..].find('=').expect("label without =");
                    let key = line[i..eq].trim().to_owned();
                    i = eq + 1;
                    assert_eq!(bytes[i], b'"', "label value not quoted in {line}");
                    i += 1;
                    let mut value = String::new();
                    while bytes[i] != b'"' {
                        if bytes[i] == b'\\' {
                            i += 1;
                            value.push(match bytes[i] {
                                b'n' => '\n',
                                other => other as char,
                            });
                        } else {
                            let ch = line[i..].chars().next().unwrap();
                            value.push(ch);
                            i += ch.len_utf8() - 1;
                        }
                        i += 1;
                    }
                    i += 1;
                    labels.insert(key, value);
                }
                (name.to_owned(), labels, &line[i.min(line.len())..])
            }
            _ => {
                let mut parts = line.splitn(2, ' ');
                let name = parts.next().unwrap_or("").to_owned();
                (name, BTreeMap::new(), parts.next().unwrap_or(""))
            }
        };
        let value = rest.split_whitespace().next().unwrap_or("");
        let value = match value {
            "+Inf" => f64::INFINITY,
            "-Inf" => f64::NEG_INFINITY,
            v => v.parse().unwrap_or(f64::NAN),
        };
        samples.push(Sample { name, labels, value });
    }
    samples
}

/// Sum of the samples named `name` whose labels include all of `labels`.
pub fn metric_sum(samples: &[Sample], name: &str, labels: &[(&str, &str)]) -> f64 {
    samples
        .iter()
        .filter(|s| s.name == name)
        .filter(|s| {
            labels
                .iter()
                .all(|(k, v)| s.labels.get(*k).map(String::as_str) == Some(*v))
        })
        .map(|s| s.value)
        .sum()
}

/// Whether any sample named `name` exists.
pub fn metric_exists(samples: &[Sample], name: &str) -> bool {
    samples.iter().any(|s| s.name == name)
}
