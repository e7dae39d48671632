"""``meshgate certs``: a CA and certificates for real hosts.

  meshgate certs init DIR [--host NAME_OR_IP ...] [--agent NODE_ID ...] [--no-worker]
                          [--no-admin] [--trust-domain TD] [--days N]
  meshgate certs issue DIR --role agent --node-id NODE_ID [--host NAME_OR_IP ...]
  meshgate certs issue DIR --role worker|admin|submitter [--name NAME]
  meshgate certs issue DIR --role coordinator --name NAME --host NAME_OR_IP [--host ...]

``init`` writes a CA (ca.pem, ca.key) and the coordinator's certificate, whose SANs are every
``--host`` (repeat it: each address and DNS name clients dial, both members of an HA pair;
default 127.0.0.1 and localhost for a single machine). ``issue`` adds one certificate from the
CA in DIR. An agent certificate names its node twice: CN=<node_id> and the SAN URI
``spiffe://<trust-domain>/node/<node_id>``. Keys are written 0600 and never overwritten.
Every command prints each file it wrote and the certificate's SHA-256 fingerprint, the value
``PeerIdentity.fingerprint`` reports for a caller presenting it.

The crypto lives in ``meshgate.tls``; this module only parses arguments and prints.
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

DEFAULT_HOSTS = ("127.0.0.1", "localhost")


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``certs init`` and ``certs issue`` under ``subparsers`` (the CLI's top level)."""
    from meshgate.tls import DEFAULT_TRUST_DOMAIN

    certs = subparsers.add_parser("certs", help="a CA and TLS certificates for hosts and roles")
    sub = certs.add_subparsers(dest="certs_command", required=True)

    init = sub.add_parser("init", help="write a CA, the coordinator's certificate and client certificates to DIR")
    init.add_argument("directory")
    init.add_argument(
        "--host",
        action="append",
        default=[],
        metavar="NAME_OR_IP",
        help="a name or address clients use for the coordinator (repeat; default 127.0.0.1 and localhost)",
    )
    init.add_argument(
        "--agent",
        action="append",
        default=[],
        metavar="NODE_ID",
        help="also issue an agent certificate for this node id (repeat; default one named 'agent')",
    )
    init.add_argument("--no-worker", action="store_true", help="skip worker.pem")
    init.add_argument("--no-admin", action="store_true", help="skip admin.pem")
    init.add_argument("--trust-domain", default=DEFAULT_TRUST_DOMAIN, help="SPIFFE trust domain of node URIs")
    init.add_argument("--days", type=int, default=365, help="validity of the leaf certificates")
    init.set_defaults(func=_cmd_init)

    issue = sub.add_parser("issue", help="issue one more certificate from the CA in DIR")
    issue.add_argument("directory")
    issue.add_argument("--role", required=True, choices=("agent", "worker", "admin", "submitter", "coordinator"))
    issue.add_argument("--node-id", help="agent: the node id (CN and SAN URI)")
    issue.add_argument("--name", help="worker/admin/submitter/coordinator: the CN (default: the role)")
    issue.add_argument(
        "--host", action="append", default=[], metavar="NAME_OR_IP", help="a SAN (repeat); required for a coordinator"
    )
    issue.add_argument("--trust-domain", default=DEFAULT_TRUST_DOMAIN, help="SPIFFE trust domain of the node URI")
    issue.add_argument("--days", type=int, default=365)
    issue.set_defaults(func=_cmd_issue)
    return certs


def _print_pairs(title: str, pairs: Sequence[tuple[str, object]]) -> None:
    import os
    import stat

    from meshgate.tls import cert_fingerprint

    print(title)
    for label, pair in pairs:
        print(f"  {label}: {pair.cert}")
        print(f"    key {pair.key} ({stat.S_IMODE(os.stat(pair.key).st_mode):04o})")
        print(f"    sha256 {cert_fingerprint(pair.cert)}")


def _cmd_init(args) -> int:
    from meshgate.tls import TLSError, cert_fingerprint, init_dev_ca

    try:
        ca = init_dev_ca(
            args.directory,
            hosts=tuple(args.host) or DEFAULT_HOSTS,
            agent_names=tuple(args.agent) or ("agent",),
            worker=not args.no_worker,
            admin=not args.no_admin,
            days=args.days,
            trust_domain=args.trust_domain,
        )
    except (TLSError, ValueError, TypeError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"CA in {ca.directory}")
    print(f"  ca: {ca.ca}")
    print(f"    sha256 {cert_fingerprint(ca.ca)}")
    print(f"  ca key: {ca.ca_key} (0600; keep it off the nodes)")
    pairs = [(f"coordinator ({', '.join(tuple(args.host) or DEFAULT_HOSTS)})", ca.server)]
    pairs += [(f"agent {name}", pair) for name, pair in ca.agents.items()]
    pairs += [(role, pair) for role, pair in (("worker", ca.worker), ("admin", ca.admin)) if pair]
    _print_pairs("certificates", pairs)
    return 0


def _cmd_issue(args) -> int:
    from meshgate.tls import TLSError, issue_cert

    if args.role == "agent":
        if not args.node_id or args.name:
            print("error: --role agent needs --node-id (and no --name)", file=sys.stderr)
            return 2
        name = args.node_id
    else:
        if args.node_id:
            print(f"error: --node-id is for --role agent, not {args.role}", file=sys.stderr)
            return 2
        name = args.name or args.role
    if args.role == "coordinator" and not args.host:
        print("error: --role coordinator needs at least one --host", file=sys.stderr)
        return 2
    try:
        pair = issue_cert(
            args.directory,
            args.role,
            name,
            hosts=tuple(args.host),
            days=args.days,
            trust_domain=args.trust_domain,
        )
    except (TLSError, ValueError, TypeError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    label = f"{args.role} {name}" if name != args.role else args.role
    _print_pairs(f"issued from the CA in {args.directory}", [(label, pair)])
    return 0
