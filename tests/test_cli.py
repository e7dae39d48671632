"""The operator CLI: plan show/check, status (text, --json, --watch) against a real
coordinator during a partial rendezvous, and verify on an attestation a worker saved."""

from __future__ import annotations

import base64

import re

import json
import subprocess
import sys
import sysconfig
import threading
import time
from pathlib import Path

import pytest

from conftest import REPO, worker_env
from meshgate import cli, views
from meshgate.client import RendezvousRefused, register
from meshgate.plan import ParallelPlan, compress_ranks

PLAN = ParallelPlan(tp=2, dp_shard=3)  # 6 ranks: 3 nodes of 2


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


# ---- plan --------------------------------------------------------------------------------


def test_plan_show_and_check(tmp_path, capsys):
    plan_file = tmp_path / "plan.toml"
    plan_file.write_text("[plan]\ntp = 2\ncp = 2\ndp_shard = 2\n")
    code, out, _ = run_cli(capsys, "plan", "show", str(plan_file), "--slots-per-node", "2")
    assert code == 0
    assert "world_size 8" in out
    assert "tp                2       1" in out  # axis, size, stride: innermost first
    assert "tp                2  {0,1} {2,3} {4,5} {6,7}  [within nodes]" in out
    assert "cp                2  {0,2} {1,3} {4,6} {5,7}  [STRADDLES NODES: 4 of 4 groups" in out
    code, out, _ = run_cli(capsys, "plan", "check", str(plan_file))
    assert code == 0 and out.startswith("ok: world 8")

    bad = tmp_path / "bad.toml"
    bad.write_text("[plan]\ntp = 1.5\n")
    code, _, err = run_cli(capsys, "plan", "check", str(bad))
    assert code == 1 and "tp must be an exact positive integer" in err
    code, _, err = run_cli(capsys, "plan", "show", str(plan_file), "--slots-per-node", "3")
    assert code == 1 and "must divide world_size 8" in err


def test_plan_show_stays_short_for_big_worlds(tmp_path, capsys):
    plan_file = tmp_path / "big.toml"
    plan_file.write_text("[plan]\ntp = 8\ncp = 2\ndp_shard = 64\ndp_replicate = 8\npp = 16\n")
    started = time.monotonic()
    code, out, _ = run_cli(capsys, "plan", "show", str(plan_file), "--slots-per-node", "8")
    assert code == 0 and time.monotonic() - started < 5
    assert "world_size 131072" in out
    assert "tp                8  rank 0's {0-7} ... (16384 groups)  [rank 0's group within a node]" in out
    assert "pp               16  rank 0's {0,8192,...,122880}" in out
    assert max(len(line) for line in out.splitlines()) < 160


def test_rank_compression_round_trip():
    ranks = [0, 1, 2, 3, 8, 10, 11]
    assert compress_ranks(ranks) == "0-3,8,10-11"
    assert views.expand_ranks("0-3,8,10-11") == ranks
    assert views.expand_ranks("") == []


def test_status_unreachable(capsys):
    code, _, err = run_cli(capsys, "status", "--coordinator", "127.0.0.1:1", "--timeout", "1")
    assert code == 2 and "127.0.0.1:1: UNAVAILABLE" in err


# ---- against a real coordinator --------------------------------------------------------------


@pytest.mark.slow
def test_status_verify_and_watch(coordinator_factory, tmp_path, capsys, monkeypatch):
    running = coordinator_factory(PLAN, slots_per_node=2)
    monkeypatch.setenv("MESHGATE_ADVERTISE_HOST", "127.0.0.1")
    common = dict(coordinator=running.address, job_id="test", trust_bundle=str(running.trust_bundle_path))
    # node-a complete, node-b half, the third node never comes: 3 of 6 ranks.
    att = register(node_id="node-a", local_rank=0, **common)
    register(node_id="node-a", local_rank=1, **common)
    register(node_id="node-b", local_rank=0, **common)

    code, out, err = run_cli(capsys, "status", "--coordinator", running.address, "--job", "test")
    assert code == 0, err
    assert "job test  generation 0" in out
    assert "registered 3/6 ranks" in out
    assert "rendezvous open for" in out
    assert "missing ranks (3 of 6), by node:" in out
    assert "  node-b: 3" in out
    assert "  node_rank 2 (not joined): 4-5" in out
    node_b = next(line for line in out.splitlines() if line.startswith("node-b"))
    assert "2-3" in node_b and "1/2" in node_b and "ago" in node_b

    # a single-job config: status with no --job shows the job GetCluster says it declares
    from meshgate import admin

    assert admin.get_cluster(running.address, tls=False).declared_job_id == "test"
    code, out, _ = run_cli(capsys, "status", "--coordinator", running.address, "--json")
    assert code == 0
    data = json.loads(out)
    assert data["job_id"] == "test" and data["world_size"] == 6 and data["registered"] == 3
    assert data["complete"] is False
    assert data["missing_ranks"] == "3-5"
    assert data["missing_by_node"] == [
        {"node": "node-b", "node_rank": 1, "ranks": "3", "count": 1},
        {"node": "node_rank 2 (not joined)", "node_rank": 2, "ranks": "4-5", "count": 2},
    ]
    assert [n["node_id"] for n in data["nodes"]] == ["node-a", "node-b"]
    assert data["nodes"][0]["ranks"] == "0-1" and data["nodes"][0]["registered"] == 2
    assert data["nodes"][0]["last_seen_age_s"] >= 0
    assert data["open_for_s"] >= 0 and data["plan"]["tp"] == 2

    code, _, err = run_cli(capsys, "status", "--coordinator", running.address, "--job", "other")
    assert code == 2 and "NOT_FOUND: job_id 'other' is not known to this coordinator" in err  # the cluster's answer

    # verify: the attestation a worker saved with att.signed.SerializeToString().
    saved = tmp_path / "rank0.att"
    saved.write_bytes(att.signed.SerializeToString())
    code, out, err = run_cli(
        capsys,
        "verify",
        str(saved),
        "--trust-bundle",
        str(running.trust_bundle_path),
        "--job",
        "test",
        "--generation",
        "0",
    )
    assert code == 0, err
    assert out.startswith("verified: job test gen 0 rank 0/6 node node-a#0")
    assert "  tp            0 of 2" in out
    code, _, err = run_cli(
        capsys, "verify", str(saved), "--trust-bundle", str(running.trust_bundle_path), "--job", "another"
    )
    assert code == 1 and err.startswith("REFUSED (wrong_job)")
    # ... or its base64, as the demo worker prints it to `meshgate job logs`
    (tmp_path / "rank0.b64").write_text(base64.b64encode(att.signed.SerializeToString()).decode() + "\n")
    code, out, err = run_cli(
        capsys, "verify", str(tmp_path / "rank0.b64"), "--trust-bundle", str(running.trust_bundle_path)
    )
    assert code == 0 and out.startswith("verified: job test gen 0 rank 0/6"), err
    tampered = type(att.signed)()
    tampered.CopyFrom(att.signed)
    tampered.signature = bytes([tampered.signature[0] ^ 1]) + tampered.signature[1:]
    (tmp_path / "bad.att").write_bytes(tampered.SerializeToString())
    code, _, err = run_cli(
        capsys, "verify", str(tmp_path / "bad.att"), "--trust-bundle", str(running.trust_bundle_path)
    )
    assert code == 1 and err.startswith("REFUSED (bad_signature)")

    # --watch (the installed entry point, as an operator runs it) ends once the world completes.
    watch = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "meshgate.cli",
            "status",
            "--coordinator",
            running.address,
            "--watch",
            "--interval",
            "0.2",
            "--until-complete",
        ],
        cwd=REPO,
        env=worker_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines: list[str] = []
    first_frame = threading.Event()

    def read() -> None:
        for line in watch.stdout:
            lines.append(line)
            if "ranks (" in line:
                first_frame.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert first_frame.wait(30), watch.stderr.read() if watch.poll() is not None else "no frame"
        register(node_id="node-b", local_rank=1, **common)
        register(node_id="node-c", local_rank=0, **common)
        register(node_id="node-c", local_rank=1, **common)
        assert watch.wait(timeout=30) == 0, watch.stderr.read()
    finally:
        if watch.poll() is None:
            watch.kill()
    reader.join(timeout=10)
    out = "".join(lines)
    assert "] 3/6 ranks (50%)" in out
    assert "[" + "#" * 40 + "] 6/6 ranks (100%)" in out
    assert out.rstrip().endswith("missing ranks: none (world complete)")


def test_status_json_watch_lines(monkeypatch, capsys):
    """--watch --json prints one object per line; an unreachable coordinator is a line too."""
    monkeypatch.setattr("time.sleep", lambda seconds: None)
    calls = []

    def fake_fetch(connection, job, timeout):
        calls.append(1)
        if len(calls) == 1:
            import grpc

            raise RendezvousRefused(grpc.StatusCode.UNAVAILABLE, "connection refused", connection.current)
        from meshgate.v1 import rendezvous_pb2 as pb

        return pb.Status(job_id="j", world_size=2, registered=2, plan=PLAN.to_proto())

    monkeypatch.setattr(cli, "fetch_status", fake_fetch)
    from meshgate.v1 import rendezvous_pb2 as pb

    # A config that declares job "j": status with no --job shows that job's rendezvous.
    cluster_status = pb.ClusterStatus(declared_job_id="j")
    monkeypatch.setattr(cli, "fetch_cluster", lambda connection, timeout: cluster_status)
    code, out, _ = run_cli(capsys, "status", "--coordinator", "x:1", "--watch", "--json", "--until-complete")
    assert code == 0
    lines = [json.loads(line) for line in out.splitlines()]
    assert "UNAVAILABLE" in lines[0]["error"]
    assert lines[1]["complete"] is True and lines[1]["missing_by_node"] == []


def test_status_with_no_job_shows_the_cluster_and_refuses_to_wait_for_it(monkeypatch, capsys):
    """A config that declares no job: status shows the cluster; --until-complete, which
    waits for one job's world, is refused at once rather than watching forever."""
    from meshgate.v1 import rendezvous_pb2 as pb

    cluster_status = pb.ClusterStatus(
        jobs=[pb.JobStateCount(state=pb.PENDING, count=1)],
        nodes=[pb.PoolStateCount(state=pb.POOL_STATE_IDLE, count=2)],
        queue=[pb.QueuedJob(job_id="big", reason="needs 3 nodes of 2 slots; 2 idle")],
    )
    monkeypatch.setattr(cli, "fetch_cluster", lambda connection, timeout: cluster_status)
    monkeypatch.setattr(cli, "fetch_status", lambda *a: pytest.fail("no job to ask GetStatus for"))
    code, out, _ = run_cli(capsys, "status", "--coordinator", "x:1", "--json")
    data = json.loads(out)
    assert code == 0 and data["jobs"] == {"PENDING": 1} and data["nodes"] == {"idle": 2}
    assert data["queue"][0]["reason"] == "needs 3 nodes of 2 slots; 2 idle"
    code, out, err = run_cli(capsys, "status", "--coordinator", "x:1", "--watch", "--until-complete")
    assert code == 2 and "--until-complete waits for one job's world" in err and out == ""


@pytest.mark.slow
def test_status_with_an_admin_token(coordinator_factory, tmp_path, capsys):
    token_file = tmp_path / "admin.token"
    token_file.write_text("Admin-Token-77f1e2\n")
    token_file.chmod(0o600)  # a secret file: the coordinator refuses a looser mode
    running = coordinator_factory(PLAN, slots_per_node=2, server={"admin_token_file": str(token_file)})
    code, out, err = run_cli(capsys, "status", "--coordinator", running.address)
    assert code == 2 and "UNAUTHENTICATED" in err
    code, out, err = run_cli(capsys, "status", "--coordinator", running.address, "--admin-token-file", str(token_file))
    assert code == 0, err
    assert "registered 0/6 ranks" in out and "rendezvous not open yet" in out
    assert "Admin-Token-77f1e2" not in out + err + running.log()


# ---- version, help, example plans, init ---------------------------------------------------


def test_version_comes_from_the_package_metadata(capsys):
    import importlib.metadata

    import meshgate

    with pytest.raises(SystemExit) as done:
        cli.main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out.strip() == f"meshgate {importlib.metadata.version('meshgate')}"
    assert importlib.metadata.version("meshgate") == meshgate.__version__


def _leaf_commands(parser, prefix=()):
    import argparse

    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                yield from (
                    _leaf_commands(child, (*prefix, name))
                    if any(isinstance(a, argparse._SubParsersAction) for a in child._actions)
                    else [(*prefix, name)]
                )


def test_help_lists_every_command_without_markup():
    result = subprocess.run(
        [sys.executable, "-m", "meshgate.cli", "--help"], capture_output=True, text=True, cwd=REPO, timeout=60
    )
    assert result.returncode == 0
    help_text = result.stdout
    assert "``" not in help_text and "`" not in help_text.split("commands:")[0]
    leaves = list(_leaf_commands(cli.build_parser()))
    assert ("token", "create") in leaves and ("keys", "rotate") in leaves and ("init",) in leaves
    for leaf in leaves:
        assert f"meshgate {' '.join(leaf)}" in help_text, leaf


def test_plans_by_example_name(tmp_path, capsys):
    code, out, _ = run_cli(capsys, "plan", "list")
    assert code == 0
    assert out.splitlines()[-1].startswith("plan-8-tp-pp-hsdp    world 8: tp=2")
    code, by_name, _ = run_cli(capsys, "plan", "show", "plan-8-tp-pp-hsdp")
    code2, by_path, _ = run_cli(capsys, "plan", "show", str(REPO / "examples" / "plan-8-tp-pp-hsdp.toml"))
    assert code == code2 == 0 and by_name == by_path and "world_size 8" in by_name
    code, _, err = run_cli(capsys, "demo", "--plan", "plan-9-nope")
    assert code == 1
    assert "no plan file 'plan-9-nope' and no example of that name; examples: plan-4," in err
    # a file of that name wins over the example
    local = tmp_path / "plan-4.toml"
    local.write_text("[plan]\ntp = 8\n")
    code, out, _ = run_cli(capsys, "plan", "check", str(local))
    assert code == 0 and out.startswith("ok: world 8")


def test_init_writes_the_bundled_configs_and_refuses_to_overwrite(tmp_path, capsys):
    import stat

    from meshgate.agent.config import AgentConfig
    from meshgate.coordinator.config import CoordinatorConfig
    from meshgate.tls import init_dev_ca

    target = tmp_path / "etc"
    for what, flags in (("coordinator", ["--systemd"]), ("agent", ["--systemd"]), ("systemd", [])):
        code, out, err = run_cli(capsys, "init", what, "--dir", str(target), *flags)
        assert code == 0, err
    names = {p.name: stat.S_IMODE(p.stat().st_mode) for p in target.iterdir()}
    assert set(names) == {
        "coordinator.toml",
        "agent.toml",
        "join-token",
        "meshgate-coordinator.service",
        "meshgate-agent.service",
    }
    assert names["join-token"] == 0o600  # the secret: paste the join token in here
    assert not any(mode & 0o022 for mode in names.values())
    assert (target / "agent.toml").read_text() == (REPO / "deploy/systemd/agent.toml").read_text()
    # the units run this interpreter's entry points (this venv has both), not /usr/local/bin
    scripts = Path(sysconfig.get_path("scripts"))
    for unit in ("meshgate-agent.service", "meshgate-coordinator.service"):
        shipped = (REPO / "deploy/systemd" / unit).read_text()
        assert "ExecStart=/usr/local/bin/meshgate-" in shipped
        assert (target / unit).read_text() == shipped.replace("/usr/local/bin/", f"{scripts}/")
    assert f"ExecStart= runs {scripts}/meshgate-coordinator" in out
    # with the development CA in tls/ and the secret files where the units' LoadCredential=
    # puts them (a folder standing in for /run/credentials), both written configs load
    init_dev_ca(target / "tls")
    run = tmp_path / "run"
    for unit, ident, source in (
        ("meshgate-coordinator.service", "coordinator.key", "tls/coordinator.key"),
        ("meshgate-agent.service", "agent.key", "tls/agent.key"),
        ("meshgate-agent.service", "worker.key", "tls/worker.key"),
        ("meshgate-agent.service", "join-token", "join-token"),
    ):
        (run / unit).mkdir(parents=True, exist_ok=True)
        (run / unit / ident).write_bytes((target / source).read_bytes())
        (run / unit / ident).chmod(0o400)
    for config in ("coordinator.toml", "agent.toml"):
        text = (target / config).read_text()
        (target / config).write_text(text.replace("/run/credentials/", f"{run}/"))
    assert CoordinatorConfig.load(target / "coordinator.toml").listen == "0.0.0.0:7443"
    assert AgentConfig.load(target / "agent.toml").coordinator == "head-a:7443,head-b:7443"

    (target / "join-token").write_text("a-real-token\n")
    (target / "agent.toml").write_text("# mine\n")
    code, _, err = run_cli(capsys, "init", "agent", "--dir", str(target))
    assert code == 1
    assert f"refusing to overwrite {target / 'agent.toml'}, {target / 'join-token'} (use --force)" in err
    assert (target / "join-token").read_text() == "a-real-token\n"  # nothing written
    assert (target / "agent.toml").read_text() == "# mine\n"
    (target / "join-token").chmod(0o644)
    code, _, _ = run_cli(capsys, "init", "agent", "--dir", str(target), "--force", "--systemd")
    assert code == 0
    assert (target / "agent.toml").read_text().startswith("# /etc/meshgate/agent.toml")
    assert stat.S_IMODE((target / "join-token").stat().st_mode) == 0o600
    assert sorted(p.name for p in target.iterdir() if p.name.startswith(".")) == []  # no temp files left


_HINTED_KEYS = re.compile(r"\[(\w+)\] ((?:\w+, )*\w+)")
_HINTED_FILES = re.compile(r"\btls/[\w.-]+")


def _hints_match(out: str, config: Path) -> None:
    """Every `[section] key, key` a hint names is in the written config (live or commented
    out), and every tls/ file it names is a path the config sets."""
    import tomllib

    hints = out.split("next:", 1)[1]
    text = config.read_text()
    settings = tomllib.loads(text)
    assert _HINTED_KEYS.search(hints), hints
    for section, keys in _HINTED_KEYS.findall(hints):
        assert f"[{section}]" in text, f"hint names [{section}], {config.name} has no such section"
        for key in keys.split(", "):
            assert re.search(rf"^#?\s*{key}\s*=", text, re.M), f"hint names [{section}] {key}; {config.name} lacks it"
    values = {v for table in settings.values() if isinstance(table, dict) for v in table.values() if isinstance(v, str)}
    for path in _HINTED_FILES.findall(hints):
        assert path in values, f"hint names {path}, which {config.name} does not set"


def test_init_configs_need_no_edits_and_their_hints_name_what_they_wrote(tmp_path, capsys):
    """By default the configs name the secret files themselves (a daemon started by hand
    loads them as written); init agent fills the coordinator and node id and copies the
    node's certificates, keys 0600; every hint names keys, sections and files that exist."""
    import stat

    from meshgate.agent.config import AgentConfig
    from meshgate.coordinator.config import CoordinatorConfig
    from meshgate.tls import init_dev_ca, issue_cert

    head = tmp_path / "head"
    ca = init_dev_ca(head / "tls", hosts=("10.0.0.1",), agent_names=("host-a", "host-b"))
    code, out, err = run_cli(capsys, "init", "coordinator", "--dir", str(head))
    assert code == 0, err
    _hints_match(out, head / "coordinator.toml")
    assert "[server] ca_file, cert_file and key_file: tls/ca.pem, tls/coordinator.pem, tls/coordinator.key " in out
    assert "next to coordinator.toml (all present)" in out
    coordinator = CoordinatorConfig.load(head / "coordinator.toml")  # loads with no edit
    assert "/run/credentials" not in (head / "coordinator.toml").read_text().split("[keys]")[0].replace("#", "")
    assert coordinator.listen == "0.0.0.0:7443"

    # without options: the hints say what is left (certificates; coordinator, node id, token)
    bare = tmp_path / "bare"
    code, out, err = run_cli(capsys, "init", "coordinator", "--dir", str(bare))
    assert code == 0, err
    _hints_match(out, bare / "coordinator.toml")
    assert f"(missing tls/ca.pem, tls/coordinator.pem, tls/coordinator.key: `meshgate certs init {bare / 'tls'}" in out
    code, out, err = run_cli(capsys, "init", "agent", "--dir", str(bare))
    assert code == 0, err
    _hints_match(out, bare / "agent.toml")
    assert "set [agent] coordinator" in out and "--certs CA_DIR" in out and "--out " in out

    code, out, err = run_cli(
        capsys, "init", "agent", "--dir", str(head), "--node-id", "host-a", "--node-id", "host-b",
        "--coordinator", "10.0.0.1:7443", "--certs", str(head / "tls"),
    )  # fmt: skip
    assert code == 0, err
    for node in ("host-a", "host-b"):
        folder = head / node
        _hints_match(out, folder / "agent.toml")
        modes = {str(p.relative_to(folder)): stat.S_IMODE(p.stat().st_mode) for p in folder.rglob("*") if p.is_file()}
        assert modes == {
            "agent.toml": 0o644,
            "join-token": 0o600,
            "tls/ca.pem": 0o644,
            "tls/agent.pem": 0o644,
            "tls/agent.key": 0o600,
            "tls/worker.pem": 0o644,
            "tls/worker.key": 0o600,
        }
        assert (folder / "tls/agent.key").read_bytes() == ca.agent(node).key.read_bytes()
        (folder / "join-token").write_text("a-token\n")
        agent = AgentConfig.load(folder / "agent.toml")  # loads with no edit but the token
        assert (agent.node_id, agent.coordinator, dict(agent.labels)) == (node, "10.0.0.1:7443", {})
        assert agent.join_token == "a-token" and Path(agent.tls.key_file) == folder / "tls/agent.key"
    assert f"meshgate token create --node-id host-a --node-id host-b --node-dirs {head}" in out
    assert "scp -rp NODE root@NODE:/etc/meshgate" in out and "useradd --system" in out

    # one --node-id, on the head, later (issue #34): a folder for that node as for many, beside
    # the head's own files and never over them (no refusal, no --force), and hints that are
    # the commands to run on the node, naming no path of the head's
    head_files = {p: p.read_bytes() for p in head.rglob("*") if p.is_file()}
    code, out, err = run_cli(
        capsys, "init", "agent", "--dir", str(head), "--node-id", "host-c", "--coordinator", "10.0.0.1:7443",
        "--certs", str(head / "tls"), "--systemd",
    )  # fmt: skip
    assert code != 0 and "agent-host-c.pem" in err and "--force" not in err  # no certificate for host-c yet
    host_c = issue_cert(head / "tls", "agent", "host-c")
    head_files = {p: p.read_bytes() for p in head.rglob("*") if p.is_file()}
    code, out, err = run_cli(
        capsys, "init", "agent", "--dir", str(head), "--node-id", "host-c", "--coordinator", "10.0.0.1:7443",
        "--certs", str(head / "tls"),
    )  # fmt: skip
    assert code == 0, err
    assert {p: p.read_bytes() for p in head_files} == head_files  # the head's files untouched
    assert (head / "host-c" / "tls" / "agent.pem").read_bytes() == host_c.cert.read_bytes()
    assert not (head / "agent.toml").exists() and "--force" not in out
    assert f"meshgate token create --node-id host-c --node-dirs {head}" in out
    assert "scp -rp host-c root@host-c:/etc/meshgate" in out
    assert "on host-c, start it: meshgate-agent --config /etc/meshgate/agent.toml" in out
    assert "on host-c, the [agent] run_as user: useradd" in out
    # the same again: the node's folder exists; refused, and --force would touch only it
    code, _, err = run_cli(capsys, "init", "agent", "--dir", str(head), "--node-id", "host-c")
    assert code == 1 and str(head / "host-c" / "agent.toml") in err
    assert all(str(head / "host-c") in name for name in err.split("overwrite ", 1)[1].split(" (")[0].split(", "))

    # no --node-id (run on the node itself): the files in --dir, the hints this node's
    single = tmp_path / "single"
    code, out, err = run_cli(capsys, "init", "agent", "--dir", str(single), "--certs", str(head / "tls"))
    assert code != 0  # --certs needs the node's id to pick its certificate
    code, out, err = run_cli(capsys, "init", "agent", "--dir", str(single))
    assert code == 0, err
    assert f"start it: meshgate-agent --config {single / 'agent.toml'}" in out

    # refusals: nothing written, the flag named
    code, _, err = run_cli(
        capsys, "init", "agent", "--dir", str(tmp_path / "x"), "--node-id", "c", "--certs", str(head / "tls")
    )
    assert code == 1 and "agent-c.pem" in err and not (tmp_path / "x").exists()
    code, _, err = run_cli(capsys, "init", "coordinator", "--dir", str(tmp_path / "y"), "--node-id", "c")
    assert code == 2 and "--node-id: only for `meshgate init agent`" in err and not (tmp_path / "y").exists()
    code, _, err = run_cli(capsys, "init", "agent", "--dir", str(tmp_path / "z"), "--node-id", "bad id")
    assert code == 1 and "'bad id'" in err and not (tmp_path / "z").exists()
    code, _, err = run_cli(capsys, "init", "agent", "--dir", str(tmp_path / "z"), "--coordinator", 'a"b')
    assert code == 1 and "--coordinator" in err and not (tmp_path / "z").exists()


def test_token_create_refuses_where_a_token_would_go_nowhere(tmp_path, capsys):
    """Checked before any coordinator is asked: several nodes need --node-dirs, and each
    node's folder must exist (a typo must not mint tokens that are then lost)."""
    code, _, err = run_cli(capsys, "token", "create", "--node-id", "a", "--node-id", "b", "--coordinator", "x:1")
    assert code == 2 and "several --node-id need --node-dirs" in err
    code, _, err = run_cli(
        capsys, "token", "create", "--node-id", "a", "--node-dirs", str(tmp_path), "--coordinator", "x:1"
    )
    assert code == 2 and f"--node-dirs: missing {tmp_path / 'a'}" in err
    code, _, err = run_cli(
        capsys, "token", "create", "--any-node", "--node-dirs", str(tmp_path), "--coordinator", "x:1"
    )
    assert code == 2 and "give --node-id" in err


def test_init_systemd_execstart_falls_back_to_usr_local_bin(tmp_path):
    from meshgate.init_cli import SHIPPED_BIN_DIR, entry_point_dir, outputs

    venv_bin = tmp_path / "venv" / "bin"
    venv_bin.mkdir(parents=True)
    (venv_bin / "meshgate-coordinator").write_text("#!/bin/sh\n")
    assert entry_point_dir(venv_bin) == SHIPPED_BIN_DIR  # meshgate-agent missing
    (venv_bin / "meshgate-agent").write_text("#!/bin/sh\n")
    assert entry_point_dir(venv_bin) == venv_bin
    spaced = tmp_path / "my venv" / "bin"  # ExecStart= would need quoting: keep the shipped path
    spaced.mkdir(parents=True)
    for name in ("meshgate-coordinator", "meshgate-agent"):
        (spaced / name).write_text("#!/bin/sh\n")
    assert entry_point_dir(spaced) == SHIPPED_BIN_DIR
    units = {o.name: o.text for o in outputs("systemd", venv_bin)}
    assert f"ExecStart={venv_bin}/meshgate-agent --config /etc/meshgate/agent.toml\n" in units["meshgate-agent.service"]
    assert "/usr/local/bin/meshgate-coordinator --config" not in units["meshgate-coordinator.service"]
    with pytest.raises(ValueError, match="quoting"):
        outputs("systemd", spaced)


# ---- host:port for IPv4, IPv6 and names -----------------------------------------------------


@pytest.mark.parametrize(
    "host, expected",
    [
        ("10.0.0.7", "tcp://10.0.0.7:29500"),
        ("gpu-node-00.cluster.local", "tcp://gpu-node-00.cluster.local:29500"),
        ("::1", "tcp://[::1]:29500"),
        ("fd00:1::5", "tcp://[fd00:1::5]:29500"),
        ("[fd00:1::5]", "tcp://[fd00:1::5]:29500"),
    ],
)
def test_init_method_brackets_ipv6_only(host, expected):
    from meshgate.client import World
    from meshgate.endpoints import join_host_port, tcp_init_method

    assert tcp_init_method(host, 29500) == expected
    assert join_host_port(host, 29500) == expected[len("tcp://") :]
    assert World("j", 0, 1, host, 29500).init_method == expected


def test_world_init_method_over_ipv6_loopback_joins_gloo(tmp_path):
    """A real one-rank gloo group through World.init_method on [::1]."""
    import socket

    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
            port = probe.getsockname()[1]
    except OSError:
        pytest.skip("no IPv6 loopback here")
    script = (
        "import sys, datetime, torch.distributed as dist\n"
        "from meshgate.client import World\n"
        f"world = World('j', 0, 1, '::1', {port})\n"
        "dist.init_process_group('gloo', init_method=world.init_method, rank=0, world_size=1,"
        " timeout=datetime.timedelta(seconds=30))\n"
        "print(world.init_method, dist.get_world_size())\n"
        "dist.destroy_process_group()\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        env=worker_env(GLOO_SOCKET_IFNAME=""),
        timeout=120,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"tcp://[::1]:{port} 1"


# ---- small things a newcomer meets (issue #34) ----------------------------------------------


def _subcommands(parser, prefix=()):
    import argparse

    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                yield (*prefix, name), child
                yield from _subcommands(child, (*prefix, name))


def test_every_usage_line_starts_with_its_own_command():
    commands = list(_subcommands(cli.build_parser()))
    assert ("certs", "issue") in [c for c, _ in commands] and ("init",) in [c for c, _ in commands]
    for command, parser in commands:
        usage = parser.format_usage()
        assert usage.startswith(f"usage: meshgate {' '.join(command)} "), usage


def test_init_examples_copies_every_example_out(tmp_path, capsys):
    target = tmp_path / "ex"
    code, out, err = run_cli(capsys, "init", "examples", "--dir", str(target))
    assert code == 0, err
    shipped = sorted(str(p.relative_to(REPO / "examples")) for p in (REPO / "examples").rglob("*") if p.is_file())
    copied = sorted(str(p.relative_to(target)) for p in target.rglob("*") if p.is_file())
    assert copied == shipped and "slurm/meshgate-job.sbatch" in copied and "fabric_train.py" in copied
    for name in shipped:
        assert (target / name).read_bytes() == (REPO / "examples" / name).read_bytes(), name
        assert f"wrote {target / name}" in out
    assert (target / "health" / "cpu_check.py").stat().st_mode & 0o111  # a #! script stays executable
    code, _, err = run_cli(capsys, "plan", "check", str(target / "plan-4.toml"))
    assert code == 0, err


def test_one_of_a_thing_is_singular():
    from meshgate.coordinator.cluster_state.scheduling import needs
    from meshgate.coordinator.jobspec import JobSpec
    from meshgate.words import counted

    assert (counted(1, "slot"), counted(4, "slot"), counted(0, "node")) == ("1 slot", "4 slots", "0 nodes")
    spec = JobSpec(job_id="j", plan=ParallelPlan(dp_shard=4), slots_per_node=1, num_nodes=4, command=("true",))
    assert needs(spec).startswith("needs 4 nodes of 1 slot"), needs(spec)
