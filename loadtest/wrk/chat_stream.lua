-- wrk script: POST a streaming chat completion (model "zero"); the zero upstream answers
-- with 8 SSE chunks and "data: [DONE]". wrk's latency is to the end of the stream.
-- Usage: wrk -t1 -c64 -d10s --latency -s loadtest/wrk/chat_stream.lua http://127.0.0.1:PORT
wrk.method = "POST"
wrk.path = "/v1/chat/completions"
wrk.headers["Content-Type"] = "application/json"
wrk.body = '{"model":"zero","messages":[{"role":"user","content":"Say hello in one word."}],"max_tokens":8,"stream":true}'

local summary_json = dofile((debug.getinfo(1, "S").source:sub(2):match("(.*/)") or "./") .. "summary.lua")
done = summary_json
