"""The Ray Train driver of tests/test_ray_netns.py, run inside the head host's network
namespace (a Ray driver runs on a node of its cluster): RayTrainLauncher.fit() of a job
across the two simulated hosts, each worker recording what it saw (at init_process_group,
through tests/workers/ray_init_recorder.py, and after an all_reduce across the hosts).

    python ray_netns_driver.py HEAD COORDINATOR JOB BUNDLE OUT [--without-fix]

--without-fix: meshgate's interface step left out of the trainer (a throwaway run showing
the failure the step prevents). Exits 0 when fit() returned, 1 with the error printed."""

from __future__ import annotations

import argparse
import sys
import traceback
from pathlib import Path


def record_to(out: str):
    def record(config):  # a closure: cloudpickled by value into the workers
        import json
        import os

        import ray
        import torch
        import torch.distributed as dist

        from meshgate.launchers.ray import current_attestation

        attestation = current_attestation()
        value = torch.tensor([attestation.rank + 1], dtype=torch.int64)
        dist.all_reduce(value)  # across the hosts: gloo's pairs on both namespaces' interfaces
        result = {
            "rank": attestation.rank,
            "node": attestation.node_id,
            "node_ip": ray.util.get_node_ip_address(),
            "sum": int(value.item()),
            "ifnames": {k: os.environ.get(k) for k in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")},
        }
        Path(out, f"rank{attestation.rank}.json").write_text(json.dumps(result))

    return record


def main() -> int:
    parser = argparse.ArgumentParser()
    for name in ("head", "coordinator", "job", "bundle", "out"):
        parser.add_argument(name)
    parser.add_argument("--without-fix", action="store_true")
    parser.add_argument("--timeout", type=int, default=60)
    args = parser.parse_args()

    import ray
    from ray.train import RunConfig

    import meshgate.launchers.ray as ray_launcher
    from meshgate.plan import ParallelPlan
    from tests.workers.ray_init_recorder import RecordingTorchConfig

    if args.without_fix:
        ray_launcher.with_agent_interface = lambda config: config
    out = Path(args.out)
    inits = out / "init"
    inits.mkdir(parents=True, exist_ok=True)
    ray.init(address=args.head, log_to_driver=False, configure_logging=False)
    try:
        launcher = ray_launcher.RayTrainLauncher(
            ParallelPlan(dp_shard=2),
            coordinator=args.coordinator,
            job_id=args.job,
            trust_bundle=args.bundle,
            train_loop_per_worker=record_to(str(out)),
            resources_per_worker={"CPU": 1},
            world_timeout=args.timeout,
            torch_config=RecordingTorchConfig(out=str(inits), timeout_s=args.timeout),
            run_config=RunConfig(name=args.job, storage_path=str(out / "results")),
        )
        launcher.fit()
    except Exception:
        traceback.print_exc()
        print("FIT FAILED", flush=True)
        return 1
    finally:
        ray.shutdown()
    print("FIT RETURNED", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
