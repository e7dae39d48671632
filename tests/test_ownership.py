"""Job ownership (issue 20, item 4) on a real coordinator process under mTLS: two
submitters (alice, bob) and an admin. A job records who submitted it; only its owner or
an admin may cancel or finish it or read its command and env; others see id, state, size
and owner. The owner survives a restart; env values never reach the coordinator's log.
Plus ListJobs' pages and filters, through the API and `meshgate job list`.

No agent is needed: the jobs stay PENDING (no node has joined), which is enough to ask
who may see and end them. FinishJob needs a RUNNING job, so an owner's finish answers
FAILED_PRECONDITION (past the ownership check) where a stranger's is PERMISSION_DENIED.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import RunningCoordinator, _spawn, _wait_for_address, free_port, write_config
from meshgate import admin
from meshgate.cli import main as meshgate_main
from meshgate.client import RendezvousRefused
from meshgate.plan import ParallelPlan
from meshgate.tls import init_dev_ca, issue_cert
from meshgate.v1 import rendezvous_pb2 as pb

pytestmark = pytest.mark.slow

SECRET = "tok-3f1d0c9a-never-in-a-log"
PLAN = ParallelPlan(dp_shard=2)


class Coordinator:
    """One jobs-mode coordinator process and the credentials of its three callers."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.ca = init_dev_ca(root / "tls", agent_names=("n0",))
        self.tls = {
            "admin": self.ca.client_tls(self.ca.admin),
            "alice": self.ca.client_tls(issue_cert(root / "tls", "submitter", "alice")),
            "bob": self.ca.client_tls(issue_cert(root / "tls", "submitter", "bob")),
        }
        self.config = write_config(
            root / "coordinator.toml",
            {
                "server": {
                    "listen": f"127.0.0.1:{free_port()}",
                    "ca_file": str(self.ca.ca),
                    "cert_file": str(self.ca.server.cert),
                    "key_file": str(self.ca.server.key),
                    "require_client_cert": True,
                },
                "keys": {"dir": str(root / "keys")},
                "store": {"dir": str(root / "state")},
            },
        )
        self.process = self.start()

    def start(self) -> RunningCoordinator:
        port_file, log_path = self.root / "coordinator.addr", self.root / "coordinator.log"
        port_file.unlink(missing_ok=True)
        process = _spawn(self.config, port_file, log_path)
        self.address = _wait_for_address(process, port_file, log_path, 60)
        return process

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=30)

    def log(self) -> str:
        return (self.root / "coordinator.log").read_text(errors="replace")

    def submit(self, who: str, job_id: str, **spec) -> pb.JobInfo:
        spec.setdefault("command", ["python", "train.py", "--token-file", "/run/secret"])
        message = pb.JobSpec(job_id=job_id, plan=PLAN.to_proto(), nodes=1, **spec)
        # no agent joins this coordinator: every job waits for nodes
        return admin.submit_job(self.address, message, tls=self.tls[who], wait_for_nodes=True)

    def get(self, who: str, job_id: str) -> pb.JobInfo:
        return admin.get_job(self.address, job_id, tls=self.tls[who])

    def refused(self, call, *args, **kwargs) -> RendezvousRefused:
        with pytest.raises(RendezvousRefused) as caught:
            call(self.address, *args, **kwargs)
        return caught.value


@pytest.fixture(scope="module")
def coordinator(tmp_path_factory):
    running = Coordinator(tmp_path_factory.mktemp("ownership"))
    yield running
    running.stop()


def test_a_job_records_its_owner_and_only_owner_or_admin_see_command_and_env(coordinator):
    c = coordinator
    info = c.submit("alice", "alice-1", env={"API_TOKEN": SECRET})
    assert info.owner == "submitter:alice" and not info.redacted
    assert info.spec.env["API_TOKEN"] == SECRET  # the owner's own answer is whole
    for who in ("alice", "admin"):
        seen = c.get(who, "alice-1")
        assert (
            not seen.redacted
            and seen.spec.env["API_TOKEN"] == SECRET
            and list(seen.spec.command)[:2] == ["python", "train.py"]
        ), who
    other = c.get("bob", "alice-1")
    assert other.redacted and other.owner == "submitter:alice"
    assert list(other.spec.command) == [] and dict(other.spec.env) == {}
    assert other.spec.job_id == "alice-1" and other.state == pb.PENDING and other.spec.nodes == 1
    assert not other.HasField("status")
    listed = {j.spec.job_id: j for j in admin.list_jobs(c.address, tls=c.tls["bob"]).jobs}
    assert listed["alice-1"].redacted and not listed["alice-1"].spec.command and not listed["alice-1"].spec.env
    assert listed["alice-1"].owner == "submitter:alice"
    assert SECRET not in str(other) and SECRET not in str(listed)
    # the coordinator logged the submission, with the env's name but never its value
    log = c.log()
    assert "alice-1" in log and "API_TOKEN" in log and SECRET not in log


def test_another_submitter_cannot_cancel_or_finish_a_job_and_nothing_changes(coordinator):
    c = coordinator
    c.submit("alice", "alice-2", env={"API_TOKEN": SECRET})
    for call, args in ((admin.cancel_job, ("alice-2", "mine now")), (admin.finish_job, ("alice-2", True))):
        error = c.refused(call, *args, tls=c.tls["bob"])
        assert error.code.name == "PERMISSION_DENIED", error
        assert "'alice-2'" in error.details and "'submitter:bob'" in error.details, error.details
        assert "'submitter:alice'" in error.details, error.details
    assert c.get("alice", "alice-2").state == pb.PENDING
    # the owner passes the ownership check: finish is refused only because nothing runs
    error = c.refused(admin.finish_job, "alice-2", True, tls=c.tls["alice"])
    assert error.code.name == "FAILED_PRECONDITION" and "not RUNNING" in error.details
    assert admin.cancel_job(c.address, "alice-2", "done", tls=c.tls["alice"]).state == pb.CANCELLED


def test_an_admin_may_cancel_and_finish_anyones_job(coordinator):
    c = coordinator
    c.submit("bob", "bob-1")
    error = c.refused(admin.finish_job, "bob-1", False, tls=c.tls["admin"])
    assert error.code.name == "FAILED_PRECONDITION"  # past the ownership check
    info = admin.cancel_job(c.address, "bob-1", "admin says so", tls=c.tls["admin"])
    assert info.state == pb.CANCELLED and info.owner == "submitter:bob" and not info.redacted
    # an unknown job is NOT_FOUND for a submitter (ownership is asked of jobs that exist)
    assert c.refused(admin.cancel_job, "no-such-job", tls=c.tls["bob"]).code.name == "NOT_FOUND"


def test_list_jobs_pages_and_filters(coordinator):
    c = coordinator
    for i in range(4):
        c.submit("alice" if i % 2 else "bob", f"page-{i}")
    every = [j.spec.job_id for j in admin.all_jobs(c.address, tls=c.tls["admin"], page_size=2)]
    assert every == list(dict.fromkeys(every)), every  # no job twice across pages
    assert every[-4:] == ["page-0", "page-1", "page-2", "page-3"]
    first = admin.list_jobs(c.address, tls=c.tls["admin"], page_size=2)
    assert len(first.jobs) == 2 and first.next_page_token
    last = admin.list_jobs(c.address, tls=c.tls["admin"], page_size=len(every))
    assert len(last.jobs) == len(every) and last.next_page_token == ""  # no empty page after the last
    mine = [j.spec.job_id for j in admin.all_jobs(c.address, tls=c.tls["bob"], owner="submitter:alice", page_size=1)]
    assert {"page-1", "page-3"} <= set(mine) and not {"page-0", "page-2"} & set(mine)
    cancelled = admin.all_jobs(c.address, tls=c.tls["admin"], state="CANCELLED")
    assert {j.spec.job_id for j in cancelled} >= {"alice-2", "bob-1"}
    assert all(j.state == pb.PENDING for j in admin.all_jobs(c.address, tls=c.tls["admin"], state="PENDING"))
    for kwargs, needle in (({"page_size": 1001}, "page_size 1001"), ({"page_token": "bm90LWEtdG9rZW4="}, "page_token")):
        error = c.refused(admin.list_jobs, tls=c.tls["admin"], **kwargs)
        assert error.code.name == "INVALID_ARGUMENT" and needle in error.details, error.details


def test_the_cli_lists_owners_and_cancels_an_id_after_a_double_dash(coordinator, capsys):
    c = coordinator
    c.submit("alice", "cli-1")
    bob = c.tls["bob"]
    connection = [
        "--coordinator",
        c.address,
        "--ca-file",
        str(bob.ca_file),
        "--cert-file",
        str(bob.cert_file),
        "--key-file",
        str(bob.key_file),
    ]
    assert meshgate_main(["job", "list", *connection, "--page-size", "2"]) == 0
    out = capsys.readouterr().out
    header, *rows = out.splitlines()
    assert "OWNER" in header
    row = next(r for r in rows if r.startswith("cli-1 "))
    assert "submitter:alice" in row and "PENDING" in row
    assert meshgate_main(["job", "show", *connection, "cli-1"]) == 0
    assert "withheld" in capsys.readouterr().out
    assert meshgate_main(["job", "cancel", *connection, "--", "cli-1"]) == 2  # bob's cancel is refused
    assert "PERMISSION_DENIED" in capsys.readouterr().err
    admin_tls = c.tls["admin"]
    as_admin = [
        "--coordinator",
        c.address,
        "--ca-file",
        str(admin_tls.ca_file),
        "--cert-file",
        str(admin_tls.cert_file),
        "--key-file",
        str(admin_tls.key_file),
    ]
    assert meshgate_main(["job", "cancel", *as_admin, "--reason", "cleanup", "--", "cli-1"]) == 0
    assert "CANCELLED" in capsys.readouterr().out


def test_the_owner_is_durable_across_a_restart(coordinator):
    c = coordinator
    c.submit("alice", "durable-1", env={"API_TOKEN": SECRET})
    c.stop()
    c.process = c.start()
    assert c.get("admin", "durable-1").owner == "submitter:alice"
    assert c.get("bob", "durable-1").redacted
    assert c.refused(admin.cancel_job, "durable-1", tls=c.tls["bob"]).code.name == "PERMISSION_DENIED"
    assert SECRET not in c.log()


async def test_a_running_jobs_rendezvous_status_is_shown_to_its_owner_and_admins_only(tmp_path):
    """In process (no agent needed for a RUNNING job): a stranger's view of a running job
    has no status, so no hosts and no master address to connect to."""
    from meshgate.attestation import secret_hash
    from meshgate.coordinator import readmodel
    from meshgate.coordinator.cluster import ClusterCoordinator
    from meshgate.coordinator.jobs import Caller, JobSpec, JobState
    from meshgate.coordinator.keys import KeyRing
    from meshgate.coordinator.rendezvous import JoinAuth
    from meshgate.coordinator.store import MemoryStore

    cluster = ClusterCoordinator(
        MemoryStore(),
        KeyRing(tmp_path / "keys"),
        lambda config: MemoryStore(),
        attestation_ttl_s=60,
        heartbeat_timeout_s=15,
        require_vouch=False,
        clock=lambda: 10.0,
    )
    state = cluster.state
    state.apply_all(state.decide_create_token(secret_hash("t"), 600, "n0", 10.0))
    state.apply_all(
        state.decide_join("n0", "n0", 2, "cpu", {}, JoinAuth("t", public_key=bytes(32), new_credential_hash="h"), 10.0)
    )
    alice, bob = Caller("submitter:alice", admin=False), Caller("submitter:bob", admin=False)
    spec = JobSpec.build(job_id="run-1", plan=PLAN, num_nodes=1, command=("python", "x.py"), env={"K": SECRET})
    job = await cluster.submit(spec, alice)
    assert job.state is JobState.RUNNING and job.owner == "submitter:alice"
    for caller in (alice, Caller("admin:root", admin=True)):
        seen = readmodel.job_info(cluster, job, caller=caller)
        assert seen.HasField("status") and not seen.redacted and seen.spec.env["K"] == SECRET
    stranger = readmodel.job_info(cluster, job, caller=bob)
    assert stranger.redacted and not stranger.HasField("status") and SECRET not in str(stranger)
    assert list(stranger.nodes) == ["n0"] and stranger.owner == "submitter:alice"


def test_a_redacted_view_redacts_the_command_wherever_it_appears_in_the_reason():
    from meshgate.coordinator.readmodel import redact_command

    reason = "node n0: cannot start '/opt/acme/secret_train.py' on node 'n0': No such file or directory (-c given)"
    shown = redact_command(reason, ["/opt/acme/secret_train.py", "-c", "--token=abc123"])
    assert "/opt/acme/secret_train.py" not in shown and "<command>" in shown
    assert "(-c given)" in shown  # a short argument is a word of any sentence: left alone
    # longest first: an argument inside another is never left half-shown
    assert redact_command("run /a/b/train.py now", ["/a/b/train.py", "train.py"]) == "run <command> now"
