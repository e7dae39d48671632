"""A user's own TorchConfig that records, in each Ray Train worker, the interface variables
at the moment Ray Train calls ``torch.distributed.init_process_group`` (its backend wraps
that call in the worker before the process group is made). tests/test_ray_cluster.py passes
it to RayTrainLauncher(torch_config=...): imported as ``tests.workers.ray_init_recorder``
on both sides (the driver's and the Ray nodes' PYTHONPATH hold the repository)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from ray.train.torch import TorchConfig

IFNAME_ENVS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


def record_at_init(out: str) -> None:
    """In the worker: wrap init_process_group so that its call writes what it saw."""
    import torch.distributed as dist

    init = dist.init_process_group

    def recording(*args, **kwargs):
        rank = kwargs.get("rank", os.environ.get("RANK"))
        seen = {name: os.environ.get(name) for name in IFNAME_ENVS}
        seen["MESHGATE_AGENT_SOCKET"] = os.environ.get("MESHGATE_AGENT_SOCKET")
        Path(out, f"init{rank}.json").write_text(json.dumps(seen))
        return init(*args, **kwargs)

    dist.init_process_group = recording


class RecordingBackend(TorchConfig().backend_cls):
    def on_start(self, worker_group, backend_config):
        worker_group.execute(record_at_init, backend_config.out)
        super().on_start(worker_group, backend_config)


@dataclass
class RecordingTorchConfig(TorchConfig):
    out: str = ""

    @property
    def backend_cls(self):
        return RecordingBackend
