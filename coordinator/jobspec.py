"""A job as submitted: the proto message meshgate.v1.JobSpec is its schema. Pure.

``JobSpec`` holds what the proto holds, field for field and by the same names (one
exception, ``num_nodes`` for the proto's ``nodes``), with the proto's enums as the Python
enums of the same names and members (RANK_MODE_CLAIMED is RankMode.CLAIMED). Its one
converter, ``from_proto``/``to_proto``, walks the message's descriptor, so a new proto
field needs no converter edit: a field the message leaves unset is left to ``build``'s
default, which is the default the proto documents. ``build`` is the one validation of a
submission. The cluster's log keeps the proto's JSON (``to_json``); a log record is read
back as it was accepted, not validated again, and records of the JSON form written
before the proto was the schema (``num_nodes``, lower-case policies) still replay.
"""

from __future__ import annotations

import enum
import json
import re
import dataclasses
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Callable, Iterable, Mapping, Optional

from google.protobuf import json_format, unknown_fields

from meshgate.coordinator.rendezvous import Code, RankMode, RendezvousConfig, RendezvousError, check_id, shown
from meshgate.plan import ParallelPlan, PlanError
from meshgate.v1 import rendezvous_pb2 as pb

# The cluster's own log is pinned under this id; no job may take it.
CLUSTER_LOG_ID = "cluster"
# A job id names its log directory and its mark file, so it is one safe path component:
# a DNS-label-like name, never "/", "..", a leading "-" (an option to a command line) or ".".
MAX_JOB_ID_LEN = 63
_JOB_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
# Variables the agent sets for its workers (coordinator, TLS files, vouch socket, insecure
# switch, ...): a job's env may not replace them, or its workers would talk to another
# coordinator, drop TLS or trust another bundle.
RESERVED_ENV_PREFIX = "MESHGATE_"
MAX_COMMAND_ARGS, MAX_ENV_VARS, MAX_TEXT_BYTES = 256, 256, 64 * 1024
# A job's time limit: at most a year (0: none).
MAX_TIME_LIMIT_S = 366 * 24 * 3600.0
# A launcher that has not come in ten minutes is not coming: the job says so and frees its
# nodes rather than stay RUNNING with nobody registered.
DEFAULT_LAUNCH_DEADLINE_S = 600.0


class TopologyPolicy(enum.Enum):
    """What a claimed rank whose TP or CP group would straddle nodes gets: logged,
    refused (FAILED_PRECONDITION), or not checked."""

    WARN = "warn"
    REFUSE = "refuse"
    ALLOW = "allow"


class RestartPolicy(enum.Enum):
    """What a worker's failure does: fail the job, or restart the whole job (up to
    max_restarts times)."""

    NEVER = "never"
    ON_FAILURE = "on-failure"


class LaunchMode(enum.Enum):
    """How the agents start the job's command on each node: one worker per slot, or one
    launcher per node that starts the node's workers itself (torchrun, ft_launcher)."""

    PER_SLOT = "per-slot"
    PER_NODE = "per-node"


# The proto's enums by name; a Python enum's members are the proto's values less the
# enum's prefix (RESTART_POLICY_ON_FAILURE: RestartPolicy.ON_FAILURE), and its values the
# spelling of job files and of the log's old records ("on-failure").
PY_ENUMS: dict[str, type[enum.Enum]] = {e.__name__: e for e in (RankMode, TopologyPolicy, RestartPolicy, LaunchMode)}
# The proto's field names that read differently here.
PY_NAMES = {"nodes": "num_nodes"}
# Numbers the proto reserved: an old client's field, refused rather than dropped.
RETIRED_FIELDS = {6: "mode", 7: "topology_policy", 11: "restart_policy"}


def enum_prefix(enum_type) -> str:
    """RANK_MODE_ for meshgate.v1.RankMode: its value 0 is <PREFIX>UNSPECIFIED."""
    return enum_type.values_by_number[0].name.removesuffix("UNSPECIFIED")


def check_job_id(job_id: object, name: str = "job_id") -> str:
    """INVALID_ARGUMENT naming the (bounded) id unless it is a short DNS-label-like name:
    1..63 of [A-Za-z0-9._-], starting with a letter or digit, without "..". Such an id is
    one path component that stays inside the directory it is joined to."""
    if not isinstance(job_id, str) or not job_id:
        raise RendezvousError(Code.INVALID_ARGUMENT, f"{name} must be a non-empty string")
    if len(job_id) > MAX_JOB_ID_LEN or not _JOB_ID_RE.match(job_id) or ".." in job_id:
        raise RendezvousError(
            Code.INVALID_ARGUMENT,
            f"{name} {shown(job_id)} must be 1..{MAX_JOB_ID_LEN} characters of [A-Za-z0-9._-], starting "
            "with a letter or digit, without '..'",
        )
    return job_id


def _check_no_nul(field_name: str, values: Iterable[str]) -> None:
    for value in values:
        if "\0" in value:
            raise RendezvousError(
                Code.INVALID_ARGUMENT, f"{field_name}: {shown(value)} holds a NUL byte; no argument or variable may"
            )


def _member(enum_class: type[enum.Enum], name: str, value: object) -> Any:
    """``value`` (a member, or its value as a job file spells it) as a member of ``enum_class``;
    INVALID_ARGUMENT naming the field otherwise."""
    try:
        return enum_class(value)
    except ValueError:
        known = [m.value for m in enum_class]
        raise RendezvousError(
            Code.INVALID_ARGUMENT, f"{name} must be {', '.join(known[:-1])} or {known[-1]}, got {shown(value)}"
        ) from None


# ---- the proto's fields, by kind --------------------------------------------------------------


def _kind(field) -> str:
    if field.enum_type is not None:
        return "enum"
    if field.message_type is not None:
        return "map" if field.message_type.GetOptions().map_entry else field.message_type.full_name
    return "repeated" if field.is_repeated else "scalar"


def _enum_from_wire(field, number: int) -> enum.Enum:
    value = field.enum_type.values_by_number.get(number)
    if value is None:
        known = ", ".join(v.name for v in field.enum_type.values)
        raise RendezvousError(
            Code.INVALID_ARGUMENT, f"spec.{field.name}: {number} is not a {field.enum_type.name} (one of {known})"
        )
    return PY_ENUMS[field.enum_type.name][value.name.removeprefix(enum_prefix(field.enum_type))]


def _plan_from_wire(field, message) -> ParallelPlan:
    try:
        return ParallelPlan.from_wire(message)
    except PlanError as exc:
        raise RendezvousError(Code.INVALID_ARGUMENT, f"spec.plan: {str(exc)[:300]}") from None


# A set field of the message as JobSpec holds it.
_FROM_WIRE: dict[str, Callable[[Any, Any], Any]] = {
    "enum": _enum_from_wire,
    "meshgate.v1.ParallelPlan": _plan_from_wire,
    "map": lambda field, value: tuple(sorted(value.items())),
    "repeated": lambda field, value: tuple(value),
    "scalar": lambda field, value: value,
}


def _enum_to_wire(message, field, member: enum.Enum) -> None:
    setattr(message, field.name, field.enum_type.values_by_name[enum_prefix(field.enum_type) + member.name].number)


# Sets a field of the message from JobSpec's value.
_TO_WIRE: dict[str, Callable[[Any, Any, Any], None]] = {
    "enum": _enum_to_wire,
    "meshgate.v1.ParallelPlan": lambda message, field, plan: message.plan.CopyFrom(plan.to_proto()),
    "map": lambda message, field, pairs: getattr(message, field.name).update(dict(pairs)),
    "repeated": lambda message, field, values: getattr(message, field.name).extend(values),
    "scalar": lambda message, field, value: setattr(message, field.name, value),
}


def _refuse_unknown(message, where: str, retired: Mapping[int, str]) -> None:
    """INVALID_ARGUMENT naming the first field of ``message`` (or of a message it holds)
    that this coordinator does not know: an older or a newer client's, never dropped, for
    the job would run otherwise than its submitter said."""
    unknown = sorted({f.field_number for f in unknown_fields.UnknownFieldSet(message)})
    if unknown:
        number, was = unknown[0], retired.get(unknown[0])
        raise RendezvousError(
            Code.INVALID_ARGUMENT,
            f"{where} field {number} is not known to this coordinator"
            + (
                f": it was the string {was}, now the enum field {was} "
                f"({message.DESCRIPTOR.fields_by_name[was].number}); update the client"
                if was
                else ""
            ),
        )
    for field, value in message.ListFields():
        if field.message_type is not None and not field.is_repeated:
            _refuse_unknown(value, f"{where}.{field.name}", {})


def wire_values(message: pb.JobSpec) -> dict[str, Any]:
    """The fields ``message`` sets, by JobSpec's names, as JobSpec holds them. A field left
    unset (0, "", empty, UNSPECIFIED) is absent: its default is ``build``'s. A field this
    coordinator does not know is refused by number."""
    _refuse_unknown(message, "spec", RETIRED_FIELDS)
    return {PY_NAMES.get(f.name, f.name): _FROM_WIRE[_kind(f)](f, value) for f, value in message.ListFields()}


@dataclass(frozen=True)
class JobSpec:
    """Everything a job is; immutable once submitted (a changed plan is a new job)."""

    job_id: str
    plan: ParallelPlan
    slots_per_node: int
    num_nodes: int
    node_ids: tuple[str, ...] = ()  # pinned nodes, in node-rank order (all of them, or none)
    mode: RankMode = RankMode.ASSIGNED
    topology_policy: TopologyPolicy = TopologyPolicy.WARN
    spares: int = 0
    command: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    restart_policy: RestartPolicy = RestartPolicy.NEVER
    max_restarts: int = 0
    lost_node_timeout_s: float = 300.0
    time_limit_s: float = 0.0  # 0: none; the coordinator ends a RUNNING job past it
    # A job without a command: how long its launchers (torchrun, Ray, Slurm) have to
    # register every worker once its nodes are given (ends.decide_launch_deadlines). 0: not
    # given; the coordinator records its [cluster] launch_deadline at submission, so a
    # record of the log written before deadlines existed keeps none.
    launch_deadline_s: float = 0.0
    launch: LaunchMode = LaunchMode.PER_SLOT

    @classmethod
    def build(
        cls,
        *,
        job_id: str = "",
        plan: ParallelPlan,
        slots_per_node: int = 0,
        num_nodes: int = 0,
        node_ids: Iterable[str] = (),
        mode: RankMode | str | None = None,
        topology_policy: TopologyPolicy | str = TopologyPolicy.WARN,
        spares: int = 0,
        command: Iterable[str] = (),
        env: Mapping[str, str] | Iterable[tuple[str, str]] = (),
        restart_policy: RestartPolicy | str = RestartPolicy.NEVER,
        max_restarts: Optional[int] = None,
        lost_node_timeout_s: float = 300.0,
        time_limit_s: float = 0.0,
        launch_deadline_s: float = 0.0,
        launch: LaunchMode | str = LaunchMode.PER_SLOT,
        submitted: bool = True,
        declared: bool = False,
    ) -> "JobSpec":
        """Validate a submission; INVALID_ARGUMENT naming the field otherwise. Nodes and
        slots may be given either way round: ``num_nodes`` (or the pinned ``node_ids``)
        derives the slots per node from the world size, and the reverse. The enums may be
        given as members or as a job file spells them ("claimed", "on-failure"). ``mode``
        unset: CLAIMED for a per-node launch (its launcher's workers claim their ranks),
        else ASSIGNED.
        ``submitted`` False: a spec of the log's old JSON form, held to the id and content
        rules of the version that accepted it (a job stays readable; its paths are checked
        on use). ``declared``: the job a coordinator config declares ([job] + [plan]), whose
        workers may be started by something other than an agent, so it needs no command."""
        check_job_id(job_id) if submitted else check_id("job_id", job_id)
        if job_id == CLUSTER_LOG_ID:
            raise RendezvousError(Code.INVALID_ARGUMENT, f"job_id {job_id!r} is reserved for the cluster's log")
        node_ids = tuple(node_ids)
        for node_id in node_ids:
            check_id("node_ids", node_id)
        if len(set(node_ids)) != len(node_ids):
            raise RendezvousError(Code.INVALID_ARGUMENT, f"node_ids has duplicates: {list(node_ids)[:16]}")
        for name, value in (("slots_per_node", slots_per_node), ("nodes", num_nodes), ("spares", spares)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise RendezvousError(Code.INVALID_ARGUMENT, f"{name} must be an integer >= 0, got {shown(value)}")
        world = plan.world_size
        if node_ids and num_nodes and num_nodes != len(node_ids):
            raise RendezvousError(
                Code.INVALID_ARGUMENT, f"nodes {num_nodes} differs from the {len(node_ids)} node_ids named"
            )
        num_nodes = num_nodes or len(node_ids)
        if not slots_per_node:
            if num_nodes and world % num_nodes:
                raise RendezvousError(
                    Code.INVALID_ARGUMENT, f"nodes {num_nodes} does not divide the plan's world size {world}"
                )
            slots_per_node = world // num_nodes if num_nodes else world
        if world % slots_per_node:
            raise RendezvousError(
                Code.INVALID_ARGUMENT, f"slots_per_node {slots_per_node} does not divide the plan's world size {world}"
            )
        if num_nodes and num_nodes * slots_per_node != world:
            raise RendezvousError(
                Code.INVALID_ARGUMENT,
                f"nodes {num_nodes} x slots_per_node {slots_per_node} = {num_nodes * slots_per_node}, "
                f"not the plan's world size {world}",
            )
        num_nodes = world // slots_per_node
        if node_ids and len(node_ids) != num_nodes:
            raise RendezvousError(
                Code.INVALID_ARGUMENT, f"node_ids names {len(node_ids)} nodes; the job needs {num_nodes}"
            )
        launch = _member(LaunchMode, "launch", launch)
        per_node = launch is LaunchMode.PER_NODE
        mode = _member(RankMode, "mode", mode or (RankMode.CLAIMED if per_node else RankMode.ASSIGNED))
        topology_policy = _member(TopologyPolicy, "topology_policy", topology_policy)
        restart_policy = _member(RestartPolicy, "restart_policy", restart_policy)
        command = tuple(command)
        if not all(isinstance(c, str) and c for c in command) or len(command) > MAX_COMMAND_ARGS:
            raise RendezvousError(
                Code.INVALID_ARGUMENT, f"command must be at most {MAX_COMMAND_ARGS} non-empty strings"
            )
        if mode is RankMode.ASSIGNED and not command and not declared:
            raise RendezvousError(
                Code.INVALID_ARGUMENT, "command is empty: an assigned-mode job's agents need a command to launch"
            )
        if per_node and mode is not RankMode.CLAIMED:
            raise RendezvousError(
                Code.INVALID_ARGUMENT,
                f"mode {mode.value!r} with launch 'per-node': a per-node launcher's workers (torchrun's) claim the "
                "ranks their launcher gives them; leave mode unset or make it 'claimed'",
            )
        if per_node and not command:
            raise RendezvousError(
                Code.INVALID_ARGUMENT,
                "command is empty: launch 'per-node' starts the job's command (its launcher, e.g. torchrun) on "
                "every node; a launcher started by hand needs no launch mode",
            )
        env_items = tuple(sorted(dict(env).items()))
        for key, value in env_items:
            if not isinstance(key, str) or not key or "=" in key or not isinstance(value, str):
                raise RendezvousError(Code.INVALID_ARGUMENT, f"env key {shown(key)} is not a NAME=value string pair")
        if submitted:
            if sum(len(c) for c in command) > MAX_TEXT_BYTES:
                raise RendezvousError(Code.INVALID_ARGUMENT, f"command: at most {MAX_TEXT_BYTES // 1024} KiB")
            if len(env_items) > MAX_ENV_VARS or sum(len(k) + len(v) for k, v in env_items) > MAX_TEXT_BYTES:
                raise RendezvousError(
                    Code.INVALID_ARGUMENT, f"env: at most {MAX_ENV_VARS} variables and {MAX_TEXT_BYTES // 1024} KiB"
                )
            _check_no_nul("command", command)
            _check_no_nul("env", (text for item in env_items for text in item))
            reserved = [key for key, _ in env_items if key.startswith(RESERVED_ENV_PREFIX)]
            if reserved:
                raise RendezvousError(
                    Code.INVALID_ARGUMENT,
                    f"env {shown(reserved[0])}: variables {RESERVED_ENV_PREFIX}* are the agent's (coordinator, "
                    "TLS, trust bundle, vouch socket) and a job may not set them",
                )
        if max_restarts is None:
            max_restarts = 3 if restart_policy is RestartPolicy.ON_FAILURE else 0
        if isinstance(max_restarts, bool) or not isinstance(max_restarts, int) or not 0 <= max_restarts <= 1000:
            raise RendezvousError(
                Code.INVALID_ARGUMENT, f"max_restarts must be in [0, 1000], got {shown(max_restarts)}"
            )
        if restart_policy is RestartPolicy.NEVER:
            max_restarts = 0
        if (
            isinstance(lost_node_timeout_s, bool)
            or not isinstance(lost_node_timeout_s, (int, float))
            or not (0 < lost_node_timeout_s <= 7 * 24 * 3600)
        ):
            raise RendezvousError(
                Code.INVALID_ARGUMENT, f"lost_node_timeout_s must be in (0, 604800], got {shown(lost_node_timeout_s)}"
            )
        if (
            isinstance(time_limit_s, bool)
            or not isinstance(time_limit_s, (int, float))
            or not (0 <= time_limit_s <= MAX_TIME_LIMIT_S)  # NaN is refused too
        ):
            raise RendezvousError(
                Code.INVALID_ARGUMENT,
                f"time_limit_s must be in [0, {MAX_TIME_LIMIT_S:.0f}] (0: none), got {shown(time_limit_s)}",
            )
        if (
            isinstance(launch_deadline_s, bool)
            or not isinstance(launch_deadline_s, (int, float))
            or not (0 <= launch_deadline_s <= MAX_TIME_LIMIT_S)
        ):
            raise RendezvousError(
                Code.INVALID_ARGUMENT,
                f"launch_deadline_s must be in [0, {MAX_TIME_LIMIT_S:.0f}] (0: the coordinator's), "
                f"got {shown(launch_deadline_s)}",
            )
        return cls(
            job_id,
            plan,
            slots_per_node,
            num_nodes,
            node_ids,
            mode,
            topology_policy,
            spares,
            command,
            env_items,
            restart_policy,
            max_restarts,
            float(lost_node_timeout_s),
            float(time_limit_s),
            float(launch_deadline_s),
            launch,
        )

    # ---- the proto: the one converter ------------------------------------------------------------

    @classmethod
    def from_proto(cls, message: pb.JobSpec, job_id: str = "") -> "JobSpec":
        """A submission, validated once (``build``): INVALID_ARGUMENT naming the field
        otherwise. ``job_id``: the id the coordinator chose for a message that names none."""
        values = wire_values(message)
        if "plan" not in values:
            raise RendezvousError(Code.INVALID_ARGUMENT, "spec.plan must be set")
        if job_id:
            values["job_id"] = job_id
        return cls.build(**values)

    @property
    def launchers_register(self) -> bool:
        """Whether launchers, not the agents' own per-slot workers, register this job's
        workers: a job without a command (torchrun, Ray, a batch script started elsewhere),
        or a per-node one (the agents start its launcher, which starts the workers: one that
        never registers them, ft_launcher on its own rendezvous say, holds the job)."""
        return not self.command or self.launch is LaunchMode.PER_NODE

    def with_launch_deadline(self, default_s: float) -> "JobSpec":
        """This spec as the coordinator records it: a job whose launchers register its
        workers that named no launch deadline gets the coordinator's (a per-slot job's agents
        start and watch every worker: it needs none)."""
        if not self.launchers_register or self.launch_deadline_s:
            return self
        return dataclasses.replace(self, launch_deadline_s=float(default_s))

    def to_proto(self) -> pb.JobSpec:
        """A fresh message (callers may change it): every field set as this spec holds it."""
        message = pb.JobSpec()
        message.CopyFrom(self._proto)
        return message

    @cached_property
    def _proto(self) -> pb.JobSpec:
        message = pb.JobSpec()
        for field in message.DESCRIPTOR.fields:
            _TO_WIRE[_kind(field)](message, field, getattr(self, PY_NAMES.get(field.name, field.name)))
        return message

    def rendezvous_config(self, node_order: tuple[str, ...], require_vouch: bool) -> RendezvousConfig:
        """The job's own rendezvous, over the nodes it was given (in node-rank order)."""
        return RendezvousConfig(
            job_id=self.job_id,
            plan=self.plan,
            slots_per_node=self.slots_per_node,
            node_order=node_order,
            topology_policy=self.topology_policy.value,  # type: ignore[arg-type]
            lost_node_timeout_s=self.lost_node_timeout_s,
            require_vouch=require_vouch,
            mode=self.mode,
            max_restarts=self.max_restarts,
        )

    # ---- the log's record ---------------------------------------------------------------------------

    def to_json(self) -> str:
        """The JobSubmitted record: the proto's JSON, with its field names and enum names."""
        body = json_format.MessageToDict(self._proto, preserving_proto_field_name=True)
        return json.dumps(body, separators=(",", ":"), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "JobSpec":
        """A record of the log, as it was accepted (validated when it was submitted, not
        again); ValueError when it is no job spec. Records written before the proto was the
        schema (they name ``num_nodes``) are read as they were then."""
        try:
            body = json.loads(text)
            if not isinstance(body, dict):
                raise ValueError("not a JSON object")
            if "num_nodes" in body:  # the old form: JobSpec.build's own keyword arguments
                return cls.build(plan=ParallelPlan.from_mapping(body.pop("plan")), submitted=False, **body)
            values = wire_values(json_format.ParseDict(body, pb.JobSpec()))
            return cls(**values)
        except (
            ValueError,
            TypeError,
            KeyError,
            AttributeError,
            PlanError,
            RendezvousError,
            json_format.ParseError,
        ) as exc:
            raise ValueError(f"not a job spec: {exc}") from None


__all__ = [
    "CLUSTER_LOG_ID",
    "JobSpec",
    "LaunchMode",
    "MAX_JOB_ID_LEN",
    "PY_ENUMS",
    "RESERVED_ENV_PREFIX",
    "RankMode",
    "RestartPolicy",
    "TopologyPolicy",
    "check_job_id",
    "wire_values",
]
