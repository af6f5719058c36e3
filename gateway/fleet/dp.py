"""Data-parallel ranks as routing targets: a vLLM server with ``--data-parallel-size N``.

Such a server is N schedulers, each with its own KV cache and queue, behind one URL: its
``vllm:`` series carry ``engine="<rank>"``, each rank publishes its own KV events, and it
sends a request to the rank named by ``X-data-parallel-rank``. Routing to the URL alone
leaves the choice of rank to vLLM's load balancer, which knows nothing of prefixes, so
the cache a request needs is on the other rank about (N−1)/N of the time.

So the replica (the URL's :class:`Endpoint`) gets one *rank target* per rank: an
``Endpoint`` with the same URL (one connection pool), its own load state (in-flight,
pending prefill, the scraped series of its rank), its own exact and approximate prefix
state (keyed by its name ``host:port#dpR``), and ``dp_rank`` sent as the header. Health,
breakers, drain and models stay per URL, on the replica (``Endpoint.owner``), and are
copied to its targets on every registry rebuild. The rank set comes from the config's
``data_parallel_size`` or else from the scrape: the ``engine`` labels of the series every
rank reports. A rank whose gauges are missing (vLLM 0.32 exports running/waiting/KV usage
for rank 0 only) has them "not reported": its scorers use the gateway's own counts. One
rank (every non-DP vLLM reports ``engine="0"``) means no targets: the replica routes as
before, with no header.
"""

from __future__ import annotations

import re
import time
from collections.abc import Sequence

from gateway.errors import engine_error_message
from gateway.fleet.endpoint import Endpoint, EngineKind
from gateway.fleet.scraper import ScrapedPage

__all__ = [
    "RANK_HEADER",
    "RANK_REFUSED",
    "engine_ranks",
    "other_servers_first",
    "rank_out_of_range",
    "rank_target",
    "set_ranks",
    "sync_targets",
    "update_rank_loads",
    "without_rank",
]

RANK_HEADER = "x-data-parallel-rank"
# The retry reason of a rank the server no longer has (restarted with fewer): vLLM's 400
# before any work; the same server is asked again without the header, its ranks learned anew.
RANK_REFUSED = "rank_refused"
_RANK_REFUSAL = re.compile(r"data_parallel_rank (\d{1,4}) is out of range \[0, (\d{1,4})\)\.?")
_MAX_REFUSAL_BYTES = 4096  # vLLM's answer is ~150 bytes


def rank_target(replica: Endpoint, rank: int) -> Endpoint:
    """Rank ``rank`` of ``replica``: the same upstream settings, its own state."""
    target = Endpoint(
        url=replica.url,
        role=replica.role,
        engine=replica.engine,
        configured_models=replica.configured_models,
        labels=dict(replica.labels),
        bootstrap_port=replica.bootstrap_port,
        auth_header=replica.auth_header,
        ssl_context=replica.ssl_context,
        max_num_seqs=replica.max_num_seqs,  # vLLM's limit is per scheduler, so per rank
        dp_rank=rank,
        replica=replica,
    )
    sync_target(replica, target)
    return target


def sync_target(replica: Endpoint, target: Endpoint) -> None:
    target.healthy = replica.healthy
    target.ejected = replica.ejected
    target.draining = replica.draining
    target.discovered_models = replica.discovered_models
    target.adapters = replica.adapters  # LoRA adapters are loaded server-wide, on every rank


def sync_targets(replica: Endpoint) -> list[Endpoint]:
    """Per-URL state onto the rank targets (called by every registry rebuild); the dropped ones.

    A replica that goes down loses learned ranks: it may come back with another
    ``--data-parallel-size``, and a header naming a rank it no longer has is a 400. Until
    its next scrape it routes as one target, without the header."""
    dropped: list[Endpoint] = []
    if not replica.healthy and replica.data_parallel_size is None and replica.rank_targets:
        dropped, replica.rank_targets = list(replica.rank_targets), ()
    for target in replica.rank_targets:
        sync_target(replica, target)
    return dropped


def set_ranks(replica: Endpoint, ranks: Sequence[int]) -> list[Endpoint]:
    """Give ``replica`` targets for ``ranks`` (none for fewer than two); returns the dropped ones.

    Targets of ranks that stay are kept with their state; a rank count change (a restart
    with another ``--data-parallel-size``) adds or drops only the difference.
    """
    wanted = sorted(set(ranks)) if len(set(ranks)) > 1 else []
    current = {t.dp_rank: t for t in replica.rank_targets}
    if [t.dp_rank for t in replica.rank_targets] == wanted:
        return []
    replica.rank_targets = tuple(current.get(r) or rank_target(replica, r) for r in wanted)
    return [t for r, t in current.items() if r not in wanted]


def carry_targets(previous: Endpoint, endpoint: Endpoint) -> None:
    """A replica rebuilt by a config change keeps its ranks' names and learned state."""
    targets = []
    for old in previous.rank_targets:
        assert old.dp_rank is not None
        target = rank_target(endpoint, old.dp_rank)
        target.metrics, target.learned_capacity = old.metrics, old.learned_capacity
        targets.append(target)
    endpoint.rank_targets = tuple(targets)  # a changed data_parallel_size is applied by the registry


def other_servers_first(ranked: Sequence[Endpoint]) -> list[Endpoint]:
    """Attempt order: each URL's best target in rank order, then their sibling ranks.

    A retry goes to another server before another rank of the one that just failed (a dead or
    overloaded server fails on every rank). Without data parallelism the order is unchanged."""
    seen: set[str] = set()
    first, later = [], []
    for target in ranked:
        (later if target.url in seen else first).append(target)
        seen.add(target.url)
    return first + later


def rank_out_of_range(body: bytes, rank: int) -> bool:
    """Whether ``body`` is vLLM's 400 for ``rank``, a rank the server does not have (a restart
    with fewer ranks, before a scrape saw it): ``data_parallel_rank R is out of range [0, N).``

    The whole error message must be that sentence, for the rank sent and a smaller N: other
    400s quote the client's own input back, and a client must not be able to word one."""
    if len(body) > _MAX_REFUSAL_BYTES or b"data_parallel_rank" not in body:
        return False
    message = engine_error_message(body)
    found = _RANK_REFUSAL.fullmatch(message) if message is not None else None
    return found is not None and int(found[1]) == rank and int(found[2]) <= rank


def without_rank(refused: Endpoint, later: Sequence[Endpoint]) -> list[Endpoint]:
    """The attempts after a refused rank: its server again, without the header (vLLM picks
    the rank), then the other servers; not its sibling ranks, which may be gone as well."""
    return [refused.owner, *(target for target in later if target.url != refused.url)]


def engine_ranks(page: ScrapedPage) -> list[int]:
    """The ``engine`` label values of the series every rank reports (one value per DP rank).

    vLLM numbers its ranks 0..N-1, and ``X-data-parallel-rank`` names one of those: only that
    run counts. A label past a gap ({0, 1, 1023}), a padded one ("01", which vLLM would read
    as rank 1 under another name) or one that is not an ASCII number ("²") is no rank; a
    server of a multi-node deployment labelled from another start routes as one target."""
    ranks = []
    while len(ranks) in page.ranks:
        ranks.append(len(ranks))
    return ranks


def update_rank_loads(replica: Endpoint, page: ScrapedPage) -> tuple[bool, list[Endpoint]]:
    """After a scrape of ``replica`` (its page parsed once, :func:`~gateway.fleet.scraper.parse_page`):
    its rank set and each target's load; returns (whether the rank set changed, the dropped targets).

    A configured ``data_parallel_size`` fixes the ranks (0..N-1); else the page's engine
    labels decide, so a replica restarted with another rank count is followed.
    """
    if replica.engine is not EngineKind.VLLM:
        return False, []
    if replica.data_parallel_size is not None:
        ranks = list(range(replica.data_parallel_size))
    else:
        ranks = engine_ranks(page)
    before = replica.rank_targets
    dropped = set_ranks(replica, ranks)
    now = time.monotonic()
    for target in replica.rank_targets:
        load = page.rank_load(target.dp_rank)
        m = target.metrics
        m.waiting, m.running, m.kv_usage = load.waiting, load.running, load.kv_usage
        m.lora = load.lora  # vllm:lora_requests_info has no engine label: the server's
        if load.block_size is not None:
            m.block_size, m.num_blocks = load.block_size, load.num_blocks
        m.scraped_at = now
        m.in_flight_at_scrape = target.in_flight
        m.stale = False
    return replica.rank_targets != before, dropped
