"""meshgate: the operator, admin and demo command line.

Each command has its own --help. Parts that need an optional extra say which one
(pip install 'meshgate[torch]') when it is missing.
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from meshgate import data
from meshgate.extras import MissingExtra
from meshgate.plan import GROUP_AXES, ParallelPlan, PlanError, compress_ranks

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
    nodes = lambda g: len({r // slots_per_node for r in g})  # noqa: E731
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
        "DeviceMesh dims (outermost first): "
        + ", ".join(f"{a}={plan.size(a)}" for a in reversed(plan.order)),
        f"digest {plan.digest().hex()}",
    ]
    if plan.ep > 1 or plan.etp > 1:
        lines.append(f"experts: ep={plan.ep} etp={plan.etp} edp={plan.edp}")
    if plan.microbatches > 1 or plan.gradient_accumulation_steps > 1:
        lines.append(
            f"microbatches {plan.microbatches}; gradient_accumulation_steps "
            f"{plan.gradient_accumulation_steps}"
        )
    if slots_per_node:
        lines.append(f"nodes {world // slots_per_node} x {slots_per_node} slots")
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
            line = (
                f"{axis:<13}{size:>6}  rank 0's {_fmt_group(plan.group(axis, 0))} ... "
                f"({world // size} groups)"
            )
        else:
            groups = plan.groups(axis)
            line = f"{axis:<13}{size:>6}  {_short(groups)}"
        if slots_per_node:
            line += f"  [{_straddle_note(plan, axis, groups, slots_per_node)}]"
        lines.append(line)
    return "\n".join(lines)


def load_plan(spec: str) -> ParallelPlan:
    """A plan file, or an example plan by name (``plan-8-tp-pp-hsdp``)."""
    where, text = data.resolve_plan(spec)
    try:
        return ParallelPlan.from_toml_text(text)
    except PlanError as exc:
        raise PlanError(f"{where}: {exc}") from None


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
    if args.slots_per_node is not None and (
        args.slots_per_node < 1 or plan.world_size % args.slots_per_node
    ):
        print(
            f"--slots-per-node {args.slots_per_node} must divide world_size {plan.world_size}",
            file=sys.stderr,
        )
        return 1
    print(plan_show(plan, args.slots_per_node))
    return 0


def _cmd_verify(args) -> int:
    from meshgate.attestation import AttestationError, TrustBundle, verify_attestation
    from meshgate.v1 import attestation_pb2

    try:
        bundle = TrustBundle.load(args.trust_bundle)
        signed = attestation_pb2.SignedAttestation()
        with open(args.attestation, "rb") as handle:
            signed.ParseFromString(handle.read())
        verified = verify_attestation(
            signed, bundle, job_id=args.job, nonce=None, generation=args.generation
        )
    except AttestationError as exc:
        print(f"REFUSED ({exc.reason}): {exc}", file=sys.stderr)
        return 1
    except Exception as exc:  # noqa: BLE001 - a debugging tool reports anything
        print(f"error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    print(f"verified: {verified.describe()}")
    for axis in verified.plan.order:
        print(f"  {axis:<13} {verified.coordinate[axis]} of {verified.plan.size(axis)}")
    return 0


# ---- status ---------------------------------------------------------------------------

DEFAULT_COORDINATOR = "127.0.0.1:7443"
_BAR_WIDTH = 40


def expand_ranks(compressed: str) -> list[int]:
    """"0-3,8,10-11" -> [0, 1, 2, 3, 8, 10, 11] (the Status.missing_ranks form)."""
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


def missing_by_node(status) -> list[dict]:
    """Missing ranks grouped by the node expected to hold them (the assigned layout:
    node_rank = rank // slots_per_node), as the coordinator's own AwaitWorld error does."""
    missing = expand_ranks(status.missing_ranks)
    if not missing:
        return []
    slots = next((n.slots for n in status.nodes if n.slots), 0)
    if not slots:
        return [{"node": "(no node has joined)", "node_rank": None, "ranks": status.missing_ranks,
                 "count": len(missing)}]
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


def status_dict(status, coordinator: str, now: float) -> dict:
    """Status as plain JSON-able data (what --json prints)."""
    from google.protobuf import json_format

    from meshgate.v1 import rendezvous_pb2

    opened = _seconds(status.opened_at) if status.HasField("opened_at") else None
    ended = _seconds(status.ended_at) if status.HasField("ended_at") else None  # its clock stops
    nodes = []
    for n in status.nodes:
        last_seen = _seconds(n.last_seen) if n.HasField("last_seen") else None
        nodes.append({
            "node_id": n.node_id,
            "node_rank": n.node_rank,
            "hostname": n.hostname,
            "state": rendezvous_pb2.NodeState.Name(n.state).removeprefix("NODE_STATE_").lower(),
            "slot_kind": n.slot_kind,
            "slots": n.slots,
            "first_rank": n.first_rank,
            "ranks": f"{n.first_rank}-{n.first_rank + n.slots - 1}" if n.slots > 1 else str(n.first_rank),
            "registered": n.registered,
            "last_seen": _iso(last_seen) if last_seen else None,
            "last_seen_age_s": round(now - last_seen, 3) if last_seen else None,
            "exits": list(n.exits),
        })
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
        "missing_ranks": status.missing_ranks,
        "missing_by_node": missing_by_node(status),
        "opened_at": _iso(opened) if opened else None,
        "open_for_s": round((ended or now) - opened, 3) if opened else None,
        "ended_at": _iso(ended) if ended else None,
        "master": f"{status.master_addr}:{status.master_port}" if status.master_addr else None,
        "nodes": nodes,
        "observed_at": _iso(now),
    }


def _bar(done: int, total: int, width: int = _BAR_WIDTH) -> str:
    fraction = done / total if total else 0.0
    filled = int(round(fraction * width))
    return f"[{'#' * filled}{'.' * (width - filled)}] {done}/{total} ranks ({fraction:.0%})"


def render_status(data: dict, *, bar: bool = False, max_nodes: int = 64) -> str:
    plan = data["plan"]
    sizes = " ".join(f"{a}={plan.get(a, 1)}" for a in plan.get("order", []) if int(plan.get(a, 1)) > 1)
    lines = [
        f"job {data['job_id']}  generation {data['generation']}  coordinator {data['coordinator']}",
        f"plan {sizes or 'world 1'} (world {data['world_size']}, digest {data['plan_digest'][:16]})",
    ]
    if data["open_for_s"] is not None:
        if data.get("ended_at"):
            lines.append(f"job ended at {data['ended_at']} after {_age(data['open_for_s'])} "
                         f"(opened {data['opened_at']})")
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
    nodes = data["nodes"]
    if nodes:
        header = ("NODE", "RANK", "HOST", "STATE", "KIND", "RANKS", "REG", "LAST SEEN")
        rows = [
            (n["node_id"], str(n["node_rank"]), n["hostname"] or "-", n["state"], n["slot_kind"] or "-",
             n["ranks"], f"{n['registered']}/{n['slots']}",
             f"{_age(n['last_seen_age_s'])} ago" if n["last_seen_age_s"] is not None else "-")
            for n in nodes[:max_nodes]
        ]
        widths = [max(len(r[i]) for r in rows + [header]) for i in range(len(header))]
        lines.append("")
        for row in [header] + rows:
            lines.append("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
        if len(nodes) > max_nodes:
            lines.append(f"... and {len(nodes) - max_nodes} more nodes (--json lists all)")
        exits = [(n["node_id"], e) for n in nodes for e in n["exits"][-3:]]
        if exits:
            lines.append("")
            lines.append("recent worker exits:")
            lines += [f"  {node}: {line}" for node, line in exits[:max_nodes]]
    lines.append("")
    if data.get("failure"):
        lines.append(f"JOB FAILED: {data['failure']}")
        return "\n".join(lines)
    groups = data["missing_by_node"]
    if not groups:
        lines.append("missing ranks: none (world complete)" if data["complete"] else "missing ranks: none")
    else:
        total = sum(g["count"] for g in groups)
        lines.append(f"missing ranks ({total} of {data['world_size']}), by node:")
        lines += [f"  {g['node']}: {g['ranks']}" for g in groups[:max_nodes]]
        if len(groups) > max_nodes:
            lines.append(f"  ... and {len(groups) - max_nodes} more nodes (--json lists all)")
    return "\n".join(lines)


def fetch_status(coordinator: str, job: str, timeout: float, tls=None, admin_token: str = ""):
    """Admin.GetStatus over TLS (``tls``: a meshgate.tls.TLSConfig) or, with None, plaintext;
    ``admin_token`` travels as ``authorization: Bearer ...``."""
    import grpc

    from meshgate.v1 import rendezvous_pb2, rendezvous_pb2_grpc

    if tls is None:
        channel = grpc.insecure_channel(coordinator)
    else:
        from meshgate.tls import secure_channel

        channel = secure_channel(coordinator, tls)
    metadata = (("authorization", f"Bearer {admin_token}"),) if admin_token else None
    with channel:
        stub = rendezvous_pb2_grpc.AdminStub(channel)
        return stub.GetStatus(
            rendezvous_pb2.GetStatusRequest(job_id=job), timeout=timeout, metadata=metadata
        )


class StatusError(RuntimeError):
    pass


def _status_connection(args) -> tuple[object, str]:
    """The TLS config and admin token the status flags ask for (plaintext without --ca-file)."""
    import os

    token = ""
    token_file = args.admin_token_file or os.environ.get("MESHGATE_ADMIN_TOKEN_FILE")
    if token_file:
        try:
            with open(token_file, encoding="utf-8") as handle:
                token = handle.read().strip()
        except OSError as exc:
            raise StatusError(f"--admin-token-file {token_file}: {exc.strerror}") from None
    if not args.ca_file:
        if args.cert_file or args.key_file:
            raise StatusError("--cert-file and --key-file need --ca-file (TLS)")
        return None, token
    from meshgate.tls import TLSConfig, TLSError

    try:
        tls = TLSConfig(
            ca_file=args.ca_file, cert_file=args.cert_file, key_file=args.key_file,
            server_name=args.server_name,
        )
    except TLSError as exc:
        raise StatusError(str(exc)) from None
    return tls, token


def _status_once(args):
    import grpc

    try:
        status = fetch_status(
            args.coordinator, args.job or "", args.timeout, args.tls, args.admin_token
        )
    except grpc.RpcError as exc:
        raise StatusError(
            f"coordinator {args.coordinator}: {exc.code().name}: {exc.details()}"
        ) from None
    if args.job and status.job_id != args.job:
        raise StatusError(
            f"coordinator {args.coordinator} serves job {status.job_id!r}, not {args.job!r}"
        )
    return status


def _add_admin_connection(parser) -> None:
    parser.add_argument("--timeout", type=float, default=5.0, help="RPC timeout in seconds")
    parser.add_argument("--ca-file", help="TLS: CA to trust for the coordinator (default: plaintext)")
    parser.add_argument("--cert-file", help="mTLS: client certificate (an admin certificate)")
    parser.add_argument("--key-file", help="mTLS: its key")
    parser.add_argument("--server-name", help="TLS: name to check the coordinator's certificate against")
    parser.add_argument(
        "--admin-token-file", help="file with the admin token (default: $MESHGATE_ADMIN_TOKEN_FILE)"
    )


def parse_duration(text: str) -> int:
    """'600s', '10m', '1h', '600' -> seconds."""
    units = {"s": 1, "m": 60, "h": 3600}
    text = text.strip()
    scale = units.get(text[-1:], None)
    number = text[:-1] if scale else text
    try:
        value = int(number) * (scale or 1)
    except ValueError:
        raise StatusError(f"--ttl {text!r}: use seconds, or a number with s, m or h") from None
    if value <= 0:
        raise StatusError(f"--ttl {text!r} must be positive")
    return value


def _admin_target(args) -> tuple[str, str, object, str]:
    import os

    coordinator = args.coordinator or os.environ.get("MESHGATE_COORDINATOR") or DEFAULT_COORDINATOR
    # A jobs-mode coordinator's tokens and keys are the cluster's: no job to name.
    job = args.job or os.environ.get("MESHGATE_JOB") or ""
    tls, token = _status_connection(args)
    return coordinator, job, (tls if tls is not None else False), token


def _cmd_token(args) -> int:
    from meshgate.admin import create_join_token
    from meshgate.client import RendezvousRefused

    try:
        coordinator, job, tls, admin_token = _admin_target(args)
        issued = create_join_token(
            coordinator, job, ttl_s=parse_duration(args.ttl), node_id=args.node_id,
            any_node=args.any_node, tls=tls, admin_token=admin_token or None, timeout=args.timeout,
        )
    except (StatusError, RendezvousRefused) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    import datetime

    expires = datetime.datetime.fromtimestamp(issued.expires_at, datetime.timezone.utc)
    scope = f" for node {issued.node_id}" if issued.node_id else ""
    print(issued.token)
    print(f"single-use{scope}, expires {expires.isoformat(timespec='seconds')}", file=sys.stderr)
    return 0


def _cmd_keys(args) -> int:
    from meshgate.admin import rotate_key
    from meshgate.client import RendezvousRefused
    from meshgate.v1 import attestation_pb2

    try:
        coordinator, job, tls, admin_token = _admin_target(args)
        signed = rotate_key(coordinator, job, tls=tls, admin_token=admin_token or None, timeout=args.timeout)
    except (StatusError, RendezvousRefused) as exc:
        print(f"error: {exc}", file=sys.stderr)
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

    args.coordinator = args.coordinator or os.environ.get("MESHGATE_COORDINATOR") or DEFAULT_COORDINATOR
    args.job = args.job or os.environ.get("MESHGATE_JOB") or ""
    try:
        args.tls, args.admin_token = _status_connection(args)
    except StatusError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not args.watch:
        try:
            status = _status_once(args)
        except StatusError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        data = status_dict(status, args.coordinator, time.time())
        print(json.dumps(data, indent=2) if args.json else render_status(data))
        return 0

    tty = sys.stdout.isatty() and not args.json
    try:
        while True:
            try:
                data = status_dict(_status_once(args), args.coordinator, time.time())
                frame = json.dumps(data) if args.json else render_status(data, bar=True)
                error = None
            except StatusError as exc:
                data, error = None, str(exc)
                frame = json.dumps({"error": error, "observed_at": _iso(time.time())}) if args.json \
                    else f"waiting for the coordinator: {error}"
            if tty:
                sys.stdout.write("\x1b[H\x1b[2J" + frame + "\n")
            else:
                print(frame if args.json else frame + "\n")
            sys.stdout.flush()
            if args.until_complete and data is not None and data["complete"]:
                return 0
            if args.until_complete and data is not None and data.get("failure"):
                return 1
            time.sleep(args.interval)
    except KeyboardInterrupt:
        return 130


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

    parser = argparse.ArgumentParser(
        prog="meshgate",
        usage="meshgate [-h] [--version] COMMAND ...",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"meshgate {_version()}")
    # The epilog lists every command (built from this parser), so argparse's own table is off.
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", help=argparse.SUPPRESS)

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
    demo.add_argument("--jobs", type=int, choices=(1, 2), default=2,
                      help="jobs run back to back through the same coordinator and agents (default 2)")
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
    verify.add_argument("attestation", help="file with SignedAttestation bytes")
    verify.add_argument("--trust-bundle", required=True)
    verify.add_argument("--job", help="expected job id")
    verify.add_argument("--generation", type=int, help="expected generation")
    verify.set_defaults(func=_cmd_verify)

    status = sub.add_parser(
        "status", help="the rendezvous as the coordinator sees it (Admin.GetStatus)"
    )
    status.add_argument(
        "--coordinator",
        help=f"HOST:PORT (default: $MESHGATE_COORDINATOR, else {DEFAULT_COORDINATOR})",
    )
    status.add_argument("--job", help="expected job id (default: $MESHGATE_JOB; refused if it differs)")
    status.add_argument("--json", action="store_true", help="machine-readable; one object per line under --watch")
    status.add_argument("--watch", action="store_true", help="refresh until interrupted, with a progress bar")
    status.add_argument("--interval", type=float, default=1.0, help="--watch refresh period in seconds")
    status.add_argument("--until-complete", action="store_true", help="--watch: exit 0 once every rank registered, 1 once the job failed")
    _add_admin_connection(status)
    status.set_defaults(func=_cmd_status)

    token = sub.add_parser("token", help="join tokens for node agents (admin)")
    token_sub = token.add_subparsers(dest="token_command", required=True)
    create = token_sub.add_parser("create", help="mint a single-use join token; prints it once")
    create.add_argument("--ttl", default="600s", help="lifetime, e.g. 600s, 10m, 1h (default 600s)")
    scope = create.add_mutually_exclusive_group(required=True)
    scope.add_argument("--node-id", default="", help="admit only this node")
    scope.add_argument("--any-node", action="store_true", help="admit whichever node uses it first")
    create.add_argument("--coordinator", help="HOST:PORT (default: $MESHGATE_COORDINATOR)")
    create.add_argument("--job", help="a single-job coordinator's job id (default: $MESHGATE_JOB; none in jobs mode)")
    _add_admin_connection(create)
    token.set_defaults(func=_cmd_token)

    keys = sub.add_parser("keys", help="the coordinator's signing keys (admin)")
    keys_sub = keys.add_subparsers(dest="keys_command", required=True)
    rotate = keys_sub.add_parser("rotate", help="sign with a new key; keep the old one until its attestations expire")
    rotate.add_argument("--coordinator", help="HOST:PORT (default: $MESHGATE_COORDINATOR)")
    rotate.add_argument("--job", help="a single-job coordinator's job id (default: $MESHGATE_JOB; none in jobs mode)")
    _add_admin_connection(rotate)
    keys.set_defaults(func=_cmd_keys)

    from meshgate import certs_cli  # certs init / certs issue

    certs_cli.add_parser(sub)
    init_cli.add_parser(sub)
    job_cli.add_parser(sub, _add_admin_connection)
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
