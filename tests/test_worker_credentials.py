"""No launcher passes its driver's credentials to workers (issue #32): a Ray driver or an
sbatch script run from an admin's shell holds the admin certificate in MESHGATE_TLS_CERT /
MESHGATE_TLS_KEY (or an admin token); its workers must never get them. A worker keeps a
worker certificate (OU=worker), the node's own. Real certificates from a dev CA; the Ray
worker's side runs in a process of its own that inherited the driver's environment, as a
local Ray cluster's workers do, with the settings Ray ships to it (cloudpickled)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from meshgate.attestation import SigningKey, TrustBundle
from meshgate.launchers.claimed import claimed_settings
from meshgate.plan import ParallelPlan
from meshgate.tls import init_dev_ca
from meshgate.worker_credentials import not_for_workers


@pytest.fixture(scope="module")
def ca(tmp_path_factory):
    return init_dev_ca(tmp_path_factory.mktemp("ca") / "tls")


def test_only_a_workers_certificate_and_no_token_is_for_workers(ca, tmp_path):
    admin = {"MESHGATE_TLS_CERT": str(ca.admin.cert), "MESHGATE_TLS_KEY": str(ca.admin.key)}
    assert set(not_for_workers(admin)) == {"MESHGATE_TLS_CERT", "MESHGATE_TLS_KEY"}
    assert "is not a worker's (OU=admin)" in not_for_workers(admin)["MESHGATE_TLS_CERT"]
    worker = {"MESHGATE_TLS_CERT": str(ca.worker.cert), "MESHGATE_TLS_KEY": str(ca.worker.key)}
    assert not_for_workers(worker) == {}
    head_only = {"MESHGATE_TLS_CERT": str(tmp_path / "on-the-head" / "admin.pem"), "MESHGATE_TLS_KEY": "/k"}
    assert "(not readable here)" in not_for_workers(head_only)["MESHGATE_TLS_KEY"]
    garbage = tmp_path / "not.pem"
    garbage.write_text("not a certificate")
    assert "MESHGATE_TLS_CERT" in not_for_workers({"MESHGATE_TLS_CERT": str(garbage)})
    assert set(not_for_workers({**worker, "MESHGATE_ADMIN_TOKEN": "t", "MESHGATE_ADMIN_TOKEN_FILE": "/f"})) == {
        "MESHGATE_ADMIN_TOKEN",
        "MESHGATE_ADMIN_TOKEN_FILE",
    }


WORKER_SIDE = """
import json, os, sys
from ray import cloudpickle
from meshgate.launchers.ray import worker_node_id
settings = cloudpickle.loads(sys.stdin.buffer.read())
node = worker_node_id(settings, lambda: "ray-node")
print(json.dumps({"node": node, "env": {k: v for k, v in os.environ.items() if k.startswith("MESHGATE_")}}))
"""


@pytest.mark.parametrize("worker_has_its_own", [False, True])
def test_a_ray_drivers_admin_certificate_never_reaches_a_worker(ca, tmp_path, monkeypatch, worker_has_its_own):
    """The driver runs with the admin's certificate: the settings Ray ships hold none of
    it, and a worker that inherited the driver's environment drops it before it asks
    anything; a worker certificate the node gives its Ray workers is what they keep."""
    from ray import cloudpickle

    bundle = tmp_path / "bundle.json"
    TrustBundle.of(SigningKey.generate(), job_id="j").save(bundle)
    driver = {
        "MESHGATE_TLS_CA": str(ca.ca),
        "MESHGATE_TLS_CERT": str(ca.admin.cert),
        "MESHGATE_TLS_KEY": str(ca.admin.key),
        "MESHGATE_ADMIN_TOKEN": "admin-secret",
    }
    for name, value in driver.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("MESHGATE_AGENT_SOCKET", raising=False)
    monkeypatch.setenv("MESHGATE_AGENT_CONFIG", str(tmp_path / "no-agent.toml"))
    settings = claimed_settings(
        ParallelPlan(dp_shard=2),
        coordinator="127.0.0.1:1",
        job_id="j",
        trust_bundle=str(bundle),
        await_world=False,
        register_timeout=1.0,
        world_timeout=1.0,
    )
    shipped = cloudpickle.dumps(settings)
    for secret in (str(ca.admin.cert), str(ca.admin.key), "admin-secret"):
        assert secret.encode() not in shipped
    assert dict(settings.transport_env)["MESHGATE_TLS_CA"] == str(ca.ca)  # what a worker needs still goes
    inherited = dict(os.environ)  # a local Ray cluster's worker: the driver's environment
    if worker_has_its_own:  # `ray start` on a node whose operator gave Ray its worker certificate
        inherited.update({"MESHGATE_TLS_CERT": str(ca.worker.cert), "MESHGATE_TLS_KEY": str(ca.worker.key)})
    done = subprocess.run(
        [sys.executable, "-c", WORKER_SIDE], input=shipped, env=inherited, capture_output=True, timeout=120
    )
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    seen = json.loads(done.stdout)
    assert seen["node"] == "ray-node"  # no agent here: Ray's node id
    held = " ".join(seen["env"].values())
    assert str(ca.admin.cert) not in held and str(ca.admin.key) not in held and "admin-secret" not in held, seen
    assert "MESHGATE_ADMIN_TOKEN" not in seen["env"]
    if worker_has_its_own:
        assert (seen["env"]["MESHGATE_TLS_CERT"], seen["env"]["MESHGATE_TLS_KEY"]) == (
            str(ca.worker.cert),
            str(ca.worker.key),
        )
    else:
        assert "MESHGATE_TLS_CERT" not in seen["env"] and "MESHGATE_TLS_KEY" not in seen["env"]
    assert seen["env"]["MESHGATE_TLS_CA"] == str(ca.ca)
