"""Ray node labels that name meshgate nodes, so Ray can be told where each worker goes.

Each node's agent writes its Ray labels to a file (``[agent] ray_labels_file``, default
``<state_dir>/ray-labels.yaml``) that the node's Ray starts with::

    ray start --address=HEAD:6379 --labels-file=/var/lib/meshgate/agent/ray-labels.yaml

    meshgate.io/node-id: "gpu-node-07"
    meshgate.io/switch: "s1"
    meshgate.io/rack: "r4"

``RayTrainLauncher`` then passes Ray Train one label selector per worker (worker ``i`` on
the node that holds meshgate rank ``i``), so Ray's world ranks are meshgate's ranks. Pure
(no Ray import): the agent and the launcher share these functions.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Mapping, Sequence

LABEL_PREFIX = "meshgate.io/"
NODE_ID_LABEL = LABEL_PREFIX + "node-id"
# Ray's label syntax (Kubernetes'): a name or value is 1-63 characters, alphanumeric at both
# ends, with "-", "_" and "." between.
_RAY_LABEL = re.compile(r"[A-Za-z0-9]([A-Za-z0-9_.-]{0,61}[A-Za-z0-9])?")

__all__ = [
    "LABEL_PREFIX",
    "NODE_ID_LABEL",
    "label_selectors",
    "node_label_value",
    "ray_node_labels",
    "write_labels_file",
]


def node_label_value(node_id: str) -> str:
    """``node_id`` as a Ray label value: itself when Ray's syntax allows it, else a digest
    of it (a meshgate node id may hold ":", "@", "/" or be longer than 63 characters)."""
    if _RAY_LABEL.fullmatch(node_id):
        return node_id
    return "sha256-" + hashlib.sha256(node_id.encode()).hexdigest()[:48]


def ray_node_labels(node_id: str, labels: Mapping[str, str] = {}) -> dict[str, str]:
    """The Ray labels of the node ``node_id`` with the agent's topology ``labels`` (switch,
    rack, ...) under ``meshgate.io/``; a topology label Ray's syntax cannot hold is left out."""
    ray_labels = {NODE_ID_LABEL: node_label_value(node_id)}
    for key, value in sorted(labels.items()):
        if _RAY_LABEL.fullmatch(key) and _RAY_LABEL.fullmatch(value):
            ray_labels[LABEL_PREFIX + key] = value
    return ray_labels


def label_selectors(nodes: Sequence[str], slots_per_node: int) -> list[dict[str, str]]:
    """One Ray Train label selector per worker, in world-rank order: the node of rank
    ``r`` is ``nodes[r // slots_per_node]`` (meshgate's node-contiguous rank blocks)."""
    return [{NODE_ID_LABEL: node_label_value(node)} for node in nodes for _ in range(slots_per_node)]


def write_labels_file(path: Path, labels: Mapping[str, str]) -> None:
    """Write ``labels`` for ``ray start --labels-file`` (JSON is YAML), readable by any user
    (Ray may run as another user than the agent), replacing the file atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(dict(labels), indent=1, sort_keys=True) + "\n", encoding="utf-8")
    os.chmod(partial, 0o644)
    os.replace(partial, path)
