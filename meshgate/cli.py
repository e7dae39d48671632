"""meshgate: the operator, admin and demo command line.

Each command has its own --help. Parts that need an optional extra say which one, and
the pip install line for the packages it brings, when it is missing.
"""

from __future__ import annotations

from meshgate.words import counted

import argparse
import sys
from typing import Sequence

from meshgate import data
from meshgate.data import load_plan
from meshgate.extras import MissingExtra
from meshgate.plan import GROUP_AXES, ParallelPlan, PlanError

# The status view lives with the job views (meshgate/views.py), so `status` and `job show` agree.
from meshgate.views import _iso, render_status, status_dict

_MAX_GROUPS_SHOWN = 8
_LIST_ALL_GROUPS_UP_TO = 4096  # ranks; above, show rank 0's group and the count
_COUNT_STRADDLES_UP_TO = 1 << 16
_INTRA_NODE_AXES = ("tp", "cp", "etp")


def _fmt_group(group: Sequence[int]) -> str:
    """{0,1,2,3} -> {0-3}; {0,8,16,...,56} stays short for any size."""
    g = list(group)
    if len(g) <= 4:
        return "{" + ",".join(map(str, g)) + "}"
    step = g[1] - g[0]
    if all(b - a == step for a, b in zip(g, g[1:])):
        if step == 1:
            return f"{{{g[0]}-{g[-1]}}}"
        return f"{{{g[0]},{g[1]},...,{g[-1]}}}"
    return "{" + ",".join(map(str, g[:3])) + f",...,{g[-1]}}} ({len(g)} ranks)"


def _short(groups: list[tuple[int, ...]]) -> str:
    shown = " ".join(_fmt_group(g) for g in groups[:_MAX_GROUPS_SHOWN])
    more = f" ... ({len(groups)} groups)" if len(groups) > _MAX_GROUPS_SHOWN else ""
    return shown + more


def _straddle_note(plan: ParallelPlan, axis: str, groups, slots_per_node: int) -> str:
    def nodes(group) -> int:
        return len({r // slots_per_node for r in group})

    if groups is None:
        if plan.world_size > _COUNT_STRADDLES_UP_TO:
            spread = nodes(plan.group(axis, 0))
            return f"rank 0's group spans {spread} nodes" if spread > 1 else "rank 0's group within a node"
        groups = plan.groups(axis)
    straddling = [g for g in groups if nodes(g) > 1]
    if not straddling:
        return "within nodes"
    worst = max(nodes(g) for g in straddling)
    # TP, CP and expert-TP traffic wants NVLink: crossing nodes there is worth shouting about.
    label = "STRADDLES NODES" if axis in _INTRA_NODE_AXES else "spans nodes"
    return f"{label}: {len(straddling)} of {len(groups)} groups (up to {worst} nodes)"


def plan_show(plan: ParallelPlan, slots_per_node: int | None) -> str:
    world = plan.world_size
    lines = [
        f"world_size {world}; order (innermost first) {'-'.join(plan.order)}",
        "DeviceMesh dims (outermost first): " + ", ".join(f"{a}={plan.size(a)}" for a in reversed(plan.order)),
        f"digest {plan.digest().hex()}",
    ]
    if plan.ep > 1 or plan.etp > 1:
        lines.append(f"experts: ep={plan.ep} etp={plan.etp} edp={plan.edp}")
    if plan.microbatches > 1 or plan.gradient_accumulation_steps > 1:
        lines.append(
            f"microbatches {plan.microbatches}; gradient_accumulation_steps {plan.gradient_accumulation_steps}"
        )
    if slots_per_node:
        lines.append(f"nodes {world // slots_per_node} x {counted(slots_per_node, 'slot')}")
    lines += ["", f"{'mesh axis':<13}{'size':>6}{'stride':>8}   (innermost first)"]
    stride = 1
    for axis in plan.order:
        lines.append(f"{axis:<13}{plan.size(axis):>6}{stride:>8}")
        stride *= plan.size(axis)
    lines += ["", f"{'group':<13}{'size':>6}  groups"]
    for axis in GROUP_AXES:
        size = plan.size(axis)
        if size == 1 and axis != "dp":
            continue
        groups = None
        if world > _LIST_ALL_GROUPS_UP_TO:
            line = f"{axis:<13}{size:>6}  rank 0's {_fmt_group(plan.group(axis, 0))} ... ({world // size} groups)"
        else:
            groups = plan.groups(axis)
            line = f"{axis:<13}{size:>6}  {_short(groups)}"
        if slots_per_node:
            line += f"  [{_straddle_note(plan, axis, groups, slots_per_node)}]"
        lines.append(line)
    return "\n".join(lines)


def _cmd_plan(args) -> int:
    if args.plan_command == "list":
        for name, entry in data.example_plans().items():
            plan = ParallelPlan.from_toml_text(entry.read_text())
            print(f"{name:<20} {plan.describe()}")
        return 0
    try:
        plan = load_plan(args.file)
    except (PlanError, data.DataError, OSError) as exc:
        print(f"invalid plan: {exc}", file=sys.stderr)
        return 1
    if args.plan_command == "check":
        print(f"ok: {plan.describe()}")
        return 0
    if args.slots_per_node is not None and (args.slots_per_node < 1 or plan.world_size % args.slots_per_node):
        print(
            f"--slots-per-node {args.slots_per_node} must divide world_size {plan.world_size}",
            file=sys.stderr,
        )
        return 1
    print(plan_show(plan, args.slots_per_node))
    return 0


def _signed_attestation(data: bytes):
    """A SignedAttestation from its bytes, or from their base64 (as a worker prints it, e.g.
    the demo worker's line in `meshgate job logs`)."""
    import base64
    import binascii

    from meshgate.v1 import attestation_pb2

    text = data.strip()
    if text and all(c in b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/=" for c in text):
        try:
            data = base64.b64decode(text, validate=True)
        except binascii.Error:
            pass  # not base64 after all: the bytes themselves
    return attestation_pb2.SignedAttestation.FromString(data)


def _cmd_verify(args) -> int:
    from meshgate.attestation import AttestationError, TrustBundle, verify_attestation

    try:
        bundle = TrustBundle.load(args.trust_bundle)
        with open(args.attestation, "rb") as handle:
            signed = _signed_attestation(handle.read())
        verified = verify_attestation(signed, bundle, job_id=args.job, nonce=None, generation=args.generation)
    except AttestationError as exc:
        print(f"REFUSED ({exc.reason}): {exc}", file=sys.stderr)
        return 1
    except Exception as exc:  # noqa: BLE001 - a debugging tool reports anything
        print(f"error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    print(f"verified: {verified.describe()}")
    for axis in verified.plan.order:
        print(f"  {axis:<13} {verified.coordinate[axis]} of {verified.plan.size(axis)}")
    hardware = verified.hardware
    if hardware is not None:  # signed with the rest: what the node's agent read of it
        gpu = f"GPU {hardware.gpu_uuid} (PCI {hardware.gpu_pci_bus_id})" if hardware.gpu_uuid else "no GPU"
        print(
            f"  {'hardware':<13} {gpu}; machine-id {hardware.machine_id or 'unknown'}; "
            f"NVLink {hardware.nvlink_domain or 'unknown'}; rails {', '.join(hardware.rail_nics) or 'none'}"
        )
    return 0


# ---- status ---------------------------------------------------------------------------


class StatusError(RuntimeError):
    pass


class NoJobToWatch(RuntimeError):
    """A usage error found once the coordinator answered: never retried under --watch."""


def fetch_status(connection, job: str, timeout: float):
    """Admin.GetStatus, failing over across the connection's coordinators."""
    from meshgate import admin

    return admin.get_status(connection, job, timeout=timeout)


def fetch_cluster(connection, timeout: float):
    """Admin.GetCluster; None from a coordinator older than it (its GetStatus("") answers)."""
    import grpc

    from meshgate import admin
    from meshgate.connection import RendezvousRefused

    try:
        return admin.get_cluster(connection, timeout=timeout)
    except RendezvousRefused as refusal:
        if refusal.code is grpc.StatusCode.UNIMPLEMENTED:
            return None
        raise


def _status_once(args, connection) -> tuple[str, dict]:
    """What ``meshgate status`` shows now: ("job", a Status as plain data) with --job, or
    when the config declares one job (that job, as a single-job coordinator always showed);
    otherwise ("cluster", the cluster: jobs and nodes by state, the queue)."""
    import time

    from meshgate.connection import RendezvousRefused, refusal_line
    from meshgate.views import cluster_dict

    job = args.job
    try:
        if not job:
            cluster = fetch_cluster(connection, args.timeout)
            if cluster is not None and not cluster.declared_job_id:
                if args.until_complete:  # a cluster is never complete: the watch would never end
                    raise NoJobToWatch("--until-complete waits for one job's world: name it with --job")
                return "cluster", cluster_dict(cluster, connection.current, time.time())
            job = cluster.declared_job_id if cluster is not None else ""
        status = fetch_status(connection, job, args.timeout)
    except RendezvousRefused as refusal:
        raise StatusError(refusal_line(refusal, connection)) from None
    if args.job and status.job_id != args.job:
        raise StatusError(f"coordinator {connection.current} serves job {status.job_id!r}, not {args.job!r}")
    return "job", status_dict(status, connection.current, time.time())


def token_ttl(text: str) -> int:
    """--ttl as whole seconds, spelled as every duration is (meshgate/durations.py)."""
    from meshgate.durations import DurationError, parse_duration

    try:
        seconds = parse_duration(text, "--ttl")
    except DurationError as exc:
        raise StatusError(str(exc)) from None
    if seconds < 1:  # the request's ttl_s counts whole seconds, and 0 would mean the default
        raise StatusError(f"--ttl {text!r} is under a second")
    return round(seconds)


def _admin_call(args, call):
    """``call(connection, job)`` with the connection the flags give; errors as one line, exit 2."""
    import os

    from meshgate.connection import ClientConfigError, RendezvousRefused, from_arguments, refusal_line

    connection = None
    try:
        connection = from_arguments(args)
        # A jobs-mode coordinator's tokens and keys are the cluster's: no job to name.
        return call(connection, args.job or os.environ.get("MESHGATE_JOB") or "")
    except RendezvousRefused as refusal:
        print(f"error: {refusal_line(refusal, connection)}", file=sys.stderr)
    except (StatusError, ClientConfigError) as exc:
        print(f"error: {exc}", file=sys.stderr)
    return None


def _cmd_token(args) -> int:
    import datetime
    from pathlib import Path

    from meshgate.admin import create_join_token
    from meshgate.init_cli import JOIN_TOKEN_FILE, SECRET_MODE, write_atomic

    try:
        ttl_s = token_ttl(args.ttl)  # before any call: a bad flag costs no connection
    except StatusError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    node_ids = args.node_id or [""]
    if args.node_dirs:
        if not args.node_id:
            print("error: --node-dirs names each token's folder by its --node-id: give --node-id", file=sys.stderr)
            return 2
        targets = [Path(args.node_dirs) / node / JOIN_TOKEN_FILE for node in node_ids]
        missing = [str(t.parent) for t in targets if not t.parent.is_dir()]
        if missing:
            print(
                f"error: --node-dirs: missing {', '.join(missing)} "
                "(`meshgate init agent --node-id ID ...` writes them)",
                file=sys.stderr,
            )
            return 2
    elif args.out:
        targets = [Path(args.out)]
    else:
        targets = [None]
    if len(targets) < len(node_ids):
        print("error: several --node-id need --node-dirs DIR (each token to DIR/ID/join-token)", file=sys.stderr)
        return 2
    for node, target in zip(node_ids, targets):
        issued = _admin_call(
            args,
            lambda connection, job: create_join_token(
                connection,
                job,
                ttl_s=ttl_s,
                node_id=node,
                any_node=args.any_node,
                timeout=args.timeout,
            ),
        )
        if issued is None:
            return 2
        expires = datetime.datetime.fromtimestamp(issued.expires_at, datetime.timezone.utc)
        scope = f" for node {issued.node_id}" if issued.node_id else ""
        if target is None:
            print(issued.token)
        else:
            try:
                write_atomic(target, issued.token + "\n", SECRET_MODE)
            except OSError as exc:
                print(
                    f"error: {target}: {exc.strerror} (the token is not shown again: mint a new one)", file=sys.stderr
                )
                return 1
            print(f"wrote {target} (mode 600)")
        print(f"single-use{scope}, expires {expires.isoformat(timespec='seconds')}", file=sys.stderr)
    return 0


def _cmd_keys(args) -> int:
    from meshgate.admin import rotate_key
    from meshgate.v1 import attestation_pb2

    signed = _admin_call(args, lambda connection, job: rotate_key(connection, job, timeout=args.timeout))
    if signed is None:
        return 2
    bundle = attestation_pb2.TrustBundle.FromString(signed.payload)
    print(f"trust bundle v{bundle.version}, endorsed by {', '.join(e.key_id for e in signed.endorsements)}")
    for key in bundle.keys:
        until = key.not_after.ToJsonString() if key.HasField("not_after") else "(signing)"
        print(f"  {key.key_id}  trusted until {until}")
    return 0


def _cmd_status(args) -> int:
    import json
    import os
    import time

    from meshgate.connection import ClientConfigError, from_arguments
    from meshgate.views import render_cluster

    args.job = args.job or os.environ.get("MESHGATE_JOB") or ""
    try:
        connection = from_arguments(args)
    except ClientConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not args.watch:
        try:
            view, data = _status_once(args, connection)
        except (StatusError, NoJobToWatch) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        if args.json:
            print(json.dumps(data, indent=2))
        else:
            print(render_status(data) if view == "job" else render_cluster(data))
        return 0

    def observe() -> tuple[dict | None, str]:
        try:
            view, data = _status_once(args, connection)
            if args.json:
                return data, json.dumps(data)
            return data, render_status(data, bar=True) if view == "job" else render_cluster(data)
        except StatusError as exc:
            if args.json:
                return None, json.dumps({"error": str(exc), "observed_at": _iso(time.time())})
            return None, f"waiting for the coordinator: {exc}"

    tty = sys.stdout.isatty() and not args.json
    try:
        return _show_frames(args, observe, tty)
    except NoJobToWatch as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def _show_frames(args, observe, tty: bool) -> int:
    from meshgate.connection import poll

    try:
        for data, frame in poll(observe, every_s=args.interval):
            if tty:
                sys.stdout.write("\x1b[H\x1b[2J" + frame + "\n")
            else:
                print(frame if args.json else frame + "\n")
            sys.stdout.flush()
            if args.until_complete and data is not None and data.get("complete"):
                return 0
            if args.until_complete and data is not None and data.get("failure"):
                return 1
    except KeyboardInterrupt:
        return 130
    return 0


def _cmd_nodes(args) -> int:
    """The cluster's nodes in node id order, at most --limit of them (0: all)."""
    import json
    import time

    from meshgate import admin
    from meshgate.views import pool_node_dict, render_nodes

    limit = args.limit if args.limit is not None else (0 if args.json else 100)
    if limit < 0:
        print(f"error: --limit {args.limit} must be 0 (all) or more", file=sys.stderr)
        return 2

    def call(connection, _job):
        nodes, token, total = [], "", 0
        while True:
            page = admin.list_nodes(connection, page_token=token, timeout=args.timeout)
            nodes += list(page.nodes)
            token, total = page.next_page_token, page.total
            if not token or (limit and len(nodes) >= limit):
                return connection, nodes[:limit] if limit else nodes, total

    answer = _admin_call(args, call)
    if answer is None:
        return 2
    connection, nodes, total = answer
    now = time.time()
    shown = [pool_node_dict(n, now) for n in nodes]
    if args.json:
        print(json.dumps({"coordinator": connection.current, "total": total, "nodes": shown}, indent=2))
    else:
        print(render_nodes(shown, total))
    return 0


def _cmd_node(args) -> int:
    """meshgate node cordon|drain|uncordon NODE --reason TEXT: an operator holds a node out
    of allocation (drain: and out of the job it serves), or returns it (its cordon and
    quarantine lifted)."""
    import json
    import time

    from meshgate import admin
    from meshgate.views import pool_node_dict, render_nodes

    uncordon, drain = args.node_command == "uncordon", args.node_command == "drain"
    if not uncordon and not (args.reason or "").strip():
        print(
            f"error: node {args.node_command} needs --reason TEXT (shown in meshgate nodes and status)", file=sys.stderr
        )
        return 2

    def call(connection, _job):
        reason = args.reason or ""
        return admin.cordon_node(connection, args.node_id, reason, uncordon=uncordon, drain=drain, timeout=args.timeout)

    node = _admin_call(args, call)
    if node is None:
        return 2
    shown = pool_node_dict(node, time.time())
    print(json.dumps(shown, indent=2) if args.json else render_nodes([shown], 1))
    return 0


def _cmd_demo(args) -> int:
    # The CLI is the top of the stack: the demo drives a launcher and a coordinator process.
    from meshgate.launchers.demo import DEFAULT_PLAN, run_demo

    try:
        plan = load_plan(args.plan) if args.plan else DEFAULT_PLAN
    except (PlanError, data.DataError, OSError) as exc:
        print(f"invalid plan: {exc}", file=sys.stderr)
        return 1
    return run_demo(
        plan,
        nodes=args.nodes,
        megatron=args.megatron,
        direct=args.direct,
        insecure=args.insecure,
        timeout=args.timeout,
        keep=args.keep,
        jobs=args.jobs,
    )


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("meshgate")
    except PackageNotFoundError:  # run from a checkout that was never installed
        import meshgate

        return f"{meshgate.__version__} (not installed)"


def _commands(parser: argparse.ArgumentParser, prefix: str) -> list[tuple[str, str]]:
    """(command line, help) for every leaf subcommand under ``parser``."""
    found = []
    for action in parser._actions:
        if not isinstance(action, argparse._SubParsersAction):
            continue
        helps = {choice.dest: choice.help for choice in action._choices_actions}
        for name, child in action.choices.items():
            nested = _commands(child, f"{prefix} {name}")
            if nested:
                found += nested
                continue
            positional = [
                "{" + ",".join(a.choices) + "}" if a.choices else a.metavar or a.dest.upper()
                for a in child._actions
                if not a.option_strings and not isinstance(a, argparse._SubParsersAction)
            ]
            found.append((" ".join([f"{prefix} {name}", *positional]), helps.get(name) or ""))
    return found


def _epilog(parser: argparse.ArgumentParser) -> str:
    commands = _commands(parser, parser.prog)
    width = max(len(line) for line, _ in commands) + 2
    lines = ["commands:"] + [f"  {line:<{width}}{text}" for line, text in commands]
    lines += [
        "",
        "Example plans by name: meshgate plan list. A worker saves its attestation for",
        'verify with open("rank0.att", "wb").write(att.signed.SerializeToString()),',
        "where att is what meshgate.register() returned.",
    ]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    from meshgate import init_cli, job_cli
    from meshgate.connection import add_arguments as add_connection_arguments

    parser = argparse.ArgumentParser(
        prog="meshgate",
        usage="meshgate [-h] [--version] COMMAND ...",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"meshgate {_version()}")
    # The epilog lists every command (built from this parser), so argparse's own table is off.
    # prog: each command's usage line starts with its own name ("usage: meshgate certs issue"),
    # not with this parser's usage line.
    sub = parser.add_subparsers(
        dest="command", required=True, metavar="COMMAND", help=argparse.SUPPRESS, prog="meshgate"
    )

    demo = sub.add_parser("demo", help="run a verified world on this machine")
    demo.add_argument(
        "--plan",
        help="plan TOML file, or an example by name, e.g. plan-8-tp-pp-hsdp "
        "(meshgate plan list; default: dp_shard=2, tp=2)",
    )
    demo.add_argument("--nodes", type=int, default=1, help="simulated nodes (default 1)")
    demo.add_argument("--megatron", action="store_true", help="also build Megatron-core groups")
    demo.add_argument("--direct", action="store_true", help="launch workers without agents (plaintext)")
    demo.add_argument("--insecure", action="store_true", help="plaintext instead of mTLS with a dev CA")
    demo.add_argument("--timeout", type=float, default=300.0)
    demo.add_argument("--keep", action="store_true", help="keep the demo's temp directory")
    demo.add_argument(
        "--jobs",
        type=int,
        choices=(1, 2),
        default=2,
        help="jobs run back to back through the same coordinator and agents (default 2)",
    )
    demo.set_defaults(func=_cmd_demo)

    plan = sub.add_parser("plan", help="show or check a plan")
    plan_sub = plan.add_subparsers(dest="plan_command", required=True)
    show = plan_sub.add_parser("show", help="print the mesh and its groups")
    show.add_argument("file", metavar="PLAN", help="plan TOML file or example name")
    show.add_argument("--slots-per-node", type=int)
    check = plan_sub.add_parser("check", help="exit non-zero with the reason for an invalid plan")
    check.add_argument("file", metavar="PLAN", help="plan TOML file or example name")
    plan_sub.add_parser("list", help="the example plans that ship with meshgate")
    plan.set_defaults(func=_cmd_plan)

    verify = sub.add_parser("verify", help="verify a saved SignedAttestation offline")
    verify.add_argument("attestation", help="file with SignedAttestation bytes, or their base64")
    verify.add_argument("--trust-bundle", required=True)
    verify.add_argument("--job", help="expected job id")
    verify.add_argument("--generation", type=int, help="expected generation")
    verify.set_defaults(func=_cmd_verify)

    status = sub.add_parser(
        "status",
        help="the cluster: jobs and nodes by state, the queue (--job ID: that job's rendezvous)",
    )
    status.add_argument("--job", help="show this job's rendezvous (default: $MESHGATE_JOB)")
    status.add_argument("--json", action="store_true", help="machine-readable; one object per line under --watch")
    status.add_argument("--watch", action="store_true", help="refresh until interrupted, with a progress bar")
    status.add_argument("--interval", type=float, default=1.0, help="--watch refresh period in seconds")
    status.add_argument(
        "--until-complete",
        action="store_true",
        help="--watch: exit 0 once every rank registered, 1 once the job failed",
    )
    add_connection_arguments(status)
    status.set_defaults(func=_cmd_status)

    nodes = sub.add_parser("nodes", help="the cluster's nodes: state, slots, job, last seen, labels (admin)")
    nodes.add_argument("--json", action="store_true", help="machine-readable (every node unless --limit)")
    nodes.add_argument("--limit", type=int, help="show at most this many, in node id order (default 100; 0: all)")
    add_connection_arguments(nodes)
    nodes.set_defaults(func=_cmd_nodes, job="")

    node = sub.add_parser(
        "node", help="hold a node out of allocation (and out of its job: drain), or return it (admin)"
    )
    node_sub = node.add_subparsers(dest="node_command", required=True)
    for name, what in (
        ("cordon", "the node takes no new job (it keeps the one it serves); survives coordinator restarts"),
        (
            "drain",
            "cordon, and the node leaves the job it serves now: its block goes to a spare or an idle node of "
            "the pool in a new generation (the job runs on); draining until its workers are gone, then cordoned",
        ),
        ("uncordon", "the node takes jobs again: lifts its cordon and quarantine once a health check run now passes"),
    ):
        action = node_sub.add_parser(name, help=what)
        action.add_argument("node_id", metavar="NODE")
        action.add_argument("--reason", help="why (one line, at most 200 characters; required to cordon or drain)")
        action.add_argument("--json", action="store_true", help="the node, machine-readable")
        add_connection_arguments(action)
        action.set_defaults(func=_cmd_node, job="")

    token = sub.add_parser("token", help="join tokens for node agents (admin)")
    token_sub = token.add_subparsers(dest="token_command", required=True)
    create = token_sub.add_parser("create", help="mint a single-use join token; prints it once")
    create.add_argument("--ttl", default="600s", help="lifetime: 600, 600s, 10m, 1.5h, 1d (default 600s; at most 7d)")
    scope = create.add_mutually_exclusive_group(required=True)
    scope.add_argument("--node-id", action="append", help="admit only this node (repeat, with --node-dirs)")
    scope.add_argument("--any-node", action="store_true", help="admit whichever node uses it first")
    create.add_argument("--job", help="a single-job coordinator's job id (default: $MESHGATE_JOB; none in jobs mode)")
    written = create.add_mutually_exclusive_group()
    written.add_argument("--out", metavar="FILE", help="write the token to FILE (mode 0600) instead of printing it")
    written.add_argument(
        "--node-dirs",
        metavar="DIR",
        help="write each --node-id's token to DIR/ID/join-token (mode 0600; the folders `init agent` writes)",
    )
    add_connection_arguments(create)
    token.set_defaults(func=_cmd_token)

    keys = sub.add_parser("keys", help="the coordinator's signing keys (admin)")
    keys_sub = keys.add_subparsers(dest="keys_command", required=True)
    rotate = keys_sub.add_parser("rotate", help="sign with a new key; keep the old one until its attestations expire")
    rotate.add_argument("--job", help="a single-job coordinator's job id (default: $MESHGATE_JOB; none in jobs mode)")
    add_connection_arguments(rotate)
    keys.set_defaults(func=_cmd_keys)

    from meshgate import certs_cli  # certs init / certs issue

    certs_cli.add_parser(sub)
    init_cli.add_parser(sub)
    job_cli.add_parser(sub)
    parser.epilog = _epilog(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except MissingExtra as exc:  # one line naming the extra, not a traceback
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
