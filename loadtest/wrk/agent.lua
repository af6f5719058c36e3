-- wrk script: POST an agent's turn, streamed (model "zero"): 40 earlier turns and 20 tool
-- schemas, ~56 KB, the shape of a coding agent's request (long shared prefix, tools).
-- Usage: wrk -t1 -c64 -d10s --latency -s loadtest/wrk/agent.lua http://127.0.0.1:PORT
wrk.method = "POST"
wrk.path = "/v1/chat/completions"
wrk.headers["Content-Type"] = "application/json"

local turn = string.rep('some text with code `a[i] = {b}` and \\"quotes\\" ', 20)
local messages = {}
for i = 0, 39 do
  local role = (i % 2 == 0) and "user" or "assistant"
  messages[#messages + 1] = '{"role":"' .. role .. '","content":"' .. turn .. '"}'
end
local properties = {}
for i = 0, 5 do
  properties[#properties + 1] = '"p' .. i .. '":{"type":"string","description":"' .. string.rep("x", 40) .. '"}'
end
local tools = {}
for i = 0, 19 do
  tools[#tools + 1] = '{"type":"function","function":{"name":"f' .. i .. '","description":"'
    .. string.rep("d", 200) .. '","parameters":{"type":"object","properties":{'
    .. table.concat(properties, ",") .. '}}}}'
end
wrk.body = '{"model":"zero","messages":[' .. table.concat(messages, ",") .. '],"tools":['
  .. table.concat(tools, ",") .. '],"max_tokens":8,"stream":true}'

local summary_json = dofile((debug.getinfo(1, "S").source:sub(2):match("(.*/)") or "./") .. "summary.lua")
done = summary_json
