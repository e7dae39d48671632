"""The rendezvous state machine of one job: joins, ranks, generations, the barrier. Pure.

No sockets, no clock (``now`` is passed in), no files. Every change is an Event:
``decide_*`` validates a request against the state and returns the events it would
cause (or raises RendezvousError with a status code and a message naming the field);
``apply`` folds one event into the state. The owner persists the events through the
store before it applies and acknowledges them, and replays them on restart, so a
restarted coordinator rebuilds exactly the state it acknowledged.

By concern:
  errors.py       Code, RendezvousError and the input checks every decision shares
  model.py        the config, node states (NodeState), nodes, requests, assignments
  events.py       the events (EVENT_TYPES)
  identity.py     join tokens, Join, admitted nodes, node calls proving who they are
  register.py     Register (assigned and claimed ranks, the topology policy), await, heartbeat
  liveness.py     lost nodes, spares standing in, agents that restarted
  generations.py  worker exits (restart or fail), clean exits (success), leaving
  apply.py        how each event changes the state: a table of handlers, one per event type
  state.py        RendezvousState: the data, what derives from it, the decisions bound as methods

This package's names are the ones other modules import (``from
meshgate.coordinator.rendezvous import X``); the modules above are its inside.
"""

from meshgate.coordinator.rendezvous.errors import (
    MAX_ID_LEN,
    SHOWN_PREFIX,
    Code,
    RendezvousError,
    check_id,
    check_master_offer,
    shown,
)
from meshgate.coordinator.rendezvous.model import (
    MAX_DETAIL,
    MAX_NONCE,
    MIN_NONCE,
    AdmittedNode,
    Assignment,
    JoinAuth,
    Node,
    NodeState,
    RankMode,
    RegisterInput,
    RendezvousConfig,
    Token,
    TopologyPolicy,
)
from meshgate.coordinator.rendezvous.events import (
    EVENT_TYPES,
    Event,
    GenerationBumped,
    JobFailed,
    MasterChosen,
    MasterOffered,
    NodeAdopted,
    NodeJoined,
    NodeKeyed,
    NodeReplaced,
    NodeStateChanged,
    RankAssigned,
    TokenCreated,
    WorkerSucceeded,
)
from meshgate.coordinator.rendezvous.register import RegisterDecision
from meshgate.coordinator.rendezvous.identity import new_token, spend_token
from meshgate.coordinator.rendezvous.state import RendezvousState
from meshgate.plan import PlanError, compress_ranks

__all__ = [
    "MAX_ID_LEN",
    "SHOWN_PREFIX",
    "Code",
    "RendezvousError",
    "check_id",
    "check_master_offer",
    "shown",
    "MAX_DETAIL",
    "MAX_NONCE",
    "MIN_NONCE",
    "AdmittedNode",
    "Assignment",
    "JoinAuth",
    "Node",
    "NodeState",
    "RankMode",
    "RegisterInput",
    "RendezvousConfig",
    "Token",
    "TopologyPolicy",
    "EVENT_TYPES",
    "Event",
    "GenerationBumped",
    "JobFailed",
    "MasterChosen",
    "MasterOffered",
    "NodeAdopted",
    "NodeJoined",
    "NodeKeyed",
    "NodeReplaced",
    "NodeStateChanged",
    "RankAssigned",
    "TokenCreated",
    "WorkerSucceeded",
    "RegisterDecision",
    "new_token",
    "spend_token",
    "RendezvousState",
    "PlanError",
    "compress_ranks",
]
