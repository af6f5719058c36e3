-- wrk script: the chat of chat.lua, as agent traffic: every request names one of 256
-- sessions (x-session-id), in turn, so the gateway pins each session to a replica and,
-- with several workers, tells its siblings.
-- Usage: wrk -t1 -c64 -d10s --latency -s loadtest/wrk/chat_session.lua http://127.0.0.1:PORT
wrk.method = "POST"
wrk.path = "/v1/chat/completions"
wrk.headers["Content-Type"] = "application/json"
wrk.body = '{"model":"zero","messages":[{"role":"user","content":"Say hello in one word."}],"max_tokens":8,"stream":false}'

local counter = 0
request = function()
  counter = counter + 1
  wrk.headers["x-session-id"] = string.format("agent-session-%03d", counter % 256)
  return wrk.format()
end

local summary_json = dofile((debug.getinfo(1, "S").source:sub(2):match("(.*/)") or "./") .. "summary.lua")
done = summary_json
