"""One router replica's parts, as the HTTP fronts and the dashboard reach them."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvindex.routing_index import RoutingIndex
from router.observe.metrics import RouterMetrics
from router.prompts.id_memo import TokenIdMemo
from router.prompts.tokenization import Tokenization
from router.routing.accounting import RollingWindow, SharedPrefixes
from router.routing.decide import Decider
from router.routing.fleet import Fleet
from router.routing.model_sync import ModelSync
from router.settings import RouterSettings
from router.shared.replica_load import ReplicaLoad
from router.upstream.pool import UpstreamPool


@dataclass
class RouterState:
    settings: RouterSettings
    index: RoutingIndex
    fleet: Fleet
    decider: Decider
    load: ReplicaLoad
    tokenization: Tokenization
    upstream: UpstreamPool
    metrics: RouterMetrics
    model_sync: ModelSync
    window: RollingWindow = field(default_factory=RollingWindow)  # the dashboard's last minutes
    prefixes: SharedPrefixes = field(default_factory=SharedPrefixes)  # the dashboard's shared prefixes
    id_memo: TokenIdMemo = field(default_factory=TokenIdMemo)  # token-id prompts' text already decoded
