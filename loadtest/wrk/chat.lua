-- wrk script: POST a small non-streaming chat completion (model "zero").
-- Usage: wrk -t1 -c64 -d10s --latency -s loadtest/wrk/chat.lua http://127.0.0.1:PORT
-- Defines no response() callback (that would make wrk hand every response to Lua and
-- cost throughput); done() prints one JSON line with exact percentiles and error counts.
wrk.method = "POST"
wrk.path = "/v1/chat/completions"
wrk.headers["Content-Type"] = "application/json"
wrk.body = '{"model":"zero","messages":[{"role":"user","content":"Say hello in one word."}],"max_tokens":8,"stream":false}'

local summary_json = dofile((debug.getinfo(1, "S").source:sub(2):match("(.*/)") or "./") .. "summary.lua")
done = summary_json
