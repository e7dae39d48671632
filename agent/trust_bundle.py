"""The coordinator's trust bundle as this node holds it, in the file its workers verify with.

The first Join's bundle is as trustworthy as the (m)TLS channel it came on; after that, a
bundle is taken only if a key already trusted endorses it (at each Join, and on the refresh
beside the heartbeats).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Optional

import grpc

from meshgate import metrics
from meshgate.agent.session import CoordinatorSession
from meshgate.attestation import AttestationError, TrustBundle, accept_trust_bundle
from meshgate.v1 import nodes_pb2, rendezvous_pb2

log = logging.getLogger("meshgate.agent")


class TrustBundleKeeper:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.bundle: Optional[TrustBundle] = None

    def take(self, joined: nodes_pb2.JoinResponse) -> None:
        """The bundle a Join answered with."""
        if self.bundle is None:
            # First contact: the bundle is as trustworthy as the (m)TLS channel it came on.
            self.bundle = TrustBundle.from_proto(joined.trust_bundle)
        else:
            self.bundle = accept_trust_bundle(joined.signed_trust_bundle, self.bundle)
        self.bundle.save(self.path)
        os.chmod(self.path, 0o644)  # public: the workers verify with it, as any user

    async def refresh(self, session: CoordinatorSession, job_id: str) -> None:
        """Take the coordinator's newer bundle only if a key we trust endorses it."""
        try:
            signed = await session.call(
                "GetTrustBundle", rendezvous_pb2.GetTrustBundleRequest(job_id=job_id), timeout=10
            )
            fresh = accept_trust_bundle(signed, self.bundle)
        except grpc.aio.AioRpcError as exc:
            log.warning("trust bundle refresh failed: %s", exc.details())
            return
        except AttestationError as exc:
            metrics.count_verify_failure(exc.reason)
            log.error("trust bundle refused: %s", exc)
            return
        if fresh.version != self.bundle.version or set(fresh.keys) != set(self.bundle.keys):
            log.warning("trust bundle v%d -> v%d: keys %s", self.bundle.version, fresh.version, ", ".join(fresh.keys))
            self.bundle = fresh
            fresh.save(self.path)
