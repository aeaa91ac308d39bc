-- wrk script for benches/e2e/run.sh: counts responses by status code in every thread and, when the run is
-- over, prints one JSON object (prefixed with "E2E_JSON ") with the totals, the error counts and the latency
-- percentiles (microseconds), and how many 503 answers had no Retry-After. Works with wrk 4.x: threads hand their
-- tables to `done` through thread:get.

local threads = {}

function setup(thread)
  table.insert(threads, thread)
end

function init(args)
  codes = {}
  no_retry_after = 0
end

function response(status, headers, body)
  local key = tostring(status)
  codes[key] = (codes[key] or 0) + 1
  if status == 503 and headers["retry-after"] == nil and headers["Retry-After"] == nil then
    no_retry_after = no_retry_after + 1
  end
end

function done(summary, latency, requests)
  local total = {}
  local missing = 0
  for _, thread in ipairs(threads) do
    missing = missing + (thread:get("no_retry_after") or 0)
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
    '"p50_us":%d,"p99_us":%d,"p999_us":%d,"max_us":%d,"mean_us":%.1f,"no_retry_after_503":%d,"codes":{%s}}\n',
    summary.duration, summary.requests, summary.bytes,
    e.connect, e.read, e.write, e.timeout, e.status,
    latency:percentile(50), latency:percentile(99), latency:percentile(99.9), latency.max, latency.mean,
    missing, table.concat(parts, ",")))
end
