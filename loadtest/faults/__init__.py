"""Reliability benchmark: one replica (or Redis) fails mid-run; what do clients see?

    python -m loadtest.faults [--rate 50] [--duration 60] [--replicas 4] \\
        [--scenarios kill,error,hang,drop,redis] [--json out.json] [--strict]

Every scenario gets a fresh fleet of simulated replicas behind one gateway process and
steady open-loop load (streaming and non-streaming chat, ~50-300 ms each). At
``duration / 3`` the busiest replica is faulted:

- ``kill``: SIGKILL by PID;  ``error``: it answers HTTP 500;  ``hang``: it accepts and
  never answers;  ``drop``: it cuts streams after a few chunks (non-streams at once);
- ``redis``: the gateway keeps its prefix index and sessions in a redis-server this
  module starts; that server is SIGKILLed and restarted on the same port seconds later.

When did the gateway stop sending to the faulted replica? Three witnesses, merged into
one timeline of "an attempt went there": the client's ``x-gateway-endpoint`` headers, the
gateway's ``/metrics`` (per endpoint: answered + failed attempts + in flight, polled every
``--poll`` s, so the resolution is the poll interval) and, while the process lives, the
replica's own ``/admin/state`` (requests that reached its engine). ``last_sent_s`` is the
last attempt after injection; ``ejected_after_s`` is where the first gap of ``--gap`` s
without attempts starts, provided attempts stay that sparse afterwards (so a breaker's
half-open probes do not hide an ejection, and a lull does not fake one). Targets: no failures
of requests that had not started streaming (no content chunk yet: a failure after the
role-only first chunk of a chat stream counts, the response being committed then);
ejection within 2 s; Redis outage: no 5xx.
"""

from __future__ import annotations

from loadtest.faults.analysis import TARGET_EJECTION_S, client_lag_ms
from loadtest.faults.report import markdown_table, print_table
from loadtest.faults.scenarios import MODEL, SCENARIOS, SIM_ARGS, ScenarioOptions, run_scenario
from loadtest.harness.inject import REPLICA_FAULTS
from loadtest.harness.steady import LoadRun, RequestOutcome, run_load
from loadtest.harness.timeline import dedupe_times, ejection_times
from loadtest.harness.watch import GatewayCounters, GatewayWatcher, parse_gateway_metrics

__all__ = [
    "MODEL",
    "REPLICA_FAULTS",
    "SCENARIOS",
    "SIM_ARGS",
    "TARGET_EJECTION_S",
    "GatewayCounters",
    "GatewayWatcher",
    "LoadRun",
    "RequestOutcome",
    "ScenarioOptions",
    "client_lag_ms",
    "dedupe_times",
    "ejection_times",
    "markdown_table",
    "parse_gateway_metrics",
    "print_table",
    "run_load",
    "run_scenario",
]
