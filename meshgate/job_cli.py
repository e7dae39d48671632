"""``meshgate job``: submit, list, show, watch, wait for and cancel jobs on a coordinator
in jobs mode (one whose config names no [job]). Admin calls: the connection flags, variables
and client config are those of every command (meshgate/connection.py); the views are those
of ``meshgate status`` (meshgate/views.py).

Exit codes of ``job wait`` and ``job watch``: 0 SUCCEEDED, 1 FAILED, 3 CANCELLED, 2 an
error (unknown job, coordinator unreachable).
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any, Callable, Mapping

from meshgate.connection import Connection
from meshgate.slurm import NODELIST_ENV, HostlistError, expand_hostlist, nodes_from_env
from meshgate.v1 import rendezvous_pb2 as pb
from meshgate.views import (
    ENDED,
    OUTCOME_EXIT,
    enum_prefix,
    file_spelling,
    job_dict,
    progress,
    render_job,
    render_list,
    render_timeline,
    timeline_dict,
)


class JobCliError(RuntimeError):
    pass


# ---- the job file and the flags ----------------------------------------------------------

# The job file spells the proto's JobSpec: its [job] keys are the proto's field names
# ("id" for job_id), its enum values the proto's less their prefix, lower case, "-" for
# "_" ("claimed", "on-failure"), and its [plan] a plan file's table. A new proto field is
# a new key with no edit here.
FILE_KEYS = {"job_id": "id"}
PROTO_NAMES = {key: name for name, key in FILE_KEYS.items()}
JOB_KEYS = {FILE_KEYS.get(f.name, f.name) for f in pb.JobSpec.DESCRIPTOR.fields} - {"plan"}
# The `job submit` flags whose dest is not the key they set (--node sets node_ids).
FLAG_DESTS = {"node_ids": "node"}


def _wire_value(field, key: str, value: Any, where: str) -> Any:
    """A job file's value as the proto's JSON spells it: enum names in full."""
    if field.enum_type is None or not isinstance(value, str):
        return value
    name = enum_prefix(field.enum_type) + value.upper().replace("-", "_")
    if name not in field.enum_type.values_by_name or name.endswith("_UNSPECIFIED"):
        known = [file_spelling(field.name, v.number) for v in field.enum_type.values if v.number]
        raise JobCliError(f"{where} {key}: {value!r} is not one of {', '.join(known)}")
    return name


def spec_message(values: Mapping[str, Any], source: str = "") -> pb.JobSpec:
    """A job file's [job] table (its [plan] under "plan": a table or a ParallelPlan) as the
    proto, key by key by name; JobCliError naming the file (``source``) and its key
    otherwise. A plan is checked as a plan file is, and sent whole."""
    from google.protobuf import json_format

    from meshgate.plan import ParallelPlan, PlanError

    message, fields, where = pb.JobSpec(), pb.JobSpec.DESCRIPTOR.fields_by_name, f"{source}[job]"
    for key, value in values.items():
        if key == "plan":
            try:
                plan = value if isinstance(value, ParallelPlan) else ParallelPlan.from_mapping(value)
            except PlanError as exc:
                raise JobCliError(f"{source}[plan] {exc}") from None
            message.plan.CopyFrom(plan.to_proto())
            continue
        if key not in JOB_KEYS:
            raise JobCliError(f"{where} unknown key {key!r}; known: {sorted(JOB_KEYS)}")
        name = PROTO_NAMES.get(key, key)
        try:
            json_format.ParseDict({name: _wire_value(fields[name], key, value, where)}, message)
        except json_format.ParseError as exc:
            raise JobCliError(f"{where} {key}: {value!r} does not fit the field ({str(exc)[:200]})") from None
    return message


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


def time_limit(text: str, flag: str = "--time-limit") -> int:
    """``--time-limit``: a duration spelled as every duration is (meshgate/durations.py:
    "2h", "90m", "1d", "600"), in whole seconds."""
    import argparse

    from meshgate.durations import DurationError, parse_duration

    try:
        seconds = parse_duration(text, flag)
    except DurationError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if seconds < 1:
        raise argparse.ArgumentTypeError(f"{flag} {text!r} is under a second")
    return round(seconds)


def launch_deadline(text: str) -> int:
    """``--launch-deadline``: a duration, as ``--time-limit`` reads one."""
    return time_limit(text, "--launch-deadline")


def named_nodes(args) -> list[str]:
    """The nodes ``--node-list`` or ``--nodes-from-slurm`` name, in their order ([] if neither).
    A job naming its nodes runs on exactly those, when they are idle and not reserved for
    an earlier job (it waits meanwhile), or is refused if one never could serve it."""
    try:
        if args.nodes_from_slurm:
            return nodes_from_env(os.environ)
        return expand_hostlist(args.node_list) if args.node_list else []
    except HostlistError as exc:
        raise JobCliError(f"--node-list: {exc}" if args.node_list else str(exc)) from None


def spec_from_args(args) -> pb.JobSpec:
    """The JobSpec of ``job submit``: the job file's values, each flag given overriding it."""
    from meshgate.data import DataError, load_plan
    from meshgate.plan import PlanError

    values = load_job_file(args.file) if args.file else {}
    if args.plan:
        try:
            values["plan"] = load_plan(args.plan)
        except (PlanError, DataError) as exc:
            raise JobCliError(str(exc)) from None
    elif "plan" not in values:
        raise JobCliError("--plan PLAN (a file or an example name) is required, or a job file with [plan]")
    command = list(args.command[1:] if args.command[:1] == ["--"] else args.command)
    if command:
        values["command"] = command
    if args.env:
        if not isinstance(values.get("env", {}), Mapping):
            raise JobCliError(f'{args.file}: [job] env: must be a table of NAME = "value"')
        values["env"] = dict(values.get("env", {}))
        for item in args.env:
            key, sep, value = item.partition("=")
            if not sep or not key:
                raise JobCliError(f"--env {item!r}: expected NAME=value")
            values["env"][key] = value
    for key in JOB_KEYS - {"command", "env"}:
        flag = getattr(args, FLAG_DESTS.get(key, key), None)
        if flag not in (None, "", []):
            values[key] = flag
    named = named_nodes(args)
    if named:
        values["node_ids"] = named
    return spec_message(values, f"{args.file}: " if args.file else "")


# ---- commands --------------------------------------------------------------------------------


def _run(args, body: Callable[[Connection, dict[str, Any]], int]) -> int:
    """``body(connection, call_options)`` with the connection the flags give; errors as one line, exit 2."""
    from meshgate.connection import ClientConfigError, RendezvousRefused, from_arguments, refusal_line

    connection = None
    try:
        connection = from_arguments(args)
        return body(connection, {"timeout": args.timeout})
    except RendezvousRefused as refusal:
        print(f"error: {refusal_line(refusal, connection)}", file=sys.stderr)
    except (JobCliError, ClientConfigError) as exc:
        print(f"error: {exc}", file=sys.stderr)
    return 2


def _cmd_submit(args) -> int:
    from meshgate import admin

    def body(coordinator, conn):
        info = admin.submit_job(coordinator, spec_from_args(args), wait_for_nodes=args.wait_for_nodes, **conn)
        data = job_dict(info, coordinator.current)
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
        jobs = [job_dict(j, coordinator.current) for j in found]
        print(json.dumps(jobs, indent=2) if args.json else render_list(jobs))
        return 0

    return _run(args, body)


def _cmd_show(args) -> int:
    from meshgate import admin

    def body(coordinator, conn):
        if args.timeline:
            data = timeline_dict(admin.get_job_timeline(coordinator, args.job_id, **conn))
            print(json.dumps(data, indent=2) if args.json else render_timeline(data))
            return 0
        data = job_dict(admin.get_job(coordinator, args.job_id, **conn), coordinator.current)
        print(json.dumps(data, indent=2) if args.json else render_job(data))
        return 0

    return _run(args, body)


def _cmd_cancel(args) -> int:
    from meshgate import admin

    def body(coordinator, conn):
        conn = {**conn, "timeout": max(conn["timeout"], 60.0)}  # answered once its nodes showed its processes gone
        data = job_dict(admin.cancel_job(coordinator, args.job_id, args.reason, **conn), coordinator.current)
        print(json.dumps(data) if args.json else f"job {data['job_id']}: {data['state']} ({data['reason']})")
        return 0

    return _run(args, body)


def _cmd_logs(args) -> int:
    from meshgate import admin
    from meshgate.views import LogLines, log_chunk_dict

    for flag, value in (("--rank", args.rank), ("--tail", args.tail)):
        if value is not None and value < 0:
            print(f"error: {flag} must be 0 or more, got {value}", file=sys.stderr)
            return 2

    def body(coordinator, conn):
        chunks = admin.job_logs(
            coordinator,
            args.job_id,
            rank=args.rank,
            node_id=args.node or "",
            follow=args.follow,
            tail_lines=args.tail or 0,
            timeout=None if args.follow else max(conn["timeout"], 60.0),  # nodes answer on their next heartbeat
        )
        out, lines = sys.stdout.buffer, LogLines(prefix=args.rank is None)
        missing = False  # a notice: a node's output (or the rest of it) did not come
        try:
            for chunk in chunks:
                missing = missing or bool(chunk.notice)
                if args.json:
                    out.write(json.dumps(log_chunk_dict(chunk)).encode() + b"\n")
                elif chunk.notice:
                    out.flush()
                    print(f"meshgate: {chunk.notice}", file=sys.stderr, flush=True)
                else:
                    out.write(lines.feed(chunk.rank, chunk.data))
                out.flush()
            out.write(lines.flush())
            out.flush()
        except BrokenPipeError:  # `| head` has what it wanted: no complaint at exit either
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return 0
        except KeyboardInterrupt:  # a follow ends with Ctrl-C
            return 130
        return 1 if missing else 0

    return _run(args, body)


def _follow(
    coordinator: Connection,
    conn: dict[str, Any],
    job_id: str,
    as_json: bool,
    interval_s: float = 0.5,
    for_s: float | None = None,
    changes: bool = True,
) -> int:
    """Poll the job until it ends (or ``for_s`` runs out: an error); print each change of it
    (``changes``) or only its end. The exit code is its outcome."""
    from meshgate import admin
    from meshgate.connection import poll

    last = None
    for info in poll(lambda: admin.get_job(coordinator, job_id, **conn), every_s=interval_s, for_s=for_s):
        data = job_dict(info, coordinator.current)
        shown = progress(data)
        if data["state"] in ENDED or (changes and shown != last):
            print(json.dumps(data) if as_json else shown, flush=True)
        last = shown
        if data["state"] in ENDED:
            return OUTCOME_EXIT[data["state"]]
    raise JobCliError(f"job {job_id} still {data['state']} after {for_s:g}s")


def _cmd_watch(args) -> int:
    return _run(
        args, lambda coordinator, conn: _follow(coordinator, conn, args.job_id, args.json, interval_s=args.interval)
    )


def _cmd_wait(args) -> int:
    return _run(
        args,
        lambda coordinator, conn: _follow(
            coordinator,
            conn,
            args.job_id,
            args.json,
            interval_s=args.interval,
            for_s=args.wait_timeout or None,
            changes=False,
        ),
    )


def add_parser(sub) -> None:
    from meshgate.connection import add_arguments

    job = sub.add_parser("job", help="submit, list, show, watch, wait for, read the output of and cancel jobs (admin)")
    job_sub = job.add_subparsers(dest="job_command", required=True)

    def connected(parser):
        parser.add_argument("--json", action="store_true", help="machine-readable output")
        add_arguments(parser)
        return parser

    submit = connected(
        job_sub.add_parser(
            "submit",
            help="submit a job: meshgate job submit --plan PLAN --nodes N -- COMMAND ARGS...",
            description="Jobs start oldest first on whole idle nodes (backfill). The oldest job that "
            "does not fit has the nodes it will start on reserved for it; a later job starts ahead of it "
            "only on other idle nodes, or on reserved ones if its --time-limit ends before they are needed. "
            "A job naming its nodes (--node-list) follows the same rules: it waits for them if they are "
            "busy or reserved. `meshgate job show` says what a waiting job waits for.",
        )
    )
    submit.add_argument("--plan", help="plan TOML file or example name")
    submit.add_argument("--file", help="a job TOML ([job] and [plan]); flags override it")
    submit.add_argument("--id", default="", help="the job id (default: chosen by the coordinator; unique forever)")
    count = submit.add_mutually_exclusive_group()
    count.add_argument("--nodes", type=int, help="how many whole nodes")
    count.add_argument(
        "--node", action="append", default=[], metavar="NAME", help="name a node, in node-rank order (repeat)"
    )
    count.add_argument(
        "--node-list",
        metavar="LIST",
        help="name the nodes, in node-rank order: n3,n1,n2 or a Slurm hostlist like node[01-03,07]",
    )
    count.add_argument(
        "--nodes-from-slurm",
        action="store_true",
        help=f"name the nodes of the Slurm allocation this runs in (${NODELIST_ENV}), in Slurm's order",
    )
    submit.add_argument("--slots-per-node", type=int, help="workers per node (default: world / nodes)")
    submit.add_argument("--mode", choices=("assigned", "claimed"))
    submit.add_argument(
        "--launch",
        choices=("per-slot", "per-node"),
        help="per-slot (default): the agent starts the command once per slot, each a worker; per-node: once per "
        "node, a launcher (torchrun --rdzv-backend=meshgate, ft_launcher) that starts the node's workers itself, "
        "with NODE_RANK, GROUP_RANK, NNODES, NPROC_PER_NODE, MASTER_ADDR, MASTER_PORT (mode: claimed)",
    )
    submit.add_argument("--topology-policy", choices=("warn", "refuse", "allow"))
    submit.add_argument("--spares", type=int, help="idle nodes kept to take over a lost node's ranks")
    submit.add_argument("--restart-policy", choices=("never", "on-failure"))
    submit.add_argument("--max-restarts", type=int, help="whole-job restarts on a worker failure")
    submit.add_argument(
        "--time-limit",
        dest="time_limit_s",
        type=time_limit,
        metavar="DURATION",
        help="end it (FAILED, 'time limit ... reached') once it has run this long, e.g. 2h, 90m, 600s; "
        "a job with a limit may start ahead of a waiting one on nodes reserved for it when it ends "
        "before they are needed (default: none)",
    )
    submit.add_argument(
        "--launch-deadline",
        dest="launch_deadline_s",
        type=launch_deadline,
        metavar="DURATION",
        help="a job without a command: end it FAILED, naming the nodes, unless the launchers you start "
        "(torchrun, Ray, sbatch) register every worker this long after its nodes are given (default: 10m)",
    )
    submit.add_argument("--env", action="append", metavar="NAME=VALUE", help="worker environment (repeat)")
    submit.add_argument("--wait", action="store_true", help="then follow it until it ends (exit code = outcome)")
    submit.add_argument(
        "--wait-for-nodes",
        action="store_true",
        help="accept it PENDING even if no set of the nodes joined so far could hold it "
        "(refused otherwise, naming what is missing)",
    )
    submit.add_argument("command", nargs="*", metavar="-- COMMAND", help="what every worker runs")
    submit.set_defaults(func=_cmd_submit)

    listing = connected(job_sub.add_parser("list", help="every job, oldest first, with its owner (page after page)"))
    listing.add_argument(
        "--state", choices=("PENDING", "RUNNING", "SUCCEEDED", "FAILED", "CANCELLED"), help="only jobs in this state"
    )
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
            parser.add_argument(
                "--wait-timeout", type=float, default=0.0, help="give up after this many seconds (0: never)"
            )
        if name == "cancel":
            parser.add_argument("--reason", default="", help="recorded with the job")
        if name == "show":
            parser.add_argument(
                "--timeline",
                action="store_true",
                help="what happened to it, in order, with times: submitted, allocated, nodes joined, "
                "ranks registered, world formed, generations, exits, end",
            )
    logs = connected(
        job_sub.add_parser(
            "logs", help="the output (stdout and stderr) of a job's workers, kept by their agents (owner or admin)"
        )
    )
    logs.add_argument("job_id", metavar="ID", help="the job's id (after '--' if it starts with '-')")
    which = logs.add_mutually_exclusive_group()
    which.add_argument("--rank", type=int, help="only this rank's output (default: every rank, lines led by rank)")
    which.add_argument("--node", help="only the ranks of this node")
    logs.add_argument("--follow", "-f", action="store_true", help="then new output as it comes, until the job ends")
    logs.add_argument("--tail", type=int, help="only the last N lines of each rank")
    logs.set_defaults(func=_cmd_logs)


__all__ = [
    "add_parser",
    "file_spelling",
    "job_dict",
    "load_job_file",
    "render_job",
    "render_list",
    "spec_from_args",
    "spec_message",
]
