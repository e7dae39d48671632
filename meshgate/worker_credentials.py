"""What a launcher may hand its workers of the environment it runs in: never the credentials
of whoever drives it. A Ray driver or an sbatch script often runs in a shell that holds an
admin's or submitter's certificate (MESHGATE_TLS_CERT / MESHGATE_TLS_KEY) or an admin token;
workers that inherited them would act as that admin on the coordinator (or, where the path
exists only on the head, fail). Workers register with their node's agent's vouch and, where
the coordinator wants client certificates, the node's own worker certificate (OU=worker).

Used by the launchers that meshgate does not start: torchrun's handler (meshgate/torchrun.py)
before torchrun starts its workers, and the claimed-mode settings Ray and Fabric ship to
theirs (launchers/claimed.py)."""

from __future__ import annotations

from typing import Mapping, Optional

from cryptography import x509
from cryptography.x509.oid import NameOID

from meshgate.tls import ROLE_WORKER

CERT_ENV, KEY_ENV = "MESHGATE_TLS_CERT", "MESHGATE_TLS_KEY"
# Never a worker's: the Admin API's bearer token, whoever holds it.
TOKEN_ENVS = ("MESHGATE_ADMIN_TOKEN", "MESHGATE_ADMIN_TOKEN_FILE")


def cert_role(path: str) -> Optional[str]:
    """The role (OU) a PEM client certificate carries; None if it cannot be read here."""
    try:
        with open(path, "rb") as handle:
            cert = x509.load_pem_x509_certificate(handle.read(1 << 20))
    except (OSError, ValueError):
        return None
    roles = cert.subject.get_attributes_for_oid(NameOID.ORGANIZATIONAL_UNIT_NAME)
    return str(roles[0].value) if len(roles) == 1 else ""


def drop_for_workers(env: dict[str, str]) -> dict[str, str]:
    """Remove from ``env`` (os.environ, say) what not_for_workers names; returns it, with why."""
    dropped = not_for_workers(env)
    for name in dropped:
        env.pop(name, None)
    return dropped


def not_for_workers(env: Mapping[str, str]) -> dict[str, str]:
    """The variables of ``env`` a worker must not inherit, each with why: an admin token
    always; the client certificate and its key unless the certificate is a worker's (an
    admin's, a submitter's, an agent's, or one this process cannot read: a head-only path)."""
    held = {name: "an admin token" for name in TOKEN_ENVS if env.get(name)}
    cert = env.get(CERT_ENV, "")
    if cert or env.get(KEY_ENV):
        role = cert_role(cert) if cert else None
        if role != ROLE_WORKER:
            role = f"OU={role}" if role is not None else "not readable here"
            why = f"the client certificate {cert[:200]!r} is not a worker's ({role})"
            held.update({name: why for name in (CERT_ENV, KEY_ENV) if env.get(name)})
    return held
