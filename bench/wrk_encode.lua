-- wrk script: POST pre-generated single-item encode bodies, cycling through them.
--
--   wrk -t1 -c8 -d10s --latency -s bench/wrk_encode.lua \
--       http://127.0.0.1:PORT/v1/encode/minilm -- BODIES_FILE
--
-- BODIES_FILE holds one JSON request body per line ({"items": ["..."]}). Requests are
-- formatted once in init(); each wrk thread starts at a different offset. done() prints
-- one line "HERON_WRK_JSON {...}" (latencies in microseconds) for bench/serve_bench.py.
-- With HERON_WRK_PHASES=PATH set (one wrk thread), every answer's status and
-- Server-Timing header are written to PATH, a line each (bench/phase_bench.py).

local prepared = {}
local next_index = 1
local thread_count = 0

function setup(thread)
  thread:set("thread_id", thread_count)
  thread_count = thread_count + 1
end

function init(args)
  local path = args[1] or os.getenv("HERON_BENCH_BODIES")
  if path == nil then
    error("usage: wrk ... -s wrk_encode.lua URL -- BODIES_FILE")
  end
  local headers = { ["Content-Type"] = "application/json" }
  for line in io.lines(path) do
    if #line > 0 then
      prepared[#prepared + 1] = wrk.format("POST", nil, headers, line)
    end
  end
  if #prepared == 0 then
    error("no request bodies in " .. path)
  end
  next_index = ((thread_id or 0) * 7919) % #prepared + 1
end

function request()
  local req = prepared[next_index]
  next_index = next_index % #prepared + 1
  return req
end

local phases_path = os.getenv("HERON_WRK_PHASES")
if phases_path ~= nil and phases_path ~= "" then
  -- Defined only when asked for: wrk hands a script its responses only if it has one.
  local phases_file = nil
  function response(status, headers, body)
    if phases_file == nil then
      phases_file = io.open(phases_path, "w")
    end
    -- wrk keeps header names as sent: uvicorn and Heron's own protocol send lowercase.
    local timing = headers["server-timing"] or headers["Server-Timing"] or ""
    phases_file:write(status, " ", timing, "\n")
  end
end

function done(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    "HERON_WRK_JSON {\"requests\":%.0f,\"duration_us\":%.0f,\"bytes\":%.0f," ..
    "\"errors\":{\"connect\":%.0f,\"read\":%.0f,\"write\":%.0f,\"status\":%.0f," ..
    "\"timeout\":%.0f},\"latency_us\":{\"min\":%.0f,\"mean\":%.1f,\"stdev\":%.1f," ..
    "\"max\":%.0f,\"p50\":%.0f,\"p90\":%.0f,\"p99\":%.0f,\"p999\":%.0f}}\n",
    summary.requests, summary.duration, summary.bytes,
    e.connect, e.read, e.write, e.status, e.timeout,
    latency.min, latency.mean, latency.stdev, latency.max,
    latency:percentile(50), latency:percentile(90), latency:percentile(99),
    latency:percentile(99.9)))
end
