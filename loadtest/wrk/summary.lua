-- Shared done() for the wrk scripts: one machine-readable line on stdout,
--   WRK_SUMMARY {"requests":..., "duration_us":..., "p50_us":..., ...}
-- Latencies are wrk's own per-request numbers in microseconds.
return function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    'WRK_SUMMARY {"requests":%d,"duration_us":%d,"bytes":%d,' ..
    '"mean_us":%.1f,"stdev_us":%.1f,"min_us":%d,"max_us":%d,' ..
    '"p50_us":%d,"p90_us":%d,"p99_us":%d,"p999_us":%d,' ..
    '"errors":{"connect":%d,"read":%d,"write":%d,"status":%d,"timeout":%d}}\n',
    summary.requests, summary.duration, summary.bytes,
    latency.mean, latency.stdev, latency.min, latency.max,
    latency:percentile(50), latency:percentile(90), latency:percentile(99), latency:percentile(99.9),
    e.connect, e.read, e.write, e.status, e.timeout))
end
