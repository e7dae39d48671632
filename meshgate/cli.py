"""``meshgate``: the admin and demo CLI.

  meshgate demo [--plan FILE] [--nodes N] [--megatron]
  meshgate plan show FILE [--slots-per-node K]
  meshgate plan check FILE
  meshgate verify ATTESTATION --trust-bundle FILE
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from meshgate.plan import GROUP_AXES, ParallelPlan, PlanError

_MAX_GROUPS_SHOWN = 8


def _short(groups: list[tuple[int, ...]]) -> str:
    shown = " ".join("{" + ",".join(map(str, g)) + "}" for g in groups[:_MAX_GROUPS_SHOWN])
    more = f" ... ({len(groups)} groups)" if len(groups) > _MAX_GROUPS_SHOWN else ""
    return shown + more


def plan_show(plan: ParallelPlan, slots_per_node: int | None) -> str:
    lines = [
        f"world_size {plan.world_size}; order (innermost first) {'-'.join(plan.order)}",
        f"DeviceMesh dims (outermost first): "
        + ", ".join(f"{a}={plan.size(a)}" for a in reversed(plan.order)),
        f"digest {plan.digest().hex()}",
        "",
        f"{'axis':<13}{'size':>6}  groups",
    ]
    for axis in GROUP_AXES:
        size = plan.size(axis)
        if size == 1 and axis not in ("dp",):
            continue
        if plan.world_size > 4096:
            lines.append(f"{axis:<13}{size:>6}  (rank 0's group: {list(plan.group(axis, 0))[:16]})")
            continue
        groups = plan.groups(axis)
        line = f"{axis:<13}{size:>6}  {_short(groups)}"
        if slots_per_node and axis in ("tp", "cp", "etp", "ep"):
            straddling = [g for g in groups if len({r // slots_per_node for r in g}) > 1]
            if straddling:
                line += f"  STRADDLES NODES ({len(straddling)} groups)"
        lines.append(line)
    return "\n".join(lines)


def _cmd_plan(args) -> int:
    try:
        plan = ParallelPlan.from_toml(args.file)
    except (PlanError, OSError) as exc:
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


def _cmd_demo(args) -> int:
    # The CLI is the top of the stack: the demo drives a launcher and a coordinator process.
    from launchers.demo import DEFAULT_PLAN, run_demo

    try:
        plan = ParallelPlan.from_toml(args.plan) if args.plan else DEFAULT_PLAN
    except (PlanError, OSError) as exc:
        print(f"invalid plan: {exc}", file=sys.stderr)
        return 1
    return run_demo(
        plan,
        nodes=args.nodes,
        megatron=args.megatron,
        direct=args.direct,
        timeout=args.timeout,
        keep=args.keep,
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="meshgate", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="run a verified world on this machine")
    demo.add_argument("--plan", help="plan TOML (default: dp_shard=2, tp=2)")
    demo.add_argument("--nodes", type=int, default=1, help="simulated nodes (default 1)")
    demo.add_argument("--megatron", action="store_true", help="also build Megatron-core groups")
    demo.add_argument("--direct", action="store_true", help="launch workers without agents")
    demo.add_argument("--timeout", type=float, default=300.0)
    demo.add_argument("--keep", action="store_true", help="keep the demo's temp directory")
    demo.set_defaults(func=_cmd_demo)

    plan = sub.add_parser("plan", help="show or check a plan")
    plan_sub = plan.add_subparsers(dest="plan_command", required=True)
    show = plan_sub.add_parser("show", help="print the mesh and its groups")
    show.add_argument("file")
    show.add_argument("--slots-per-node", type=int)
    check = plan_sub.add_parser("check", help="exit non-zero with the reason for an invalid plan")
    check.add_argument("file")
    plan.set_defaults(func=_cmd_plan)

    verify = sub.add_parser("verify", help="verify a saved SignedAttestation offline")
    verify.add_argument("attestation", help="file with SignedAttestation bytes")
    verify.add_argument("--trust-bundle", required=True)
    verify.add_argument("--job", help="expected job id")
    verify.add_argument("--generation", type=int, help="expected generation")
    verify.set_defaults(func=_cmd_verify)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
