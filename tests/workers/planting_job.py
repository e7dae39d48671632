"""A job that plants things where the agent works (stdlib only: the job user's
/usr/bin/python3.11 runs it). Local rank 0 plants, in every generation, one kind of
thing (PLANT_KIND) at every path the agent touches or once touched in and around the
job's directory, aimed at the files of PLANT_TARGETS (":"-separated, outside the job's
directory), and records what the kernel let it do. In generation 0 it then exits 1 (the
job restarts: the agent writes the plan again); in generation 1 every worker exits 0
(the job ends: the agent removes the directory). Local rank 1 waits to be killed in
generation 0.

Kinds: symlink, hardlink, fifo, dirswap (the work directory, or the directory the agent
holds it in, swapped for a link to a target's directory).
Record: PLANT_OUT/<job>-g<generation>-<local rank>.json.
"""

import json
import os
import shutil
import sys
import time

# Names the agent writes or wrote: the plan and its temporary names, old and new layouts.
AGENT_NAMES = ("plan.toml", ".plan.toml.partial", "meshgate-plan.toml", "meshgate-plan.toml.partial")


def attempt(results: dict, label: str, action) -> None:
    try:
        action()
        results[label] = "done"
    except OSError as exc:
        results[label] = type(exc).__name__


def plant(kind: str, targets: list[str], job: str) -> dict:
    work = os.getcwd()
    run_root = os.path.dirname(work)
    results: dict[str, str] = {}
    places = [os.path.join(work, n) for n in AGENT_NAMES] + [os.path.join(run_root, n) for n in AGENT_NAMES]
    places += [os.path.join(work, f"{kind}-{i}") for i in range(len(targets))]
    for place in places:
        target = targets[hash(place) % len(targets)]
        if kind == "symlink":
            attempt(results, place, lambda: os.symlink(target, place))
            attempt(results, place + "->dir", lambda: os.symlink(os.path.dirname(target), place + ".d"))
        elif kind == "hardlink":
            attempt(results, place, lambda: os.link(target, place))
        elif kind == "fifo":
            attempt(results, place, lambda: os.mkfifo(place))
    for shared in ("/tmp", "/dev/shm"):  # where a job user's leftovers are removed at the job's end
        link = os.path.join(shared, f"mg-plant-{job}-{os.getpid()}")
        attempt(results, link, lambda: os.symlink(os.path.dirname(targets[0]), link))
    if kind == "dirswap":
        # the work directory for a link to a target's directory: needs to write the agent's
        # directory that holds it (refused); inside work, a link to a directory to descend
        attempt(results, "rename work", lambda: os.rename(work, work + ".old"))
        attempt(results, "link in run root", lambda: os.symlink(os.path.dirname(targets[0]), run_root + "/work2"))
        attempt(results, "rmdir run root", lambda: shutil.rmtree(run_root))
        for i, target in enumerate(targets):
            link, nested = os.path.join(work, f"d{i}"), os.path.join(work, f"nest{i}", "deeper", "up")
            attempt(results, link, lambda: os.symlink(os.path.dirname(target), link))
            os.makedirs(os.path.dirname(nested), exist_ok=True)
            attempt(results, nested, lambda: os.symlink(os.path.dirname(target), nested))
    return results


def main() -> int:
    kind = os.environ["PLANT_KIND"]
    targets = os.environ["PLANT_TARGETS"].split(":")
    job = os.environ.get("MESHGATE_JOB", "")
    unit = open("/proc/self/cgroup").read().strip().splitlines()[-1].rsplit("/", 1)[-1]  # job-<job>-g<generation>
    generation = int(unit.rsplit("-g", 1)[1])
    local_rank = int(os.environ["LOCAL_RANK"])
    record = {"pid": os.getpid(), "uid": os.getuid(), "cwd": os.getcwd(), "generation": generation}
    plan = os.environ.get("MESHGATE_PLAN_FILE", "")
    record["plan_file"] = plan
    try:
        record["plan_text"] = open(plan).read()
    except OSError as exc:
        record["plan_text"] = type(exc).__name__
    if local_rank == 0:
        record["planted"] = plant(kind, targets, job)
    out = os.path.join(os.environ["PLANT_OUT"], f"{job}-g{generation}-{local_rank}.json")
    with open(out + ".tmp", "w") as handle:
        json.dump(record, handle)
    os.rename(out + ".tmp", out)
    if generation >= 1:
        return 0
    if local_rank == 0:
        # Exit only once local rank 1 has recorded too: the agent stops it the moment this
        # exit is seen (it waits on its workers, it does not poll them).
        peer = os.path.join(os.environ["PLANT_OUT"], f"{job}-g{generation}-1.json")
        deadline = time.monotonic() + 30
        while not os.path.exists(peer) and time.monotonic() < deadline:
            time.sleep(0.05)
        return 1
    while True:
        time.sleep(60)


if __name__ == "__main__":
    sys.exit(main())
