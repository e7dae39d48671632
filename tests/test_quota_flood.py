"""A flood of submissions (issue 31, items 2 and 3) on a real coordinator process under
mTLS with the shipped default quotas: alice submits 500 jobs of 60 KB of env each. Past
her waiting-jobs quota (100) every submit is refused RESOURCE_EXHAUSTED naming the quota,
its value and her use; bob's submissions go on as before; the coordinator's memory grows
by what the quota admits, not by the flood. An admin (exempt) then queues 300 more such
jobs, 24 MB of env in all, and `meshgate job list` still lists every one: each page stops
before 1 MiB serialized (the old 100-job page was 6 MB, past the client's 4 MiB limit),
and the coordinator's log holds no traceback.

No agent joins: the jobs wait for nodes (wait_for_nodes), which is all a flood needs."""

from __future__ import annotations

import time

import grpc
import pytest

from meshgate.cli import main as meshgate_main
from meshgate.coordinator.pages import MAX_PAGE_BYTES
from meshgate.tls import secure_channel
from meshgate.v1 import rendezvous_pb2 as pb
from meshgate.v1 import rendezvous_pb2_grpc
from test_ownership import PLAN, Coordinator

pytestmark = pytest.mark.slow

ENV_BYTES = 60_000
FLOOD = 500


def rss_kib(pid: int) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def flood(c: Coordinator, who: str, prefix: str, count: int) -> list[tuple[str, str]]:
    """``count`` submissions of ``who`` over one channel: (status code name, details) each."""
    answers = []
    with secure_channel(c.address, c.tls[who]) as channel:
        stub = rendezvous_pb2_grpc.AdminStub(channel)
        for i in range(count):
            spec = pb.JobSpec(job_id=f"{prefix}-{i}", plan=PLAN.to_proto(), nodes=1, command=["python", "train.py"])
            spec.env["BLOB"] = "x" * ENV_BYTES
            try:
                stub.SubmitJob(pb.SubmitJobRequest(spec=spec, wait_for_nodes=True), timeout=30)
                answers.append(("OK", ""))
            except grpc.RpcError as exc:
                answers.append((exc.code().name, exc.details()))
    return answers


@pytest.fixture(scope="module")
def flooded(tmp_path_factory):
    c = Coordinator(tmp_path_factory.mktemp("flood"))
    before = rss_kib(c.process.pid)
    started = time.monotonic()
    answers = flood(c, "alice", "alice", FLOOD)
    took = time.monotonic() - started
    after = rss_kib(c.process.pid)
    print(f"\nflood: {FLOOD} submits in {took:.1f}s; coordinator RSS {before} -> {after} KiB")
    yield c, answers, before, after
    c.stop()


def test_one_submitters_flood_is_refused_past_the_quota_and_the_others_are_unaffected(flooded):
    c, answers, before, after = flooded
    assert [code for code, _ in answers[:100]] == ["OK"] * 100, answers[:100]
    refused = answers[100:]
    assert {code for code, _ in refused} == {"RESOURCE_EXHAUSTED"}, refused[:3]
    assert all(
        "quota waiting_jobs = 100 of 'submitter:alice' is reached: 100 job(s) waiting" in details
        for _, details in refused
    ), refused[:3]
    assert flood(c, "bob", "bob", 5) == [("OK", "")] * 5  # his quota is his own
    # The memory the flood could take is what the quota admits: 100 jobs of 60 KB, not 500
    # (measured before the quota: 72 -> 144 MiB for the whole flood).
    assert after - before < 48 << 10, (before, after)


def test_the_admins_job_list_pages_stay_under_the_budget_after_a_flood_of_large_env_jobs(flooded, capsys):
    c = flooded[0]
    assert {code for code, _ in flood(c, "admin", "admin", 300)} == {"OK"}  # admins are exempt
    pages, token = [], ""
    with secure_channel(c.address, c.tls["admin"]) as channel:
        stub = rendezvous_pb2_grpc.AdminStub(channel)
        for page_size in (0, 1000):  # the default page, and the largest a caller may ask for
            while True:
                page = stub.ListJobs(pb.ListJobsRequest(page_size=page_size, page_token=token), timeout=30)
                pages.append(page)
                token = page.next_page_token
                if not token:
                    break
    assert all(page.ByteSize() < MAX_PAGE_BYTES for page in pages), [p.ByteSize() for p in pages]
    listed = [j.spec.job_id for p in pages for j in p.jobs]
    assert len(listed) == 2 * 405 and len(set(listed)) == 405  # every job once per walk: none lost between pages
    assert all(j.spec.env["BLOB"] == "x" * ENV_BYTES for p in pages for j in p.jobs)  # the admin's rows are whole
    admin_tls = c.tls["admin"]
    connection = ["--coordinator", c.address, "--ca-file", str(admin_tls.ca_file)]
    connection += ["--cert-file", str(admin_tls.cert_file), "--key-file", str(admin_tls.key_file)]
    assert meshgate_main(["job", "list", *connection]) == 0, capsys.readouterr().err
    rows = [line for line in capsys.readouterr().out.splitlines()[1:] if line.strip()]
    assert len(rows) == 405 and rows[-1].startswith("admin-299 ")
    # bob's view of alice's jobs is redacted: never her command or env
    with secure_channel(c.address, c.tls["bob"]) as channel:
        page = rendezvous_pb2_grpc.AdminStub(channel).ListJobs(pb.ListJobsRequest(owner="submitter:alice"))
    assert page.jobs and all(j.redacted and not j.spec.command and not j.spec.env for j in page.jobs)
    assert "Traceback" not in c.log(), c.log()[-3000:]
