"""The agent as its shipped systemd unit starts it (tests/shipped.py): the unit and the
fixture cannot drift apart, the started process is what the unit says, and a one-node
jobs-mode cluster of such agents runs a job."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from shipped import (
    NOT_REPRODUCED,
    REPRODUCED,
    UNIT,
    ShippedCluster,
    ShippedHost,
    ShippedUnit,
    UnitDrift,
    cap_mask,
    cgroup2_mount,
    check_keys,
    parse_service,
)
import shipped

# the fixtures, from tests/shipped.py
shipped_host = shipped.shipped_host
shipped_cluster = shipped.shipped_cluster

SYSTEM_PYTHON = "/usr/bin/python3.11"


def test_every_key_of_the_unit_is_reproduced_or_listed_with_a_reason():
    service = parse_service(UNIT)
    assert not set(REPRODUCED) & set(NOT_REPRODUCED)
    check_keys(service)
    assert all(reason.strip() for reason in NOT_REPRODUCED.values())
    unit = ShippedUnit.load(UNIT)  # and every reproduced value is one the fixture understands
    # repeated keys accumulate, in order
    assert [ident for ident, _ in unit.credentials] == [v.split(":", 1)[0] for v in service["LoadCredential"]]
    assert len(unit.credentials) == len(service["LoadCredential"]) >= 1


def test_a_key_the_fixture_does_not_know_fails_it_by_name(tmp_path):
    text = UNIT.read_text().replace("[Service]\n", "[Service]\nMemoryDenyWriteExecute=yes\n", 1)
    drifted = tmp_path / UNIT.name
    drifted.write_text(text)
    with pytest.raises(UnitDrift, match=r"\['MemoryDenyWriteExecute'\].*neither reproduces"):
        ShippedUnit.load(drifted)
    # a value it cannot reproduce is named too (the last assignment wins, as in systemd)
    drifted.write_text(UNIT.read_text().replace("[Install]", "ProtectSystem=sideways\n\n[Install]"))
    with pytest.raises(UnitDrift, match="ProtectSystem=sideways"):
        ShippedUnit.load(drifted)


def _mount_of(pid: int, path: Path) -> tuple[str, str, str]:
    """(mount point, fs type, per-mount options) of the mount ``path`` lies on, as ``pid`` sees it."""
    best = ("", "", "")
    with open(f"/proc/{pid}/mountinfo", encoding="utf-8") as handle:
        for line in handle:
            fields = line.split()
            point, options = fields[4], fields[5]
            fstype = fields[fields.index("-") + 1]
            if (str(path) == point or str(path).startswith(point.rstrip("/") + "/")) and len(point) >= len(best[0]):
                best = (point, fstype, options)
    return best


@pytest.mark.slow
def test_the_started_agent_is_what_the_unit_says(shipped_cluster):
    cluster = shipped_cluster
    host, unit = cluster.host, cluster.host.unit
    agent = cluster.agents["n0"]
    status = agent.status()
    pid = agent.process.pid
    uid, gid = host.agent_user.pw_uid, host.group_gid
    assert status["Uid"].split() == [str(uid)] * 4, status["Uid"]
    assert status["Gid"].split() == [str(gid)] * 4, status["Gid"]
    assert {int(g) for g in status["Groups"].split()} == set(host.groups), status["Groups"]
    assert len(host.groups) >= 1 + len(unit.supplementary_groups)
    assert status["Umask"] == f"{unit.umask:04o}"
    caps = cap_mask(unit.ambient_caps)
    if unit.bounding_caps is not None:
        assert int(status["CapBnd"], 16) == cap_mask(unit.bounding_caps), status["CapBnd"]
    assert int(status["CapEff"], 16) == caps and int(status["CapPrm"], 16) == caps, status
    # The agent clears its ambient set at start, so no worker inherits one (SECURITY.md,
    # "Jobs"); what the unit handed it shows in a probe started the same way.
    assert int(status["CapAmb"], 16) == 0, status["CapAmb"]
    probe = agent.probe(["/bin/cat", "/proc/self/status"])
    assert probe.returncode == 0, probe.stderr
    probed = dict(line.split(":\t", 1) for line in probe.stdout.splitlines() if ":\t" in line)
    assert int(probed["CapAmb"], 16) == caps and int(probed["CapEff"], 16) == caps, probed
    assert status["NoNewPrivs"] == ("1" if unit.no_new_privileges else "0")

    # Delegate=yes: in its own cgroup, the agent user's, with the files systemd hands over
    if unit.delegate:
        mount = cgroup2_mount()
        with open(f"/proc/{pid}/cgroup", encoding="utf-8") as handle:
            line = next(x for x in handle if x.startswith("0::"))
        assert line.strip() == f"0::/{agent.cgroup.relative_to(mount)}", line
        for name in ("", "cgroup.procs", "cgroup.threads", "cgroup.subtree_control"):
            assert (agent.cgroup / name).stat().st_uid == uid, name
        # the agent made its subtree there: one cgroup per job run goes under it
        assert (agent.cgroup / "meshgate").is_dir()
        assert f"containment: one cgroup v2 per job run under {agent.cgroup}/meshgate/" in agent.log()

    # StateDirectory= and LoadCredential=
    state = agent.state_dir
    assert state.stat().st_uid == uid and stat.S_IMODE(state.stat().st_mode) == unit.state_directory_mode
    creds = agent.credentials_dir
    assert (creds.stat().st_uid, oct(stat.S_IMODE(creds.stat().st_mode))) == (uid, "0o500")
    for ident, _ in unit.credentials:
        found = (creds / ident).stat()
        assert (found.st_uid, oct(stat.S_IMODE(found.st_mode))) == (uid, "0o400"), ident

    # Its own mount namespace, with the unit's read-only mounts
    assert os.readlink(f"/proc/{pid}/ns/mnt") != os.readlink("/proc/self/ns/mnt")
    assert "rw" in _mount_of(pid, state)[2].split(","), _mount_of(pid, state)
    read_only = {"yes": ["/usr"], "full": ["/usr", "/etc"], "strict": ["/usr", "/etc", "/var", "/"]}
    for path in read_only.get(unit.protect_system, []):
        assert "ro" in _mount_of(pid, Path(path))[2].split(","), (path, _mount_of(pid, Path(path)))
    if unit.protect_home == "read-only" and os.path.isdir("/root"):
        assert "ro" in _mount_of(pid, Path("/root"))[2].split(",")
    if unit.protect_kernel_tunables:
        assert "ro" in _mount_of(pid, Path("/proc/sys"))[2].split(",")
        assert "ro" in _mount_of(pid, Path("/sys/kernel"))[2].split(",")
        assert "rw" in _mount_of(pid, agent.cgroup or cgroup2_mount())[2].split(",")  # Delegate= needs it
    for path in [agent.credentials_dir] if unit.credentials else []:
        assert "ro" in _mount_of(pid, path)[2].split(","), _mount_of(pid, path)
    if unit.private_tmp:
        assert _mount_of(pid, Path("/tmp"))[:2] == ("/tmp", "tmpfs"), _mount_of(pid, Path("/tmp"))

    # systemd's environment, nothing of the test's
    with open(f"/proc/{pid}/environ", "rb") as handle:
        environ = dict(e.split("=", 1) for e in handle.read().decode().split("\0") if "=" in e)
    assert "PYTEST_CURRENT_TEST" not in environ and environ["USER"] == host.agent_user.pw_name
    if unit.type == "notify":
        assert environ["NOTIFY_SOCKET"].startswith("@")
    # ExecStart's argv shape: <entry point> --config <agent.toml>
    with open(f"/proc/{pid}/cmdline", "rb") as handle:
        cmdline = handle.read().decode().split("\0")[:-1]
    assert cmdline[-len(unit.exec_start) :][1:] == agent.argv()[1:]
    assert cmdline[-len(unit.exec_start)] == host.entry_point and Path(cmdline[0]).name.startswith("python")


@pytest.mark.slow
def test_a_tiny_job_runs_on_a_one_node_cluster_as_shipped(shipped_cluster):
    """Before the privileged launcher the agent died here: it chmod'ed the job directory it
    had just chowned to the job user (CAP_FOWNER, which the unit does not give), and with
    CAP_FOWNER subprocess chdir()ed into the job user's 0700 directory as the agent."""
    from meshgate.v1 import rendezvous_pb2 as pb

    cluster = shipped_cluster
    cluster.submit("tiny", [SYSTEM_PYTHON, "-c", "print(1)"])
    ended = cluster.wait_ended("tiny")
    assert ended.state == pb.SUCCEEDED, cluster.logs()


@pytest.mark.slow
def test_the_host_leaves_no_user_group_cgroup_process_or_file_behind_even_on_failure(shipped_host):
    """A host of its own, a cluster in it, and a failure: everything made is gone after."""
    import grp
    import pwd

    made = {}
    with pytest.raises(RuntimeError, match="a test failed here"):
        with ShippedHost.create() as host, ShippedCluster(host, ("n0",)) as cluster:
            agent = cluster.agents["n0"]
            made = {
                "users": list(host.created_users),
                "groups": list(host.created_groups),
                "cgroup": host.cgroup,
                "root": host.root,
                "pids": [agent.process.pid, cluster.coordinator.process.pid],
            }
            raise RuntimeError("a test failed here")
    assert len(made["users"]) == 2
    for name in made["users"]:
        with pytest.raises(KeyError):
            pwd.getpwnam(name)
    for name in made["groups"]:
        with pytest.raises(KeyError):
            grp.getgrnam(name)
    assert not made["root"].exists()
    assert made["cgroup"] is None or not made["cgroup"].exists()
    for pid in made["pids"]:
        assert not os.path.exists(f"/proc/{pid}") or "Z" in Path(f"/proc/{pid}/stat").read_text().split(")")[-1][:3]
