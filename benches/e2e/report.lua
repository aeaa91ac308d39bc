-- wrk script for benches/e2e/run.sh: counts responses by status code in every thread and, when the run is
-- over, prints one JSON object (prefixed with "E2E_JSON ") with the totals, the error counts and the latency
-- percentiles (microseconds). Works with wrk 4.x: threads hand their tables to `done` through thread:get.

local threads = {}

function setup(thread)
  table.insert(threads, thread)
end

function init(args)
  codes = {}
end

function response(status, headers, body)
  local key = tostring(status)
  codes[key] = (codes[key] or 0) + 1
end

function done(summary, latency, requests)
  local total = {}
  for _, thread in ipairs(threads) do
    local c = thread:get("codes")
    if c then
      for code, n in pairs(c) do
        total[code] = (total[code] or 0) + n
      end
    end
  end
  local parts = {}
  for code, n in pairs(total) do
    table.insert(parts, string.format('"%s":%d', code, n))
  end
  table.sort(parts)
  local e = summary.errors
  io.write(string.format(
    'E2E_JSON {"duration_us":%d,"requests":%d,"bytes":%d,' ..
    '"err_connect":%d,"err_read":%d,"err_write":%d,"err_timeout":%d,"non_2xx_3xx":%d,' ..
    '"p50_us":%d,"p99_us":%d,"p999_us":%d,"max_us":%d,"mean_us":%.1f,"codes":{%s}}\n',
    summary.duration, summary.requests, summary.bytes,
    e.connect, e.read, e.write, e.timeout, e.status,
    latency:percentile(50), latency:percentile(99), latency:percentile(99.9), latency.max, latency.mean,
    table.concat(parts, ",")))
end
