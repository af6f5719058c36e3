"""What every benchmark needs, once: ports, processes, a redis-server, an SSE client, load.

- :mod:`.ports`         free loopback ports
- :mod:`.processes`     start a process with a log file, wait for HTTP readiness, stop it by PID
- :mod:`.procfs`        a process tree's CPU seconds and RSS, read from ``/proc``
- :mod:`.fleet`         simulated replicas and ``llm-gateway serve`` processes
- :mod:`.redis_server`  a private ``redis-server``, killable and restartable by PID
- :mod:`.sse`           one OpenAI streaming client: status, TTFT, events, error events, ``[DONE]``
- :mod:`.load`          the open-loop (Poisson) and closed-loop generators and their budget
- :mod:`.steady`        steady open-loop load with one outcome record per request (faults, soak)
- :mod:`.scrape`        replicas' ``/metrics`` counters (prefix-cache hits and queries)
- :mod:`.watch`         polling the gateway's ``/metrics`` and a replica's ``/admin/state``
- :mod:`.inject`        faults: kill a replica, make it misbehave, take Redis down
- :mod:`.timeline`      when did attempts to an endpoint stop (ejection accounting)
- :mod:`.wrk`           running ``wrk`` and reading its output
"""
