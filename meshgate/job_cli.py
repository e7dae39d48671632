"""``meshgate job``: submit, list, show, watch, wait for and cancel jobs on a coordinator
in jobs mode (one whose config names no [job]). Admin calls: the connection flags are
those of ``meshgate status``.

Exit codes of ``job wait`` and ``job watch``: 0 SUCCEEDED, 1 FAILED, 3 CANCELLED, 2 an
error (unknown job, coordinator unreachable).
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any, Callable, Optional

from meshgate.v1 import rendezvous_pb2 as pb

OUTCOME_EXIT = {"SUCCEEDED": 0, "FAILED": 1, "CANCELLED": 3}
ENDED = tuple(OUTCOME_EXIT)


class JobCliError(RuntimeError):
    pass


# ---- the job file and the flags ----------------------------------------------------------

JOB_KEYS = {
    "id", "nodes", "node_ids", "slots_per_node", "mode", "topology_policy", "spares", "command",
    "env", "restart_policy", "max_restarts", "lost_node_timeout_s",
}


def load_job_file(path: str) -> dict[str, Any]:
    """A job TOML: ``[job]`` (the keys of JOB_KEYS) and ``[plan]``."""
    import tomllib

    try:
        with open(path, "rb") as handle:
            document = tomllib.load(handle)
    except OSError as exc:
        raise JobCliError(f"{path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise JobCliError(f"{path}: invalid TOML: {exc}") from None
    unknown = sorted(set(document) - {"job", "plan"})
    if unknown:
        raise JobCliError(f"{path}: unknown section(s) {unknown}; a job file has [job] and [plan]")
    job = dict(document.get("job", {}))
    bad = sorted(set(job) - JOB_KEYS)
    if bad:
        raise JobCliError(f"{path}: [job] unknown key(s) {bad}; known: {sorted(JOB_KEYS)}")
    if "plan" in document:
        job["plan"] = document["plan"]
    return job


def spec_from_args(args) -> pb.JobSpec:
    """The JobSpec of ``job submit``: the job file's values, each flag given overriding it."""
    from meshgate.cli import load_plan
    from meshgate.data import DataError
    from meshgate.plan import ParallelPlan, PlanError

    values = load_job_file(args.file) if args.file else {}
    try:
        if args.plan:
            plan = load_plan(args.plan)
        elif "plan" in values:
            plan = ParallelPlan.from_mapping(values["plan"])
        else:
            raise JobCliError("--plan PLAN (a file or an example name) is required, or a job file with [plan]")
    except (PlanError, DataError) as exc:
        raise JobCliError(str(exc)) from None
    command = list(args.command[1:] if args.command[:1] == ["--"] else args.command) or list(values.get("command", []))
    env = dict(values.get("env", {}))
    for item in args.env or ():
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise JobCliError(f"--env {item!r}: expected NAME=value")
        env[key] = value
    spec = pb.JobSpec(
        job_id=args.id or values.get("id", ""),
        plan=plan.to_proto(),
        nodes=args.nodes or values.get("nodes", 0),
        node_ids=args.node or values.get("node_ids", []),
        slots_per_node=args.slots_per_node or values.get("slots_per_node", 0),
        mode=args.mode or values.get("mode", ""),
        topology_policy=args.topology_policy or values.get("topology_policy", ""),
        spares=args.spares if args.spares is not None else values.get("spares", 0),
        command=command,
        env=env,
        restart_policy=args.restart_policy or values.get("restart_policy", ""),
        lost_node_timeout_s=values.get("lost_node_timeout_s", 0),
    )
    max_restarts = args.max_restarts if args.max_restarts is not None else values.get("max_restarts")
    if max_restarts is not None:
        spec.max_restarts = max_restarts
    return spec


# ---- views -----------------------------------------------------------------------------------


def job_dict(info: pb.JobInfo) -> dict[str, Any]:
    """What show/watch --json print: one object per job."""
    from meshgate.plan import ParallelPlan

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
        "slots_per_node": info.spec.slots_per_node,
        "mode": info.spec.mode,
        "command": list(info.spec.command),
        "owner": info.owner,
        "redacted": info.redacted,
        "submitted_at": info.submitted_at.ToJsonString(),
    }
    if info.HasField("ended_at"):
        data["ended_at"] = info.ended_at.ToJsonString()
    if info.HasField("status"):
        status = info.status
        data.update(
            generation=status.generation,
            registered=status.registered,
            missing_ranks=status.missing_ranks,
            master=f"{status.master_addr}:{status.master_port}" if status.master_addr else "",
            node_table=[
                {"node_id": n.node_id, "node_rank": n.node_rank, "state": pb.NodeState.Name(n.state).removeprefix("NODE_STATE_").lower(),
                 "ranks": f"{n.first_rank}-{n.first_rank + n.slots - 1}" if n.node_rank >= 0 else "",
                 "registered": n.registered, "exits": list(n.exits)}
                for n in status.nodes
            ],
        )
    return data


def render_job(data: dict[str, Any]) -> str:
    lines = [
        f"job {data['job_id']}: {data['state']}" + (f" ({data['reason']})" if data["reason"] else ""),
        f"  plan: {data['plan']}, digest {data['plan_digest'][:16]}",
        f"  nodes: {', '.join(data['nodes']) or '(none yet)'}"
        + (f"; spares: {', '.join(data['spares'])}" if data["spares"] else "")
        + f"; {data['slots_per_node']} slots each, {data['mode']} ranks",
        f"  owner: {data['owner'] or '(anonymous)'}",
        "  command: " + ("(withheld: only its owner or an admin may see command and env)" if data["redacted"]
                         else " ".join(data["command"]) or "(none: external workers)"),
    ]
    if "generation" in data:
        lines.append(
            f"  generation {data['generation']}: {data['registered']}/{data['world_size']} ranks registered"
            + (f", missing {data['missing_ranks']}" if data["missing_ranks"] else "")
            + (f", master {data['master']}" if data["master"] else "")
        )
        lines.append(f"  {'node':<16} {'node_rank':>9}  {'state':<9} {'ranks':<9} exits")
        for n in data["node_table"]:
            lines.append(
                f"  {n['node_id']:<16} {n['node_rank']:>9}  {n['state']:<9} {n['ranks']:<9} "
                + ("; ".join(n["exits"][-4:]) or "-")
            )
    return "\n".join(lines)


def render_list(jobs: list[dict[str, Any]]) -> str:
    if not jobs:
        return "no jobs"
    width = max([3] + [len(j["job_id"]) for j in jobs]) + 2
    owners = min(max([5] + [len(j["owner"] or "-") for j in jobs]), 32) + 2
    lines = [f"{'JOB':<{width}}{'STATE':<11}{'WORLD':>5}  {'OWNER':<{owners}}{'NODES':<24}REASON"]
    for j in jobs:
        nodes = ",".join(j["nodes"]) or "-"
        owner = (j["owner"] or "-")[:owners - 2]
        lines.append(f"{j['job_id']:<{width}}{j['state']:<11}{j['world_size']:>5}  {owner:<{owners}}"
                     f"{nodes[:23]:<24}{j['reason'][:80]}")
    return "\n".join(lines)


# ---- commands --------------------------------------------------------------------------------


def _connection(args) -> tuple[str, object, Optional[str]]:
    from meshgate.cli import DEFAULT_COORDINATOR, StatusError, _status_connection

    coordinator = args.coordinator or os.environ.get("MESHGATE_COORDINATOR") or DEFAULT_COORDINATOR
    try:
        tls, token = _status_connection(args)
    except StatusError as exc:
        raise JobCliError(str(exc)) from None
    return coordinator, (tls if tls is not None else False), token or None


def _run(args, body: Callable[[str, dict[str, Any]], int]) -> int:
    from meshgate.client import RendezvousRefused

    try:
        coordinator, tls, token = _connection(args)
        return body(coordinator, {"tls": tls, "admin_token": token, "timeout": args.timeout})
    except (JobCliError, RendezvousRefused) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def _cmd_submit(args) -> int:
    from meshgate import admin

    def body(coordinator, conn):
        info = admin.submit_job(coordinator, spec_from_args(args), wait_for_nodes=args.wait_for_nodes, **conn)
        data = job_dict(info)
        if args.json:
            print(json.dumps(data))
        else:
            where = f" on {', '.join(data['nodes'])}" if data["nodes"] else ""
            print(f"job {data['job_id']} submitted: {data['state']}{where} ({data['plan']})")
            if data["state"] == "PENDING":
                print(f"  waiting: {data['reason']}")
        return _follow(coordinator, conn, data["job_id"], args.json) if args.wait else 0

    return _run(args, body)


def _cmd_list(args) -> int:
    from meshgate import admin

    def body(coordinator, conn):
        found = admin.all_jobs(coordinator, state=args.state or "", owner=args.owner, page_size=args.page_size, **conn)
        jobs = [job_dict(j) for j in found]
        print(json.dumps(jobs, indent=2) if args.json else render_list(jobs))
        return 0

    return _run(args, body)


def _cmd_show(args) -> int:
    from meshgate import admin

    def body(coordinator, conn):
        data = job_dict(admin.get_job(coordinator, args.job_id, **conn))
        print(json.dumps(data, indent=2) if args.json else render_job(data))
        return 0

    return _run(args, body)


def _cmd_cancel(args) -> int:
    from meshgate import admin

    def body(coordinator, conn):
        data = job_dict(admin.cancel_job(coordinator, args.job_id, args.reason, **conn))
        print(json.dumps(data) if args.json else f"job {data['job_id']}: {data['state']} ({data['reason']})")
        return 0

    return _run(args, body)


def _progress(data: dict[str, Any]) -> str:
    line = f"{data['job_id']}: {data['state']}"
    if "generation" in data:
        line += f", generation {data['generation']}, {data['registered']}/{data['world_size']} ranks"
    if data["reason"]:
        line += f" ({data['reason']})"
    return line


def _follow(coordinator: str, conn: dict[str, Any], job_id: str, as_json: bool, interval_s: float = 0.5) -> int:
    """Print each change of the job until it ends; the exit code is its outcome."""
    from meshgate import admin

    last = None
    while True:
        data = job_dict(admin.get_job(coordinator, job_id, **conn))
        shown = _progress(data)
        if shown != last:
            print(json.dumps(data) if as_json else shown, flush=True)
        last = shown
        if data["state"] in ENDED:
            return OUTCOME_EXIT[data["state"]]
        time.sleep(interval_s)


def _cmd_watch(args) -> int:
    return _run(args, lambda coordinator, conn: _follow(coordinator, conn, args.job_id, args.json,
                                                          interval_s=args.interval))


def _cmd_wait(args) -> int:
    from meshgate import admin

    def body(coordinator, conn):
        deadline = time.monotonic() + args.wait_timeout if args.wait_timeout else None
        while True:
            data = job_dict(admin.get_job(coordinator, args.job_id, **conn))
            if data["state"] in ENDED:
                print(_progress(data))
                return OUTCOME_EXIT[data["state"]]
            if deadline is not None and time.monotonic() > deadline:
                raise JobCliError(f"job {args.job_id} still {data['state']} after {args.wait_timeout:g}s")
            time.sleep(args.interval)

    return _run(args, body)


def add_parser(sub, add_connection: Callable) -> None:
    job = sub.add_parser("job", help="submit, list, show, watch, wait for and cancel jobs (admin)")
    job_sub = job.add_subparsers(dest="job_command", required=True)

    def connected(parser):
        parser.add_argument("--coordinator", help="HOST:PORT (default: $MESHGATE_COORDINATOR)")
        parser.add_argument("--json", action="store_true", help="machine-readable output")
        add_connection(parser)
        return parser

    submit = connected(job_sub.add_parser(
        "submit", help="submit a job: meshgate job submit --plan PLAN --nodes N -- COMMAND ARGS..."))
    submit.add_argument("--plan", help="plan TOML file or example name")
    submit.add_argument("--file", help="a job TOML ([job] and [plan]); flags override it")
    submit.add_argument("--id", default="", help="the job id (default: chosen by the coordinator; unique forever)")
    count = submit.add_mutually_exclusive_group()
    count.add_argument("--nodes", type=int, default=0, help="how many whole nodes")
    count.add_argument("--node", action="append", default=[], metavar="NAME",
                       help="pin a node, in node-rank order (repeat)")
    submit.add_argument("--slots-per-node", type=int, default=0, help="workers per node (default: world / nodes)")
    submit.add_argument("--mode", choices=("assigned", "claimed"))
    submit.add_argument("--topology-policy", choices=("warn", "refuse", "allow"))
    submit.add_argument("--spares", type=int, help="idle nodes kept to take over a lost node's ranks")
    submit.add_argument("--restart-policy", choices=("never", "on-failure"))
    submit.add_argument("--max-restarts", type=int, help="whole-job restarts on a worker failure")
    submit.add_argument("--env", action="append", metavar="NAME=VALUE", help="worker environment (repeat)")
    submit.add_argument("--wait", action="store_true", help="then follow it until it ends (exit code = outcome)")
    submit.add_argument("--wait-for-nodes", action="store_true",
                        help="accept it PENDING even if no set of the nodes joined so far could hold it "
                             "(refused otherwise, naming what is missing)")
    submit.add_argument("command", nargs="*", metavar="-- COMMAND", help="what every worker runs")
    submit.set_defaults(func=_cmd_submit)

    listing = connected(job_sub.add_parser("list", help="every job, oldest first, with its owner (page after page)"))
    listing.add_argument("--state", choices=("PENDING", "RUNNING", "SUCCEEDED", "FAILED", "CANCELLED"),
                         help="only jobs in this state")
    listing.add_argument("--owner", default="", help="only jobs of this owner, e.g. submitter:alice")
    listing.add_argument("--page-size", type=int, default=0, help="jobs per call (default 100, at most 1000)")
    listing.set_defaults(func=_cmd_list)
    for name, func, text in (
        ("show", _cmd_show, "plan, nodes, ranks, generation and per-worker exits of a job"),
        ("watch", _cmd_watch, "print the job's progress until it ends (exit code = outcome)"),
        ("wait", _cmd_wait, "wait until the job ends; exit 0 SUCCEEDED, 1 FAILED, 3 CANCELLED"),
        ("cancel", _cmd_cancel, "cancel a job: its agents stop its workers"),
    ):
        parser = connected(job_sub.add_parser(name, help=text))
        parser.add_argument("job_id", metavar="ID", help="the job's id (after '--' if it starts with '-')")
        parser.set_defaults(func=func)
        if name in ("watch", "wait"):
            parser.add_argument("--interval", type=float, default=0.5, help="poll period in seconds")
        if name == "wait":
            parser.add_argument("--wait-timeout", type=float, default=0.0, help="give up after this many seconds (0: never)")
        if name == "cancel":
            parser.add_argument("--reason", default="", help="recorded with the job")


__all__ = ["add_parser", "job_dict", "load_job_file", "render_job", "render_list", "spec_from_args"]
