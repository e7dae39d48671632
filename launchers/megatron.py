"""Megatron-core ``parallel_state`` from a verified attestation, and cross-checked against it.

How the plan maps onto Megatron-core (checked against megatron-core 0.16):

* Megatron's ``order`` string lists the innermost axis first, as the plan does. Megatron
  has one data-parallel axis ``dp`` (and ``ep`` just inside it for the expert layout), so
  the plan's ``dp_shard`` must sit directly inside ``dp_replicate``; the order string is
  the plan's order with ``dp_shard, dp_replicate`` replaced by ``ep-dp``. The default
  plan order gives Megatron's default ``tp-cp-ep-dp-pp``. A dp axis of size 1 may sit
  anywhere (it does not change the layout).
* ``dp_replicate > 1`` maps onto ``num_distributed_optimizer_instances = dp_replicate``.
  Megatron then cuts every dp-cp group into that many contiguous slices: the
  intra-instance groups (``get_data_parallel_group(with_context_parallel=True,
  partial_data_parallel=True)``) are the plan's ``dp_shard_cp`` groups, and the
  inter-instance groups (``get_inter_distributed_optimizer_instance_group()``, cut from
  the expert data-parallel groups) are the plan's ``dp_replicate`` groups. That holds
  only when cp sits inside dp in the order and the expert layout agrees; meshgate
  predicts Megatron's groups before creating any (:func:`check_megatron_layout`) and
  refuses the plans where they would differ from the plan's.
* tp, pp, cp, ep and etp pass through as Megatron's sizes.

:func:`initialize_megatron_from` refuses a plan Megatron cannot express with
:class:`MegatronPlanError` before any process group exists, calls
``initialize_model_parallel``, then compares Megatron's groups with the plan's through
Megatron's own accessors (:func:`verify_megatron_groups`, also usable after a framework
such as Megatron-Bridge initialized ``parallel_state`` itself). A disagreement raises
``meshgate.launchers.mesh.MeshMismatchError``.

megatron-core and torch are imported lazily: importing this module needs only meshgate.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence

from meshgate.launchers.mesh import (
    MeshMismatchError,
    _check_world,
    _GroupCheck,
    _import_torch,
    _verify_groups,
)
from meshgate.extras import install_hint, require
from meshgate.plan import ParallelPlan, PlanError

if TYPE_CHECKING:  # pragma: no cover
    from meshgate.attestation import VerifiedAttestation

MEGATRON_EXTRA = install_hint("megatron")

__all__ = [
    "MegatronLayout",
    "MegatronPlanError",
    "MeshMismatchError",
    "check_megatron_layout",
    "initialize_megatron_from",
    "megatron_layout",
    "megatron_order",
    "predicted_groups",
    "verify_megatron_groups",
]

logger = logging.getLogger(__name__)


class MegatronPlanError(PlanError):
    """A plan that Megatron-core cannot express. Raised before any process group exists."""


def _import_parallel_state() -> Any:
    _import_torch()
    return require("megatron.core.parallel_state", extra="megatron", feature="meshgate.launchers.megatron")


# ---- the mapping: pure functions of the plan ---------------------------------------------


@dataclass(frozen=True)
class MegatronLayout:
    """The ``initialize_model_parallel`` arguments that express a plan."""

    order: str
    tensor_model_parallel_size: int
    pipeline_model_parallel_size: int
    context_parallel_size: int
    expert_model_parallel_size: int
    expert_tensor_parallel_size: int
    num_distributed_optimizer_instances: int

    def kwargs(self) -> dict[str, Any]:
        return asdict(self)


def megatron_order(plan: ParallelPlan) -> str:
    """Megatron's order string (innermost first) for the plan, or MegatronPlanError.

    Like ``plan.megatron_order()``, but a dp axis of size 1 may sit anywhere in the
    plan's order: moving it does not change which rank sits where.
    """
    order = list(plan.order)
    if plan.dp_replicate == 1:
        order.remove("dp_replicate")
        order.insert(order.index("dp_shard") + 1, "dp_replicate")
    elif plan.dp_shard == 1:
        order.remove("dp_shard")
        order.insert(order.index("dp_replicate"), "dp_shard")
    try:
        return ParallelPlan(
            **{k: v for k, v in plan.to_dict().items() if k != "order"}, order=tuple(order)
        ).megatron_order()
    except PlanError as exc:
        raise MegatronPlanError(f"plan {plan.describe()}: {exc}") from None


def _parse_megatron_order(order: str) -> str:
    tokens = [t.strip() for t in order.split("-")]
    known = {"tp", "pp", "dp", "ep", "cp"}
    if not tokens or set(tokens) - known or len(set(tokens)) != len(tokens):
        raise MegatronPlanError(
            f"order {order!r} is not a Megatron order string (distinct tokens of "
            f"{', '.join(sorted(known))}, innermost first)"
        )
    return "-".join(tokens)


def megatron_layout(plan: ParallelPlan, order: str | None = None) -> MegatronLayout:
    """Megatron's arguments for the plan; MegatronPlanError if it has none.

    ``order`` (a Megatron order string) replaces the derived one. Only the order string
    and the sizes: :func:`check_megatron_layout` tells whether the groups Megatron builds
    from them are the plan's.
    """
    return MegatronLayout(
        order=megatron_order(plan) if order is None else _parse_megatron_order(order),
        tensor_model_parallel_size=plan.tp,
        pipeline_model_parallel_size=plan.pp,
        context_parallel_size=plan.cp,
        expert_model_parallel_size=plan.ep,
        expert_tensor_parallel_size=plan.etp,
        num_distributed_optimizer_instances=plan.dp_replicate,
    )


def _prefix_product(values: Sequence[int]) -> list[int]:
    out, acc = [1], 1
    for value in values:
        acc *= value
        out.append(acc)
    return out


def _rank_groups(world: int, sizes: dict[str, int], order: str, token: str) -> list[list[int]]:
    """Megatron's ``RankGenerator(...).get_ranks(token)``, rewritten without torch.

    Mirrors ``generate_masked_orthogonal_rank_groups`` (members in Megatron's order,
    the first listed token varying fastest); the tests compare it with Megatron's.
    """
    tokens = order.split("-")
    for name in sizes:
        if name not in tokens:
            tokens.append(name)
    shape = [sizes[t] for t in tokens]
    mask = [t in token.split("-") for t in tokens]
    stride = _prefix_product(shape)
    masked_shape = [s for s, m in zip(shape, mask) if m]
    masked_stride = [d for d, m in zip(stride, mask) if m]
    unmasked_shape = [s for s, m in zip(shape, mask) if not m]
    unmasked_stride = [d for d, m in zip(stride, mask) if not m]
    group_size = _prefix_product(masked_shape)[-1]

    def decompose(index: int, dims: Sequence[int]) -> list[int]:
        strides = _prefix_product(dims)
        return [(index // d) % s for s, d in zip(dims, strides)]

    groups = []
    for group_index in range(world // group_size):
        base = sum(i * d for i, d in zip(decompose(group_index, unmasked_shape), unmasked_stride))
        groups.append(
            [base + sum(i * d for i, d in zip(decompose(r, masked_shape), masked_stride)) for r in range(group_size)]
        )
    return groups


def predicted_groups(plan: ParallelPlan, layout: MegatronLayout) -> dict[str, list[tuple[int, ...]]]:
    """The groups Megatron-core builds from ``layout``, by plan axis, as torch orders them.

    Mirrors ``initialize_model_parallel``: the decoder and expert rank generators, the
    intra-instance slices of the dp-cp groups and the inter-instance groups cut from the
    expert data-parallel groups. torch sorts a new group's ranks, so each is sorted.
    Raises MegatronPlanError where Megatron itself would stop half way (its asserts).
    """
    world = plan.world_size
    tp = layout.tensor_model_parallel_size
    pp = layout.pipeline_model_parallel_size
    cp = layout.context_parallel_size
    ep, etp = layout.expert_model_parallel_size, layout.expert_tensor_parallel_size
    instances = layout.num_distributed_optimizer_instances
    dp = world // (tp * pp * cp)
    edp = world // (etp * ep * pp)
    decoder = {"tp": tp, "pp": pp, "dp": dp, "ep": 1, "cp": cp}
    expert = {"tp": etp, "pp": pp, "dp": edp, "ep": ep, "cp": 1}
    order = layout.order
    for name, size in {**decoder, "ep": ep}.items():
        if size > 1 and name not in order.split("-"):
            raise MegatronPlanError(f"order {order!r} does not name {name!r} (size {size})")
    if not (order.endswith("pp") or pp == 1 or edp == dp):
        raise MegatronPlanError(
            f"Megatron-core needs pp outermost (order {order!r}) unless the expert data-parallel "
            f"size ({edp}) equals the data-parallel size ({dp})"
        )
    if (dp * cp) % instances or edp % instances:
        raise MegatronPlanError(
            f"dp_replicate={instances} (num_distributed_optimizer_instances) must divide both "
            f"dp*cp={dp * cp} and the expert data-parallel size {edp}"
        )

    def gen(sizes: dict[str, int], token: str) -> list[list[int]]:
        return _rank_groups(world, sizes, order, token)

    if sorted(map(sorted, gen(decoder, "pp"))) != sorted(map(sorted, gen(expert, "pp"))):
        raise MegatronPlanError(f"order {order!r}: Megatron-core's expert layout would cut different pp groups")
    dp_cp = gen(decoder, "dp-cp")
    out: dict[str, list[list[int]]] = {
        "tp": gen(decoder, "tp"),
        "pp": gen(decoder, "pp"),
        "cp": gen(decoder, "cp"),
        "dp": gen(decoder, "dp"),
        "dp_cp": dp_cp,
        "etp": gen(expert, "tp"),
        "ep": gen(expert, "ep"),
        "edp": gen(expert, "dp"),
    }
    intra = (dp * cp) // instances
    if instances > 1:
        out["dp_shard_cp"] = [g[i * intra : (i + 1) * intra] for g in dp_cp for i in range(instances)]
        expert_intra = edp // instances
        out["dp_replicate"] = [
            [g[s * expert_intra + u] for s in range(instances)] for g in out["edp"] for u in range(expert_intra)
        ]
    else:
        out["dp_shard_cp"] = dp_cp
    return {axis: sorted(tuple(sorted(g)) for g in groups) for axis, groups in out.items()}


def check_megatron_layout(plan: ParallelPlan, layout: MegatronLayout | None = None) -> MegatronLayout:
    """The layout (default: :func:`megatron_layout`), if Megatron's groups are the plan's.

    Pure: creates nothing. Raises MegatronPlanError naming the first axis whose groups
    would differ, with an example group of each side.
    """
    layout = layout or megatron_layout(plan)
    predicted = predicted_groups(plan, layout)
    for axis, groups in predicted.items():
        planned = sorted(plan.groups(axis))
        if planned != groups:
            plan_only = sorted(set(planned) - set(groups))
            megatron_only = sorted(set(groups) - set(planned))
            example_plan = plan_only[0] if plan_only else planned[0]
            example_megatron = megatron_only[0] if megatron_only else groups[0]
            raise MegatronPlanError(
                f"Megatron-core cannot express plan {plan.describe()} with order "
                f"{layout.order!r} and num_distributed_optimizer_instances="
                f"{layout.num_distributed_optimizer_instances}: axis {axis!r} would have group "
                f"{list(example_megatron)}, the plan has {list(example_plan)}"
            )
    return layout


# ---- initialize and check --------------------------------------------------------------


def verify_megatron_groups(attestation: "VerifiedAttestation", *, device: Any = None) -> None:
    """Check the initialized ``parallel_state`` against the attestation. A collective.

    Ranks through Megatron's getters (get_tensor_model_parallel_rank() and its pipeline,
    context, data and expert counterparts); members through its get_*_group() accessors
    and torch.distributed.get_process_group_ranks; one all_gather per group. Usable on
    its own after another framework (e.g. Megatron-Bridge) initialized parallel_state.
    Raises MeshMismatchError.
    """
    ps = _import_parallel_state()
    _check_world(attestation, "Megatron-core")
    if not ps.model_parallel_is_initialized():
        raise RuntimeError("Megatron-core parallel_state is not initialized")
    _, dist = _import_torch()

    def entry(axis: str, group: Callable[[], Any], rank: Callable[[], int]) -> _GroupCheck:
        return _GroupCheck(axis, group(), rank())

    checks = [
        entry("tp", ps.get_tensor_model_parallel_group, ps.get_tensor_model_parallel_rank),
        entry("pp", ps.get_pipeline_model_parallel_group, ps.get_pipeline_model_parallel_rank),
        entry("cp", ps.get_context_parallel_group, ps.get_context_parallel_rank),
        entry("dp", ps.get_data_parallel_group, ps.get_data_parallel_rank),
        entry(
            "dp_cp",
            lambda: ps.get_data_parallel_group(with_context_parallel=True),
            lambda: ps.get_data_parallel_rank(with_context_parallel=True),
        ),
        entry(
            "dp_shard_cp",
            lambda: ps.get_data_parallel_group(with_context_parallel=True, partial_data_parallel=True),
            lambda: ps.get_data_parallel_rank(with_context_parallel=True, partial_data_parallel=True),
        ),
        entry("ep", ps.get_expert_model_parallel_group, ps.get_expert_model_parallel_rank),
        entry("etp", ps.get_expert_tensor_parallel_group, ps.get_expert_tensor_parallel_rank),
        entry("edp", ps.get_expert_data_parallel_group, ps.get_expert_data_parallel_rank),
    ]
    inter = ps.get_inter_distributed_optimizer_instance_group(check_initialized=False)
    if inter is not None or attestation.plan.dp_replicate > 1:
        checks.append(_GroupCheck("dp_replicate", inter, dist.get_rank(inter) if inter is not None else None))
    if isinstance(checks[1].group, list):  # a rank in several pipelines: not a plan's layout
        checks[1] = _GroupCheck("pp", None, checks[1].coordinate)
    _verify_groups(attestation, checks, framework="Megatron-core", device=device)


_SET_BY_PLAN = (
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
    "context_parallel_size",
    "expert_model_parallel_size",
    "expert_tensor_parallel_size",
    "num_distributed_optimizer_instances",
)


def initialize_megatron_from(
    attestation: "VerifiedAttestation",
    *,
    order: str | None = None,
    device: Any = None,
    **kwargs: Any,
) -> MegatronLayout:
    """``parallel_state.initialize_model_parallel`` for the attested plan, cross-checked.

    torch.distributed must already run with the attested rank and world size. A plan
    Megatron cannot express (see the module doc) raises MegatronPlanError before any
    process group is created; so does a dp_replicate > 1 without the ``einops`` package,
    which Megatron needs for its inter-instance groups. Other keyword arguments go to
    ``initialize_model_parallel`` (e.g. ``distributed_timeout_minutes``,
    ``create_gloo_process_groups``, ``virtual_pipeline_model_parallel_size``); the sizes
    come from the plan, and a conflicting one is refused.

    ``order`` overrides the derived order string, for debugging and for testing the
    cross-check: the groups of an overridden order are not predicted, Megatron builds
    them and the cross-check compares them with the plan.

    After creation, Megatron's groups are compared with the plan's
    (:func:`verify_megatron_groups`); on a mismatch, parallel_state is destroyed again and
    MeshMismatchError is raised. Returns the layout used.
    """
    ps = _import_parallel_state()
    _check_world(attestation, "Megatron-core")
    plan = attestation.plan
    if order is None:
        layout = check_megatron_layout(plan)
    else:
        layout = megatron_layout(plan, order)
        predicted_groups(plan, layout)  # Megatron's own asserts, before any group exists
        try:
            derived = megatron_order(plan)
        except MegatronPlanError:
            derived = None
        if layout.order != derived:
            logger.warning(
                "initialize_megatron_from: order %r overrides the plan's; the groups are "
                "checked only after Megatron-core has built them",
                layout.order,
            )
    for name in _SET_BY_PLAN:
        if name in kwargs and kwargs[name] != getattr(layout, name):
            raise MegatronPlanError(
                f"{name}={kwargs[name]!r} conflicts with the attested plan, which gives "
                f"{getattr(layout, name)} ({plan.describe()})"
            )
        kwargs.pop(name, None)
    if layout.num_distributed_optimizer_instances > 1:
        require(
            "einops",
            extra="megatron",
            feature=f"dp_replicate={plan.dp_replicate} (Megatron-core's num_distributed_optimizer_instances)",
        )
    if ps.model_parallel_is_initialized():
        raise RuntimeError(
            "Megatron-core parallel_state is already initialized; call parallel_state.destroy_model_parallel() first"
        )
    ps.initialize_model_parallel(**layout.kwargs(), **kwargs)
    try:
        verify_megatron_groups(attestation, device=device)
    except MeshMismatchError:
        ps.destroy_model_parallel()
        raise
    return layout
