"""The CLI's read model: the coordinator's Status and JobInfo as plain data, and as text.

One formatter of a Status (``status_dict``): ``meshgate status`` prints it, and ``meshgate
job show`` prints the same for the job's rendezvous (``job_dict`` embeds it), so the two
views of one job never disagree. Plain data is what ``--json`` prints.
"""

from __future__ import annotations

from typing import Any, Optional

from google.protobuf import json_format

from meshgate.progress import describe as describe_progress
from meshgate.plan import ParallelPlan, compress_ranks
from meshgate.v1 import rendezvous_pb2 as pb

OUTCOME_EXIT = {"SUCCEEDED": 0, "FAILED": 1, "CANCELLED": 3}
ENDED = tuple(OUTCOME_EXIT)
_BAR_WIDTH = 40


def expand_ranks(compressed: str) -> list[int]:
    """ "0-3,8,10-11" -> [0, 1, 2, 3, 8, 10, 11] (the Status.missing_ranks form)."""
    out: list[int] = []
    for part in compressed.split(","):
        part = part.strip()
        if not part:
            continue
        first, _, last = part.partition("-")
        out.extend(range(int(first), int(last or first) + 1))
    return out


def _seconds(ts) -> float:
    return ts.seconds + ts.nanos / 1e9


def _iso(seconds: float) -> str:
    from datetime import datetime, timezone

    return datetime.fromtimestamp(seconds, tz=timezone.utc).isoformat(timespec="seconds")


def _age(seconds: float) -> str:
    seconds = max(seconds, 0.0)
    if seconds < 120:
        return f"{seconds:.1f}s"
    if seconds < 7200:
        return f"{seconds / 60:.1f}m"
    return f"{seconds / 3600:.1f}h"


def missing_by_node(status: pb.Status) -> list[dict]:
    """Missing ranks grouped by the node expected to hold them (the assigned layout:
    node_rank = rank // slots_per_node), as the coordinator's own AwaitWorld error does."""
    missing = expand_ranks(status.missing_ranks)
    if not missing:
        return []
    if status.mode == pb.RANK_MODE_CLAIMED:  # the framework places them: no node is expected to hold one
        return [
            {
                "node": "unclaimed (claimed mode)",
                "node_rank": None,
                "ranks": status.missing_ranks,
                "count": len(missing),
            }
        ]
    slots = next((n.slots for n in status.nodes if n.slots), 0)
    if not slots:
        return [
            {"node": "(no node has joined)", "node_rank": None, "ranks": status.missing_ranks, "count": len(missing)}
        ]
    by_rank = {n.node_rank: n.node_id for n in status.nodes}
    groups: dict[int, list[int]] = {}
    for rank in missing:
        groups.setdefault(rank // slots, []).append(rank)
    return [
        {
            "node": by_rank.get(node_rank, f"node_rank {node_rank} (not joined)"),
            "node_rank": node_rank,
            "ranks": compress_ranks(ranks),
            "count": len(ranks),
        }
        for node_rank, ranks in sorted(groups.items())
    ]


def node_dict(node: pb.NodeStatus, now: float, claimed: bool = False) -> dict[str, Any]:
    """``claimed``: its ranks are those its workers registered (where Ray or Fabric put
    them), never a planned block."""
    last_seen = _seconds(node.last_seen) if node.HasField("last_seen") else None
    if claimed:
        ranks = node.registered_ranks or "-"
    elif node.node_rank < 0:  # a spare, or a replaced node: no rank block
        ranks = "-"
    else:
        last = node.first_rank + node.slots - 1
        ranks = f"{node.first_rank}-{last}" if node.slots > 1 else str(node.first_rank)
    return {
        "node_id": node.node_id,
        "node_rank": node.node_rank,
        "hostname": node.hostname,
        "state": _node_state(node.state),
        "slot_kind": node.slot_kind,
        "slots": node.slots,
        "first_rank": node.first_rank,
        "ranks": ranks,
        "registered": node.registered,
        "last_seen": _iso(last_seen) if last_seen else None,
        "last_seen_age_s": round(now - last_seen, 3) if last_seen else None,
        "silent_s": round(node.silent_s, 1) if node.silent_s else None,
        "exits": list(node.exits),
        "step": node.step or None,  # what its workers reported (meshgate.report); None: nothing
        "step_time_s": round(node.step_time_s, 4) if node.step_time_s else None,
        "pool_state": _pool_state(node.pool_state) if node.pool_state else None,
    }


def status_dict(status: pb.Status, coordinator: str, now: float) -> dict:
    """Status as plain JSON-able data (what ``status --json`` prints)."""
    from google.protobuf import json_format

    opened = _seconds(status.opened_at) if status.HasField("opened_at") else None
    ended = _seconds(status.ended_at) if status.HasField("ended_at") else None  # its clock stops
    return {
        "coordinator": coordinator,
        "job_id": status.job_id,
        "generation": status.generation,
        "plan": json_format.MessageToDict(status.plan, preserving_proto_field_name=True),
        "plan_digest": status.plan_digest.hex(),
        "world_size": status.world_size,
        "registered": status.registered,
        # A failed job is never complete, however many ranks registered before it failed.
        "complete": status.world_size > 0 and status.registered == status.world_size and not status.failure,
        "failure": status.failure or None,
        "failure_log_tail": status.failure_log_tail or None,
        "missing_ranks": status.missing_ranks,
        "missing_by_node": missing_by_node(status),
        "opened_at": _iso(opened) if opened else None,
        "open_for_s": round((ended or now) - opened, 3) if opened else None,
        "ended_at": _iso(ended) if ended else None,
        "master": f"{status.master_addr}:{status.master_port}" if status.master_addr else None,
        "mode": file_spelling("mode", status.mode or pb.RANK_MODE_ASSIGNED),
        "nodes": [node_dict(n, now, status.mode == pb.RANK_MODE_CLAIMED) for n in status.nodes],
        "nodes_more": status.nodes_more,  # left out by the coordinator to bound the answer
        "progress": progress_dict(status.progress) if status.HasField("progress") else None,
        "observed_at": _iso(now),
    }


def progress_dict(progress: pb.JobProgress) -> dict[str, Any]:
    """What the job's workers reported of their training, and the line `job show` prints."""
    at = _seconds(progress.last_step_at) if progress.HasField("last_step_at") else None
    return {
        "step": progress.step,
        "slowest_step": progress.slowest_step,
        "steps_per_s": progress.steps_per_s,
        "samples_per_s": progress.samples_per_s,
        "loss": progress.loss if progress.HasField("loss") else None,
        "nodes_reporting": progress.nodes_reporting,
        "straggler": progress.straggler or None,
        "straggler_ratio": round(progress.straggler_ratio, 3) if progress.straggler else None,
        "last_step_at": _iso(at) if at else None,
        "text": describe_progress(progress),
    }


def _bar(done: int, total: int, width: int = _BAR_WIDTH) -> str:
    fraction = done / total if total else 0.0
    filled = int(round(fraction * width))
    return f"[{'#' * filled}{'.' * (width - filled)}] {done}/{total} ranks ({fraction:.0%})"


def _render_rendezvous(data: dict, *, bar: bool, max_nodes: int) -> list[str]:
    """The lines a Status shows, after its heading: open for, master, ranks, nodes, missing."""
    lines = []
    if data["open_for_s"] is not None:
        if data.get("ended_at"):
            lines.append(
                f"job ended at {data['ended_at']} after {_age(data['open_for_s'])} (opened {data['opened_at']})"
            )
        else:
            lines.append(f"rendezvous open for {_age(data['open_for_s'])} (since {data['opened_at']})")
    else:
        lines.append("rendezvous not open yet: no node has joined")
    if data["master"]:
        lines.append(f"master {data['master']}")
    if bar:
        lines.append(_bar(data["registered"], data["world_size"]))
    else:
        lines.append(f"registered {data['registered']}/{data['world_size']} ranks")
    if data.get("progress"):
        lines.append(f"progress: {data['progress']['text']}")
    nodes = data["nodes"]
    if nodes:
        header = ("NODE", "RANK", "HOST", "STATE", "KIND", "RANKS", "REG", "LAST SEEN")
        rows = [
            (
                n["node_id"],
                str(n["node_rank"]),
                n["hostname"] or "-",
                _suspect(n["state"], n["silent_s"]) + _out_of_job(n.get("pool_state")),
                n["slot_kind"] or "-",
                n["ranks"],
                f"{n['registered']}/{n['slots']}",
                f"{_age(n['last_seen_age_s'])} ago" if n["last_seen_age_s"] is not None else "-",
            )
            for n in nodes[:max_nodes]
        ]
        if any(n.get("step") for n in nodes):  # the workers report progress: which node is where
            header += ("STEP", "STEP TIME")
            rows = [
                (*row, str(n.get("step") or "-"), f"{n['step_time_s']:.3g}s" if n.get("step_time_s") else "-")
                for row, n in zip(rows, nodes)
            ]
        widths = [max(len(r[i]) for r in rows + [header]) for i in range(len(header))]
        lines.append("")
        for row in [header] + rows:
            lines.append("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
        if len(nodes) > max_nodes:
            lines.append(f"... and {len(nodes) - max_nodes} more nodes (--json lists all)")
        if data.get("nodes_more"):
            lines.append(f"... and {data['nodes_more']} more nodes the coordinator left out (its answer is bounded)")
        exits = [(n["node_id"], e) for n in nodes for e in n["exits"][-3:]]
        if exits:
            lines.append("")
            lines.append("recent worker exits:")
            lines += [f"  {node}: {line}" for node, line in exits[:max_nodes]]
    lines.append("")
    if data.get("failure"):
        lines.append(f"JOB FAILED: {data['failure']}")
        if data.get("failure_log_tail"):
            lines.append("last output of the worker that failed first (meshgate job logs ID --rank R has all of it):")
            lines += [f"  | {line}" for line in data["failure_log_tail"].splitlines()]
        return lines
    groups = data["missing_by_node"]
    if not groups:
        lines.append("missing ranks: none (world complete)" if data["complete"] else "missing ranks: none")
    else:
        total = sum(g["count"] for g in groups)
        lines.append(f"missing ranks ({total} of {data['world_size']}), by node:")
        lines += [f"  {g['node']}: {g['ranks']}" for g in groups[:max_nodes]]
        if len(groups) > max_nodes:
            lines.append(f"  ... and {len(groups) - max_nodes} more nodes (--json lists all)")
    return lines


def render_status(data: dict, *, bar: bool = False, max_nodes: int = 64) -> str:
    plan = data["plan"]
    sizes = " ".join(f"{a}={plan.get(a, 1)}" for a in plan.get("order", []) if int(plan.get(a, 1)) > 1)
    lines = [
        f"job {data['job_id']}  generation {data['generation']}  coordinator {data['coordinator']}",
        f"plan {sizes or 'world 1'} (world {data['world_size']}, digest {data['plan_digest'][:16]})",
    ]
    return "\n".join(lines + _render_rendezvous(data, bar=bar, max_nodes=max_nodes))


# ---- jobs --------------------------------------------------------------------------------------


def enum_prefix(enum_type) -> str:
    return enum_type.values_by_number[0].name.removesuffix("UNSPECIFIED")


def file_spelling(field_name: str, number: int) -> str:
    """An enum field's value as a job file spells it: RANK_MODE_CLAIMED is "claimed"."""
    enum_type = pb.JobSpec.DESCRIPTOR.fields_by_name[field_name].enum_type
    name = enum_type.values_by_number[number].name if number in enum_type.values_by_number else str(number)
    return name.removeprefix(enum_prefix(enum_type)).lower().replace("_", "-")


def job_dict(info: pb.JobInfo, coordinator: str = "", now: Optional[float] = None) -> dict[str, Any]:
    """What ``job show`` / ``job watch`` --json print: one object per job; once allocated, its
    rendezvous under "status", the very object ``meshgate status --job`` prints."""
    import time

    plan = ParallelPlan.from_proto(info.spec.plan)
    data: dict[str, Any] = {
        "job_id": info.spec.job_id,
        "state": pb.JobState.Name(info.state),
        "reason": info.reason,
        "plan": plan.describe(),
        "plan_digest": info.plan_digest.hex(),
        "world_size": plan.world_size,
        "nodes": list(info.nodes),
        "spares": list(info.spare_nodes),
        "nodes_more": info.nodes_more,  # names left out by the coordinator to bound the answer
        "slots_per_node": info.spec.slots_per_node,
        "mode": file_spelling("mode", info.spec.mode),
        "command": list(info.spec.command),
        "owner": info.owner,
        "redacted": info.redacted,
        "submitted_at": info.submitted_at.ToJsonString(),
        "time_limit_s": info.spec.time_limit_s,  # 0: none
        # Only a job whose launchers register its workers has one: without a command, or per node.
        "launch_deadline_s": (
            info.spec.launch_deadline_s if not info.spec.command or info.spec.launch == pb.LAUNCH_MODE_PER_NODE else 0.0
        ),
    }
    if info.HasField("ended_at"):
        data["ended_at"] = info.ended_at.ToJsonString()
    if info.HasField("status"):
        data["status"] = status_dict(info.status, coordinator, time.time() if now is None else now)
    return data


def render_job(data: dict[str, Any], *, max_nodes: int = 64) -> str:
    lines = [
        f"job {data['job_id']}: {data['state']}" + (f" ({data['reason']})" if data["reason"] else ""),
        f"  plan: {data['plan']}, digest {data['plan_digest'][:16]}",
        f"  nodes: {', '.join(data['nodes']) or '(none yet)'}"
        + (f"; spares: {', '.join(data['spares'])}" if data["spares"] else "")
        + (f" and {data['nodes_more']} more" if data.get("nodes_more") else "")
        + f"; {data['slots_per_node']} slots each, {data['mode']} ranks",
        f"  owner: {data['owner'] or '(anonymous)'}"
        + (f"; time limit {data['time_limit_s']:g}s" if data.get("time_limit_s") else "")
        + (f"; launch deadline {data['launch_deadline_s']:g}s" if data.get("launch_deadline_s") else ""),
        "  command: "
        + (
            "(withheld: only its owner or an admin may see command and env)"
            if data["redacted"]
            else " ".join(data["command"]) or "(none: external workers)"
        ),
    ]
    if "status" in data:
        status = data["status"]
        lines += ["", f"generation {status['generation']}"]
        lines += _render_rendezvous(status, bar=False, max_nodes=max_nodes)
    return "\n".join(lines)


def one_line(text: str, limit: int = 80) -> str:
    """``text`` as one row of a table shows it: every run of whitespace (newlines of a
    traceback or a Ray error among them) one space, other control characters dropped,
    at most ``limit`` characters ("..." when cut). `job show` keeps the full text."""
    flat = " ".join("".join(c for c in part if c.isprintable()) for part in text.split())
    return flat if len(flat) <= limit else flat[: max(limit - 3, 0)] + "..."


def timeline_dict(timeline: pb.JobTimeline) -> dict[str, Any]:
    """What ``job show --timeline --json`` prints: the job's moments in order, with times
    (RFC 3339, and seconds since the first)."""
    first = _seconds(timeline.entries[0].at) if timeline.entries else 0.0
    entries = []
    for e in timeline.entries:
        entry: dict[str, Any] = {
            "moment": pb.TimelineMoment.Name(e.moment).removeprefix("TIMELINE_").lower(),
            "at": e.at.ToJsonString(),
            "offset_s": round(_seconds(e.at) - first, 3),
            "generation": e.generation,
            "node_id": e.node_id,
            "detail": e.detail,
        }
        if e.HasField("until"):
            entry["until"], entry["until_offset_s"] = e.until.ToJsonString(), round(_seconds(e.until) - first, 3)
        if e.count:
            entry["count"] = e.count
        entries.append(entry)
    return {
        "job_id": timeline.job_id,
        "state": pb.JobState.Name(timeline.state),
        "entries": entries,
        "entries_dropped": timeline.entries_dropped,
        "note": timeline.note,
    }


def render_timeline(data: dict[str, Any], width: int = 100) -> str:
    """One line per moment: its UTC time, seconds since the first (a span: first..last),
    generation, what, node and detail (one line each, bounded)."""
    from datetime import datetime

    lines = [f"job {data['job_id']}: {data['state']}"]
    if data["note"]:
        lines.append(f"  note: {data['note']}")
    if data["entries_dropped"]:
        lines.append(f"  ({data['entries_dropped']} earliest rendezvous entries not kept)")
    rows = []
    for e in data["entries"]:
        at = datetime.fromisoformat(e["at"].replace("Z", "+00:00")).strftime("%H:%M:%S.%f")[:-3]
        offset = f"+{e['offset_s']:.3f}" + (f"..+{e['until_offset_s']:.3f}" if "until" in e else "")
        what = e["moment"].replace("_", " ") + (f" ({e['count']})" if "count" in e else "")
        rows.append((at, offset, str(e["generation"]), what, e["node_id"] or "-", one_line(e["detail"], width)))
    return "\n".join(lines + _table(("TIME (UTC)", "SINCE (s)", "GEN", "WHAT", "NODE", "DETAIL"), rows))


def render_list(jobs: list[dict[str, Any]]) -> str:
    if not jobs:
        return "no jobs"
    width = max([3] + [len(j["job_id"]) for j in jobs]) + 2
    owners = min(max([5] + [len(j["owner"] or "-") for j in jobs]), 32) + 2
    lines = [f"{'JOB':<{width}}{'STATE':<11}{'WORLD':>5}  {'OWNER':<{owners}}{'NODES':<24}REASON"]
    for j in jobs:
        nodes = ",".join(j["nodes"]) or "-"
        owner = (j["owner"] or "-")[: owners - 2]
        lines.append(
            f"{j['job_id']:<{width}}{j['state']:<11}{j['world_size']:>5}  {owner:<{owners}}"
            f"{nodes[:23]:<24}{one_line(j['reason'])}"
        )
    return "\n".join(lines)


class LogLines:
    """Job output chunks (``meshgate job logs``) as bytes to print: as they came for one
    rank; with ``prefix`` (several ranks interleave), each whole line led by its rank."""

    def __init__(self, prefix: bool) -> None:
        self.prefix = prefix
        self.partial: dict[int, bytes] = {}  # per rank: the start of a line not ended yet

    def feed(self, rank: int, data: bytes) -> bytes:
        if not self.prefix:
            return data
        *lines, self.partial[rank] = (self.partial.pop(rank, b"") + data).split(b"\n")
        return b"".join(b"[rank %d] %s\n" % (rank, line) for line in lines)

    def flush(self) -> bytes:
        rest = b"".join(b"[rank %d] %s\n" % (rank, line) for rank, line in sorted(self.partial.items()) if line)
        self.partial.clear()
        return rest


def log_chunk_dict(chunk: pb.JobLogsChunk) -> dict[str, Any]:
    """One chunk as ``job logs --json`` prints it (one object per line)."""
    if chunk.notice:
        return {"node_id": chunk.node_id, "notice": chunk.notice}
    return {"node_id": chunk.node_id, "rank": chunk.rank, "data": chunk.data.decode("utf-8", errors="replace")}


# ---- the cluster ---------------------------------------------------------------------------


def _table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows + [header]) for i in range(len(header))]
    return ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in [header] + rows]


def _pool_state(number: int) -> str:
    """POOL_STATE_SERVING -> "serving", as metrics labels and PoolState values spell it."""
    return pb.PoolState.Name(number).removeprefix("POOL_STATE_").lower()


def pool_node_dict(node: pb.PoolNode, now: float) -> dict[str, Any]:
    """A node of the pool as ``meshgate nodes --json`` prints it."""
    last_seen = _seconds(node.last_seen) if node.HasField("last_seen") else None
    return {
        "node_id": node.node_id,
        "state": _pool_state(node.state),
        "hostname": node.hostname,
        "slots": node.slots,
        "slot_kind": node.slot_kind,
        "labels": dict(sorted(node.labels.items())),
        "job_id": node.job_id or None,
        "job_node_state": _node_state(node.job_node_state) if node.job_node_state else None,
        "last_seen": _iso(last_seen) if last_seen else None,
        "last_seen_age_s": round(now - last_seen, 3) if last_seen else None,
        "silent_s": round(node.silent_s, 1) if node.silent_s else None,
        # Why it takes no new job (admission.py), the strongest first; None when nothing holds it.
        "cordoned": node.cordoned or None,
        "quarantined": node.quarantined or None,
        "unhealthy": node.unhealthy or None,
        "failures": node.failures,
        # An uncordon waiting for a passing health check run after it ("by admin:alice").
        "uncordon_asked": node.uncordon_asked or None,
        # Its agent's versions (meshgate/wire.py); None before it called this coordinator.
        "agent_release": node.agent_release or None,
        "agent_wire": node.agent_wire if node.agent_release else None,
        # What its agent read of the node (NodeHardware's fields, serials included: an
        # operator's view, never a metric); None before this coordinator heard it.
        "hardware": (
            json_format.MessageToDict(
                node.hardware, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
            )
            if node.HasField("hardware")
            else None
        ),
        "hardware_shared": node.hardware_shared or None,
    }


def _hardware(node: dict[str, Any]) -> str:
    """ "8 GPU, NVLink 5f1c3a2b-.../7, 2 NIC" (and what it shares with another node); "-" unknown."""
    hardware = node.get("hardware")
    if not hardware:
        return "-"
    text = f"{len(hardware['gpus'])} GPU"
    if hardware["nvlink_domain"]:
        text += f", NVLink {hardware['nvlink_domain']}"
    text += f", {len(hardware['nics'])} NIC"
    return f"{text}; {node['hardware_shared']}" if node.get("hardware_shared") else text


def _node_state(number: int) -> str:
    """NODE_STATE_LOST -> "lost", as `job show` spells it."""
    return pb.NodeState.Name(number).removeprefix("NODE_STATE_").lower()


def _suspect(state: str, silent_s: Optional[float]) -> str:
    """ "active" or, silent past one heartbeat interval, "active, silent 8s"."""
    return f"{state}, silent {silent_s:.0f}s" if silent_s else state


def _out_of_job(pool_state: Optional[str]) -> str:
    """ ", draining" (then ", cordoned") for a node an operator drained out of the job, as
    `meshgate nodes` shows it; "" for a node the job holds (serving)."""
    return f", {pool_state}" if pool_state in ("draining", "cordoned", "quarantined", "unhealthy") else ""


def _pool_row_state(node: dict[str, Any]) -> str:
    """ "serving" as `job show` sees the node too: "serving: lost" once its job declared
    it lost, "serving, silent 8s" while it is a suspect (one read model, two views)."""
    state = node["state"]
    if node["job_node_state"] not in (None, "active", "spare"):
        state += f": {node['job_node_state']}"
    return _suspect(state, node["silent_s"])


def _held(node: dict[str, Any]) -> str:
    """Why the node takes no new job, one line: "cordoned by admin:alice: disk" (the
    strongest hold first, each one named), "-" when nothing holds it."""
    held = [
        f"{what}: {node[what]}" if what != "cordoned" else f"cordoned {node[what]}" for what in _HOLDS if node[what]
    ]
    if node.get("uncordon_asked"):  # said first: it is what the operator waits on
        held.insert(0, f"uncordon asked {node['uncordon_asked']}, returns after a passing check")
    return "; ".join(held)[:120] or "-"


_HOLDS = ("cordoned", "quarantined", "unhealthy")


def render_nodes(nodes: list[dict[str, Any]], total: int) -> str:
    """The pool as a table; ``total`` beyond the rows shown is said, not listed."""
    if not nodes:
        if total:
            return f"... {total} nodes (--limit 0 lists all)"
        # A single-job config's nodes join its job, not the pool.
        return "no node has joined the pool (a declared job's nodes: meshgate status)"
    rows = [
        (
            n["node_id"],
            _pool_row_state(n),
            f"{n['slots']} {n['slot_kind']}",
            n["job_id"] or "-",
            f"{_age(n['last_seen_age_s'])} ago" if n["last_seen_age_s"] is not None else "-",
            ",".join(f"{k}={v}" for k, v in n["labels"].items())[:60] or "-",
            _held(n),
            f"{n['agent_release']} (wire {n['agent_wire']})" if n.get("agent_release") else "-",
            _hardware(n),
        )
        for n in nodes
    ]
    lines = _table(("NODE", "STATE", "SLOTS", "JOB", "LAST SEEN", "LABELS", "HELD", "AGENT", "HARDWARE"), rows)
    if total > len(nodes):
        lines.append(f"... and {total - len(nodes)} more nodes (--limit 0 lists all)")
    return "\n".join(lines)


# The quotas, as the coordinator's SubmitterQuota spells them (one schema: its fields).
QUOTA_KEYS = tuple(f.name for f in pb.SubmitterQuota.DESCRIPTOR.fields if f.name != "owner")


def _quota_lines(data: dict[str, Any]) -> list[str]:
    """The quotas per submitter, one line each ("-": no limit)."""
    if not data.get("quotas"):
        return []
    rows = [(q["owner"] or "(every submitter)", *(str(q[k] or "-") for k in QUOTA_KEYS)) for q in data["quotas"]]
    exempt = "admins exempt" if data["quota_admins_exempt"] else "admins held to them too"
    lines = [f"quotas per submitter, over its waiting and running jobs ({exempt}):"]
    header = ("OWNER", *(key.replace("_per_", "/").replace("_", " ").upper() for key in QUOTA_KEYS))
    return lines + ["  " + line for line in _table(header, rows)] + [""]


def _held_lines(data: dict[str, Any]) -> list[str]:
    """The nodes held out of allocation, each with why (a cordon, a quarantine, a failing check)."""
    held = data.get("held") or []
    if not held:
        return []
    rows = [(n["node_id"], _pool_row_state(n), _held(n)) for n in held]
    lines = ["held out of allocation:"] + ["  " + line for line in _table(("NODE", "STATE", "WHY"), rows)]
    if data.get("held_more"):
        lines.append(f"  ... and {data['held_more']} more held (meshgate nodes lists them)")
    return lines + [""]


def cluster_dict(cluster: pb.ClusterStatus, coordinator: str, now: float) -> dict[str, Any]:
    """ClusterStatus as plain data (what ``meshgate status --json`` prints with no job)."""
    return {
        "coordinator": coordinator,
        "jobs": {pb.JobState.Name(c.state): c.count for c in cluster.jobs if c.state},
        "nodes": {_pool_state(c.state): c.count for c in cluster.nodes if c.state},
        "queue": [
            {
                "job_id": q.job_id,
                "owner": q.owner,
                "reason": q.reason,
                "submitted_at": q.submitted_at.ToJsonString(),
                "waiting_s": round(now - _seconds(q.submitted_at), 3),
            }
            for q in cluster.queue
        ],
        "queue_more": cluster.queue_more,
        "quotas": [{"owner": q.owner, **{key: getattr(q, key) for key in QUOTA_KEYS}} for q in cluster.quotas],
        "quota_admins_exempt": cluster.quota_admins_exempt,
        "held": [pool_node_dict(n, now) for n in cluster.held],
        "held_more": cluster.held_more,
        "observed_at": _iso(now),
    }


def render_cluster(data: dict[str, Any]) -> str:
    def counts(by_state: dict[str, int]) -> str:
        return "  ".join(f"{state.lower()} {count}" for state, count in by_state.items())

    lines = [
        f"cluster at {data['coordinator']}",
        f"jobs:   {counts(data['jobs'])}",
        f"nodes:  {counts(data['nodes'])}  ({sum(data['nodes'].values())} in all; meshgate nodes lists them)",
        "",
        *_quota_lines(data),
        *_held_lines(data),
    ]
    queue = data["queue"]
    if not queue:
        return "\n".join(lines + ["queue: empty"])
    lines.append(f"queue ({len(queue) + data['queue_more']} pending, oldest first):")
    rows = [(q["job_id"], q["owner"] or "-", _age(q["waiting_s"]), q["reason"][:160]) for q in queue]
    lines += ["  " + line for line in _table(("JOB", "OWNER", "WAITING", "REASON"), rows)]
    if data["queue_more"]:
        lines.append(f"  ... and {data['queue_more']} more pending (meshgate job list --state PENDING lists all)")
    return "\n".join(lines)


def progress(data: dict[str, Any]) -> str:
    """One line of a job's progress (what ``job watch`` prints on each change)."""
    line = f"{data['job_id']}: {data['state']}"
    if "status" in data:
        status = data["status"]
        line += f", generation {status['generation']}, {status['registered']}/{status['world_size']} ranks"
    if data["reason"]:
        line += f" ({one_line(data['reason'], 300)})"  # one line, as its docstring says
    return line


__all__ = [
    "ENDED",
    "OUTCOME_EXIT",
    "cluster_dict",
    "expand_ranks",
    "job_dict",
    "missing_by_node",
    "node_dict",
    "one_line",
    "pool_node_dict",
    "progress",
    "render_timeline",
    "timeline_dict",
    "render_cluster",
    "render_job",
    "render_list",
    "render_nodes",
    "render_status",
    "status_dict",
]
