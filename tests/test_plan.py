"""Pure unit tests of meshgate.plan: validation, rank <-> coordinate, groups, digest, TOML."""

from __future__ import annotations

import hashlib
import itertools
import math
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshgate.plan import (
    COUNT_FIELDS,
    DEFAULT_ORDER,
    EXPERT_GROUP_AXES,
    FLATTENED_AXES,
    GROUP_AXES,
    MAX_WORLD_SIZE,
    PHYSICAL_AXES,
    SEED_ORDER,
    SIZE_FIELDS,
    ParallelPlan,
    PlanError,
    exact_positive_int,
    parse_order,
)
from meshgate.v1 import plan_pb2

PROPERTY = settings(max_examples=150, deadline=None)


# ---- strategies --------------------------------------------------------------------------


@st.composite
def plans(draw, max_world: int = 64, allow_expert: bool = True) -> ParallelPlan:
    """A random valid plan: world <= max_world, any order, ep/etp per Megatron's rule."""
    sizes: dict[str, int] = {}
    world = 1
    for axis in draw(st.permutations(PHYSICAL_AXES)):  # random draw order: no axis favoured
        size = draw(st.integers(1, max(1, min(4, max_world // world))))
        sizes[axis] = size
        world *= size
    expert = allow_expert and draw(st.booleans())
    if expert:
        # dp_shard and dp_replicate adjacent (either way round), the block anywhere.
        blocks = draw(st.permutations(["tp", "cp", "pp", "DP"]))
        dp_pair = draw(st.sampled_from([("dp_shard", "dp_replicate"), ("dp_replicate", "dp_shard")]))
        order: tuple[str, ...] = tuple(itertools.chain.from_iterable(dp_pair if b == "DP" else (b,) for b in blocks))
        room = world // sizes["pp"]
        etp = draw(st.sampled_from(_divisors(room)))
        ep = draw(st.sampled_from(_divisors(room // etp)))
    else:
        order = tuple(draw(st.permutations(PHYSICAL_AXES)))
        etp = ep = 1
    counts = {name: draw(st.integers(1, 16)) for name in COUNT_FIELDS}
    return ParallelPlan(**sizes, ep=ep, etp=etp, order=order, **counts)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


# ---- an independent oracle: Megatron-core's RankGenerator, transcribed -------------------


def _prefix_product(values, init=1):
    out = [init]
    for v in values:
        init *= v
        out.append(init)
    return out


def _decompose(index, shape):
    stride = _prefix_product(shape)
    return [(index // d) % s for s, d in zip(shape, stride)]


def _megatron_groups(world, parallel_size, mask):
    """megatron.core.parallel_state.generate_masked_orthogonal_rank_groups."""
    masked_shape = [s for s, m in zip(parallel_size, mask) if m]
    unmasked_shape = [s for s, m in zip(parallel_size, mask) if not m]
    global_stride = _prefix_product(parallel_size)
    masked_stride = [d for d, m in zip(global_stride, mask) if m]
    unmasked_stride = [d for d, m in zip(global_stride, mask) if not m]
    group_size = _prefix_product(masked_shape)[-1]
    groups = []
    for group_index in range(world // group_size):
        g_idx = _decompose(group_index, unmasked_shape)
        members = []
        for in_group in range(group_size):
            r_idx = _decompose(in_group, masked_shape)
            members.append(
                sum(x * y for x, y in zip(r_idx, masked_stride)) + sum(x * y for x, y in zip(g_idx, unmasked_stride))
            )
        groups.append(tuple(members))
    return groups


class _RankGenerator:
    """megatron.core.parallel_state.RankGenerator (order innermost first)."""

    def __init__(self, tp, ep, dp, pp, cp, order):
        self.world = tp * ep * dp * pp * cp
        self.sizes = {"tp": tp, "pp": pp, "dp": dp, "ep": ep, "cp": cp}
        self.order = order.split("-")

    def get_ranks(self, token):
        mask = [name in token.split("-") for name in self.order]
        return _megatron_groups(self.world, [self.sizes[n] for n in self.order], mask)


# ---- exact-integer validation ------------------------------------------------------------


@pytest.mark.parametrize("field", SIZE_FIELDS)
@pytest.mark.parametrize(
    "bad",
    [
        True,
        False,
        2.0,
        1.9,
        1.0,
        float("nan"),
        np.float64(2.0),
        np.float32(1.0),
        "2",
        "two",
        None,
        Fraction(2, 1),
        np.bool_(True),
        2 + 0j,
    ],
    ids=repr,
)
def test_non_integers_refused_naming_the_field(field, bad):
    with pytest.raises(PlanError) as info:
        ParallelPlan(**{field: bad})
    assert str(info.value).startswith(f"{field} must be an exact positive integer"), info.value
    assert repr(bad) in str(info.value) or type(bad).__name__ in str(info.value)


@pytest.mark.parametrize("field", SIZE_FIELDS)
@pytest.mark.parametrize("bad", [0, -1, -8, np.int64(0), np.int32(-2)], ids=repr)
def test_zero_and_negatives_refused_naming_the_field(field, bad):
    with pytest.raises(PlanError, match=rf"^{field} must be >= 1, got {int(bad)}$"):
        ParallelPlan(**{field: bad})


@pytest.mark.parametrize("value", [np.int64(2), np.int32(2), np.uint8(2), np.int16(2), np.uint64(2)], ids=repr)
def test_numpy_integers_accepted_and_stored_as_int(value):
    plan = ParallelPlan(tp=value, microbatches=value)
    assert plan.tp == 2 and type(plan.tp) is int
    assert plan.microbatches == 2 and type(plan.microbatches) is int
    assert plan == ParallelPlan(tp=2, microbatches=2)
    assert plan.digest() == ParallelPlan(tp=2, microbatches=2).digest()


def test_exact_positive_int_directly():
    assert exact_positive_int("x", 3) == 3
    assert exact_positive_int("x", np.int8(3)) == 3
    with pytest.raises(PlanError, match="^x must be an exact positive integer"):
        exact_positive_int("x", 3.0)
    with pytest.raises(PlanError, match="^x must be >= 1"):
        exact_positive_int("x", 0)


def test_world_size_limit():
    with pytest.raises(PlanError, match="world_size .* exceeds the maximum"):
        ParallelPlan(dp_shard=MAX_WORLD_SIZE, tp=2)
    assert ParallelPlan(dp_shard=MAX_WORLD_SIZE).world_size == MAX_WORLD_SIZE


@pytest.mark.parametrize("field", COUNT_FIELDS)
def test_counts_must_fit_the_uint32_wire_field(field):
    assert ParallelPlan(**{field: 2**32 - 1}).digest()
    with pytest.raises(PlanError, match=f"^{field} = 4294967296 exceeds the uint32"):
        ParallelPlan(**{field: 2**32})


# ---- order -------------------------------------------------------------------------------


def test_default_order_and_string_order():
    assert ParallelPlan().order == DEFAULT_ORDER == ("tp", "cp", "dp_shard", "dp_replicate", "pp")
    plan = ParallelPlan(order="tp-cp-dp_shard-dp_replicate-pp")
    assert plan.order == DEFAULT_ORDER
    assert ParallelPlan(order=" pp - tp-cp-dp_shard -dp_replicate ").order == (
        "pp",
        "tp",
        "cp",
        "dp_shard",
        "dp_replicate",
    )
    assert ParallelPlan(order=list(SEED_ORDER)).order == SEED_ORDER
    assert parse_order(iter(DEFAULT_ORDER)) == DEFAULT_ORDER


@pytest.mark.parametrize(
    "order",
    [
        ("tp", "cp", "dp_shard", "dp_replicate"),  # not a permutation: missing pp
        ("tp", "cp", "dp_shard", "dp_replicate", "pp", "ep"),  # extra axis
        ("tp", "cp", "dp", "dp_replicate", "pp"),  # unknown axis
        ("tp", "cp", "dp_shard", "dp_replicate", "ep"),  # expert axis is not physical
        ("tp", "tp", "dp_shard", "dp_replicate", "pp"),  # duplicate
        "tp-cp-dp_shard-dp_replicate-pp-tp",  # duplicate in a string
        "tp-cp-dp-pp",  # Megatron's spelling is not a physical order
        "",
        (),
    ],
    ids=repr,
)
def test_bad_orders_refused(order):
    with pytest.raises(PlanError, match=r"^order must be a permutation of dp_replicate"):
        ParallelPlan(order=order)


@pytest.mark.parametrize("order", [5, None, ("tp", 1, "dp_shard", "dp_replicate", "pp")], ids=repr)
def test_non_name_orders_refused(order):
    with pytest.raises(PlanError, match=r"^order must"):
        ParallelPlan(order=order)


# ---- rank <-> coordinate, groups: properties ---------------------------------------------


@PROPERTY
@given(plans())
def test_coordinate_rank_round_trip(plan):
    seen = set()
    for rank in range(plan.world_size):
        coord = plan.coordinate(rank)
        assert set(coord) == set(PHYSICAL_AXES)
        assert all(0 <= coord[a] < plan.size(a) for a in PHYSICAL_AXES)
        assert plan.rank(coord) == rank
        seen.add(tuple(coord[a] for a in PHYSICAL_AXES))
    # a bijection: every coordinate is hit exactly once
    assert len(seen) == plan.world_size == math.prod(plan.size(a) for a in PHYSICAL_AXES)
    for idx in itertools.product(*(range(plan.size(a)) for a in PHYSICAL_AXES)):
        coord = dict(zip(PHYSICAL_AXES, idx))
        assert plan.coordinate(plan.rank(coord)) == coord


@PROPERTY
@given(plans())
def test_innermost_axis_of_the_order_varies_fastest(plan):
    stride = 1
    for axis in plan.order:
        if plan.size(axis) > 1:
            base = plan.coordinate(0)
            base[axis] = 1
            assert plan.rank(base) == stride
        stride *= plan.size(axis)


def _axis_index(plan, axis, rank):
    """Index of ``rank`` on a physical or flattened axis (the plan's innermost axis fastest)."""
    coord = plan.coordinate(rank)
    index = 0
    for a in reversed(plan.order):  # outermost first
        if a in FLATTENED_AXES.get(axis, (axis,)):
            index = index * plan.size(a) + coord[a]
    return index


@PROPERTY
@given(plans())
def test_groups_partition_the_world_with_the_axis_size(plan):
    world = set(range(plan.world_size))
    for axis in GROUP_AXES:
        groups = plan.groups(axis)
        members = [r for g in groups for r in g]
        assert sorted(members) == sorted(world), axis  # disjoint and covering
        assert all(len(g) == plan.size(axis) for g in groups), axis
        assert len(groups) == plan.world_size // plan.size(axis)
        firsts = [min(g) for g in groups]
        assert firsts == sorted(firsts)  # ordered by first member
        for group in groups:
            assert group[0] == min(group)
            for rank in group:
                assert plan.group(axis, rank) == group, (axis, rank)


@PROPERTY
@given(plans())
def test_every_rank_is_in_its_own_group(plan):
    for axis in GROUP_AXES:
        for rank in range(plan.world_size):
            assert rank in plan.group(axis, rank)


@PROPERTY
@given(plans())
def test_group_member_i_has_index_i_and_shares_every_other_coordinate(plan):
    coords = [plan.coordinate(r) for r in range(plan.world_size)]
    for axis in PHYSICAL_AXES + tuple(FLATTENED_AXES):
        varying = FLATTENED_AXES.get(axis, (axis,))
        fixed = [a for a in PHYSICAL_AXES if a not in varying]
        # the ranks that share every coordinate except the axis, computed independently
        by_rest: dict[tuple[int, ...], set[int]] = {}
        for r, c in enumerate(coords):
            by_rest.setdefault(tuple(c[a] for a in fixed), set()).add(r)
        for rank in range(plan.world_size):
            group = plan.group(axis, rank)
            assert set(group) == by_rest[tuple(coords[rank][a] for a in fixed)]
            for i, member in enumerate(group):
                assert _axis_index(plan, axis, member) == i, (axis, rank, group)


@PROPERTY
@given(plans())
def test_expert_groups_are_orthogonal(plan):
    # etp, ep, edp (and pp) cut the world into one mixed radix: for every rank, the
    # intersection of its groups on any two different expert axes is the rank itself.
    for rank in range(plan.world_size):
        for a, b in itertools.combinations(EXPERT_GROUP_AXES, 2):
            assert set(plan.group(a, rank)) & set(plan.group(b, rank)) == {rank}
    assert plan.size("etp") * plan.size("ep") * plan.size("edp") * plan.pp == plan.world_size


@PROPERTY
@given(plans())
def test_groups_match_megatron_rank_generator(plan):
    """Whenever Megatron can express the order, every group equals Megatron-core's."""
    try:
        order = plan.megatron_order()
    except PlanError:
        return
    dense = _RankGenerator(plan.tp, 1, plan.dp, plan.pp, plan.cp, order)
    assert set(plan.groups("tp")) == set(dense.get_ranks("tp"))
    assert set(plan.groups("cp")) == set(dense.get_ranks("cp"))
    assert set(plan.groups("pp")) == set(dense.get_ranks("pp"))
    assert set(plan.groups("dp")) == set(dense.get_ranks("dp"))
    assert set(plan.groups("dp_cp")) == set(dense.get_ranks("dp-cp"))
    expert = _RankGenerator(plan.etp, plan.ep, plan.edp, plan.pp, 1, order)
    assert set(plan.groups("etp")) == set(expert.get_ranks("tp"))
    assert set(plan.groups("ep")) == set(expert.get_ranks("ep"))
    assert set(plan.groups("edp")) == set(expert.get_ranks("dp"))


def _device_mesh_groups(plan, axis):
    """TorchTitan's DeviceMesh: arange(world) shaped outermost first; a (flattened) dim's
    groups are the rows once its dims, kept in mesh order, are moved last."""
    dims = list(reversed(plan.order))
    mesh = np.arange(plan.world_size).reshape([plan.size(a) for a in dims])
    flat = [d for d in dims if d in FLATTENED_AXES.get(axis, (axis,))]
    rest = [d for d in dims if d not in flat]
    rows = mesh.transpose([dims.index(d) for d in rest + flat]).reshape(-1, plan.size(axis))
    return {tuple(int(x) for x in row) for row in rows}


@PROPERTY
@given(plans())
def test_groups_match_device_mesh(plan):
    for axis in PHYSICAL_AXES + tuple(FLATTENED_AXES):
        assert set(plan.groups(axis)) == _device_mesh_groups(plan, axis), axis


def test_flattened_members_follow_the_plan_order():
    # cp outside dp_shard: DeviceMesh [pp, cp, dp_replicate, dp_shard, tp] flattens
    # (cp, dp_shard) with dp_shard fastest, and so does Megatron's "dp-cp".
    plan = ParallelPlan(dp_shard=2, cp=2, order=("tp", "dp_shard", "dp_replicate", "cp", "pp"))
    assert plan.groups("dp_shard_cp") == [(0, 1, 2, 3)]
    assert plan.groups("dp_cp") == [(0, 1, 2, 3)]
    default = ParallelPlan(dp_shard=2, cp=2)
    assert default.groups("dp_shard_cp") == [(0, 1, 2, 3)]
    assert default.coordinate(1) == {**default.coordinate(0), "cp": 1}
    assert plan.coordinate(1) == {**plan.coordinate(0), "dp_shard": 1}


@PROPERTY
@given(plans(allow_expert=False), st.sampled_from([1, 2, 4, 8]))
def test_default_order_tp_groups_are_consecutive_blocks(plan, slots):
    plan = ParallelPlan(**{**plan.to_dict(), "order": DEFAULT_ORDER})
    for k, group in enumerate(plan.groups("tp")):
        assert group == tuple(range(k * plan.tp, (k + 1) * plan.tp))
    if slots % plan.tp == 0:
        assert plan.straddling_groups("tp", slots) == []


def test_default_order_tp_blocks_concrete():
    plan = ParallelPlan(tp=4, dp_shard=2, pp=2)
    assert plan.groups("tp") == [(0, 1, 2, 3), (4, 5, 6, 7), (8, 9, 10, 11), (12, 13, 14, 15)]
    assert plan.groups("dp_shard") == [(0, 4), (1, 5), (2, 6), (3, 7), (8, 12), (9, 13), (10, 14), (11, 15)]
    assert plan.groups("pp")[0] == (0, 8)


# ---- concrete layouts --------------------------------------------------------------------


def test_seed_order_example():
    seed = ParallelPlan(dp_replicate=2, tp=2, pp=2, cp=2, order=SEED_ORDER)
    assert seed.world_size == 16
    assert seed.groups("tp") == [(0, 4), (1, 5), (2, 6), (3, 7), (8, 12), (9, 13), (10, 14), (11, 15)]
    assert seed.groups("cp")[0] == (0, 1)
    assert seed.groups("pp")[0] == (0, 2)
    default = ParallelPlan(dp_replicate=2, tp=2, pp=2, cp=2, order=DEFAULT_ORDER)
    assert default.groups("tp") == [(0, 1), (2, 3), (4, 5), (6, 7), (8, 9), (10, 11), (12, 13), (14, 15)]
    assert default.groups("cp")[0] == (0, 2)
    assert default.groups("dp_replicate")[0] == (0, 4)
    assert default.groups("pp")[0] == (0, 8)
    assert seed.digest() != default.digest()


def test_megatron_expert_layout_small_case():
    plan = ParallelPlan(tp=2, dp_shard=4, ep=2)
    assert plan.world_size == 8 and plan.edp == 4
    assert plan.groups("ep") == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert plan.groups("edp") == [(0, 2, 4, 6), (1, 3, 5, 7)]
    assert plan.groups("etp") == [(r,) for r in range(8)]
    assert plan.groups("tp") == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert plan.groups("dp_shard") == [(0, 2, 4, 6), (1, 3, 5, 7)]


def test_megatron_expert_layout_with_etp_and_pp():
    # tp=2, dp=4, pp=2 (world 16), etp=1, ep=4: edp = 16 / (1*4*2) = 2
    plan = ParallelPlan(tp=2, dp_shard=4, pp=2, ep=4)
    assert plan.edp == 2
    assert plan.groups("ep")[:2] == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert plan.groups("edp")[:2] == [(0, 4), (1, 5)]
    # etp=2, ep=2: ep stride is etp
    plan = ParallelPlan(tp=2, dp_shard=4, etp=2, ep=2)
    assert plan.groups("etp") == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert plan.groups("ep") == [(0, 2), (1, 3), (4, 6), (5, 7)]
    assert plan.groups("edp") == [(0, 4), (1, 5), (2, 6), (3, 7)]


@pytest.mark.parametrize(
    "sizes",
    [
        dict(tp=2, dp_shard=3, ep=4),  # 6 % 4
        dict(dp_shard=2, pp=2, ep=4),  # 4 % 8
        dict(tp=2, dp_shard=2, etp=4, ep=2),  # 4 % 8
        dict(tp=3, etp=2),  # 3 % 2
    ],
)
def test_megatron_expert_rule_refused(sizes):
    with pytest.raises(PlanError, match=r"expert layout: world_size \d+ is not divisible by etp\*ep\*pp"):
        ParallelPlan(**sizes)


def test_expert_parallelism_needs_adjacent_dp_axes():
    order = ("dp_shard", "tp", "dp_replicate", "cp", "pp")
    assert ParallelPlan(dp_shard=2, dp_replicate=2, order=order).ep == 1  # fine without experts
    for expert in (dict(ep=2), dict(etp=2)):
        with pytest.raises(
            PlanError,
            match=r"needs dp_shard and dp_replicate adjacent in order, "
            r"got dp_shard-tp-dp_replicate-cp-pp",
        ):
            ParallelPlan(dp_shard=2, dp_replicate=2, tp=2, order=order, **expert)
    # adjacent either way round is accepted
    ParallelPlan(dp_shard=2, dp_replicate=2, ep=2, order=("tp", "dp_replicate", "dp_shard", "cp", "pp"))


# ---- other questions, and bad questions --------------------------------------------------


def test_sizes_and_derived_axes():
    plan = ParallelPlan(dp_replicate=2, dp_shard=3, tp=2, pp=2, cp=2, ep=3, etp=2)
    assert plan.world_size == 48
    assert plan.dp == 6 and plan.size("dp") == 6
    assert plan.size("dp_shard_cp") == 6 and plan.size("dp_cp") == 12
    assert plan.edp == 48 // (2 * 3 * 2) == plan.size("edp")
    assert [plan.size(a) for a in ("ep", "etp")] == [3, 2]
    with pytest.raises(PlanError, match="unknown axis 'xp'"):
        plan.size("xp")
    with pytest.raises(PlanError, match="unknown axis 'xp'"):
        plan.group("xp", 0)
    with pytest.raises(PlanError, match="unknown axis 'xp'"):
        plan.groups("xp")


@pytest.mark.parametrize("rank", [-1, 8, 100, True, 1.0, "0", None], ids=repr)
def test_bad_ranks_refused(rank):
    plan = ParallelPlan(tp=2, dp_shard=4)
    with pytest.raises(PlanError, match="^rank"):
        plan.coordinate(rank)
    with pytest.raises(PlanError, match="^rank"):
        plan.group("tp", rank)


def test_numpy_rank_accepted():
    plan = ParallelPlan(tp=2, dp_shard=4)
    assert plan.coordinate(np.int64(3)) == plan.coordinate(3)
    assert plan.group("tp", np.int32(3)) == (2, 3)


def test_bad_coordinates_refused():
    plan = ParallelPlan(tp=2, dp_shard=4)
    good = plan.coordinate(5)
    with pytest.raises(PlanError, match=r"missing \['tp'\]"):
        plan.rank({a: v for a, v in good.items() if a != "tp"})
    with pytest.raises(PlanError, match=r"unknown \['ep'\]"):
        plan.rank({**good, "ep": 0})
    with pytest.raises(PlanError, match=r"coordinate\['tp'\] = 2 out of range \[0, 2\)"):
        plan.rank({**good, "tp": 2})
    with pytest.raises(PlanError, match=r"coordinate\['dp_shard'\] = -1 out of range"):
        plan.rank({**good, "dp_shard": -1})
    with pytest.raises(PlanError, match=r"coordinate\['tp'\] must be an integer"):
        plan.rank({**good, "tp": 1.0})
    with pytest.raises(PlanError, match=r"coordinate\['tp'\] must be an integer"):
        plan.rank({**good, "tp": True})
    assert plan.rank({a: np.int64(v) for a, v in good.items()}) == 5


def test_plan_is_frozen_and_hashable():
    plan = ParallelPlan(tp=2)
    with pytest.raises(AttributeError):
        plan.tp = 4  # type: ignore[misc]
    assert len({plan, ParallelPlan(tp=2), ParallelPlan(tp=2, order="tp-cp-dp_shard-dp_replicate-pp")}) == 1


# ---- digest and proto --------------------------------------------------------------------


def test_digest_is_sha256_of_deterministic_proto_bytes():
    plan = ParallelPlan(
        dp_replicate=2, dp_shard=2, tp=2, pp=2, cp=1, ep=2, microbatches=8, gradient_accumulation_steps=4
    )
    raw = plan.to_proto().SerializeToString(deterministic=True)
    assert plan.canonical_bytes() == raw
    assert plan.digest() == hashlib.sha256(raw).digest()
    assert len(plan.digest()) == 32
    assert plan.digest() == plan.digest()  # cached, stable


def test_digest_stable_across_equal_plans():
    a = ParallelPlan(tp=2, dp_shard=4, order="tp-cp-dp_shard-dp_replicate-pp")
    b = ParallelPlan(tp=np.int64(2), dp_shard=4, order=list(DEFAULT_ORDER))
    c = ParallelPlan.from_mapping({"dp_shard": 4, "tp": 2})
    assert a == b == c
    assert a.digest() == b.digest() == c.digest()


_CHANGES = {name: 3 for name in SIZE_FIELDS}
_CHANGES.update(ep=2, etp=2, pp=2)  # keep the expert rule: world 24 % (etp*ep*pp)


@pytest.mark.parametrize("field", list(SIZE_FIELDS) + ["order"])
def test_digest_changes_with_every_field(field):
    base = dict(dp_replicate=2, dp_shard=2, tp=2, pp=1, cp=1, ep=1, etp=1)
    plan = ParallelPlan(**base)
    if field == "order":
        other = ParallelPlan(**base, order=("cp", "tp", "dp_shard", "dp_replicate", "pp"))
    else:
        other = ParallelPlan(**{**base, field: _CHANGES[field]})
    assert plan != other
    assert plan.digest() != other.digest()


@PROPERTY
@given(plans(), plans())
def test_digest_equal_iff_plans_equal(a, b):
    assert (a.digest() == b.digest()) == (a == b)


@PROPERTY
@given(plans())
def test_proto_round_trip(plan):
    message = plan.to_proto()
    assert isinstance(message, plan_pb2.ParallelPlan)
    assert list(message.order) == list(plan.order)
    again = ParallelPlan.from_proto(message)
    assert again == plan
    assert again.digest() == plan.digest()
    parsed = plan_pb2.ParallelPlan.FromString(plan.canonical_bytes())
    assert ParallelPlan.from_proto(parsed) == plan
    assert ParallelPlan.from_mapping(plan.to_dict()) == plan


def test_from_proto_refuses_an_empty_message():
    with pytest.raises(PlanError):
        ParallelPlan.from_proto(plan_pb2.ParallelPlan())
    message = ParallelPlan(tp=2).to_proto()
    message.tp = 0
    with pytest.raises(PlanError, match="^tp must be >= 1"):
        ParallelPlan.from_proto(message)


# ---- TOML ----------------------------------------------------------------------------------


def test_from_toml_plan_table(tmp_path):
    path = tmp_path / "job.toml"
    path.write_text(
        '[job]\nid = "llama"\n\n[plan]\ntp = 2\ndp_shard = 4\npp = 2\n'
        'order = "tp-cp-dp_shard-dp_replicate-pp"\nmicrobatches = 8\n'
    )
    plan = ParallelPlan.from_toml(path)
    assert plan == ParallelPlan(tp=2, dp_shard=4, pp=2, microbatches=8)
    assert ParallelPlan.from_toml(str(path)) == plan


def test_from_toml_top_level_keys(tmp_path):
    path = tmp_path / "plan.toml"
    path.write_text('tp = 2\ncp = 2\norder = ["cp", "tp", "dp_shard", "dp_replicate", "pp"]\n')
    plan = ParallelPlan.from_toml(path)
    assert plan == ParallelPlan(tp=2, cp=2, order=("cp", "tp", "dp_shard", "dp_replicate", "pp"))
    assert ParallelPlan.from_toml_text("") == ParallelPlan()


def test_from_toml_text_plan_table():
    assert ParallelPlan.from_toml_text("[plan]\nep = 2\ndp_shard = 2\n") == ParallelPlan(dp_shard=2, ep=2)


def test_toml_unknown_keys_refused(tmp_path):
    with pytest.raises(PlanError, match=r"unknown plan field\(s\) dp, zz"):
        ParallelPlan.from_toml_text("[plan]\ntp = 2\ndp = 4\nzz = 1\n")
    path = tmp_path / "p.toml"
    path.write_text('[job]\nid = "x"\n')  # no [plan]: the top level must be a plan
    with pytest.raises(PlanError, match=rf"^{path}: unknown plan field\(s\) job"):
        ParallelPlan.from_toml(path)


@pytest.mark.parametrize(
    "text, match",
    [
        ("[plan]\ntp = 2.0\n", "^tp must be an exact positive integer, got 2.0"),
        ("[plan]\ntp = 1.9\n", "^tp must be an exact positive integer"),
        ("[plan]\ntp = true\n", "^tp must be an exact positive integer, got True"),
        ('[plan]\ntp = "2"\n', "^tp must be an exact positive integer"),
        ("[plan]\npp = 0\n", "^pp must be >= 1, got 0"),
        ("[plan]\ncp = -2\n", "^cp must be >= 1, got -2"),
        ('[plan]\norder = "tp-cp"\n', "^order must be a permutation"),
        ("[plan]\norder = 5\n", "^order must be a string or a sequence"),
        ("plan = 3\n", "^plan must be a table, got int"),
        ("[plan\ntp = 2\n", "^invalid TOML"),
        ("tp = = 2\n", "^invalid TOML"),
        ("[plan]\ntp = 2\ntp = 4\n", "^invalid TOML"),
    ],
)
def test_toml_text_errors(text, match):
    with pytest.raises(PlanError, match=match):
        ParallelPlan.from_toml_text(text)


def test_from_toml_errors_name_the_file(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("[plan]\ntp = 2.0\n")
    with pytest.raises(PlanError, match=rf"^{path}: tp must be an exact positive integer"):
        ParallelPlan.from_toml(path)
    path.write_text("[plan\n")
    with pytest.raises(PlanError, match=rf"^{path}: invalid TOML"):
        ParallelPlan.from_toml(path)
    path.write_bytes(b"tp = 2\n\xff\xfe\n")
    with pytest.raises(PlanError, match=rf"^{path}: invalid TOML"):
        ParallelPlan.from_toml(path)
    with pytest.raises(FileNotFoundError):
        ParallelPlan.from_toml(tmp_path / "missing.toml")


def test_from_mapping_refuses_a_non_mapping():
    with pytest.raises(PlanError, match="plan must be a table, got list"):
        ParallelPlan.from_mapping([("tp", 2)])  # type: ignore[arg-type]


# ---- straddling_groups and megatron_order ------------------------------------------------


def test_straddling_groups():
    plan = ParallelPlan(tp=4, dp_shard=4)  # world 16, default order
    assert plan.straddling_groups("tp", 8) == []
    assert plan.straddling_groups("tp", 4) == []
    assert plan.straddling_groups("tp", 2) == plan.groups("tp")
    assert plan.straddling_groups("dp_shard", 8) == [(0, 4, 8, 12), (1, 5, 9, 13), (2, 6, 10, 14), (3, 7, 11, 15)]
    assert plan.straddling_groups("dp_shard", 16) == []
    seed = ParallelPlan(dp_replicate=2, tp=2, pp=2, cp=2, order=SEED_ORDER)
    assert seed.straddling_groups("tp", 4) == seed.groups("tp")  # {0,4}, {1,5}, ...
    assert seed.straddling_groups("tp", 8) == []
    assert seed.straddling_groups("cp", 4) == []


@pytest.mark.parametrize("slots", [0, -1, 2.0, True, "8"], ids=repr)
def test_straddling_groups_refuses_bad_slots(slots):
    with pytest.raises(PlanError, match="^slots_per_node must"):
        ParallelPlan(tp=2).straddling_groups("tp", slots)


@PROPERTY
@given(plans(), st.integers(1, 16))
def test_straddling_groups_property(plan, slots):
    for axis in ("tp", "cp", "dp"):
        straddling = plan.straddling_groups(axis, slots)
        assert straddling == [g for g in plan.groups(axis) if len({r // slots for r in g}) > 1]


@pytest.mark.parametrize(
    "order, expected",
    [
        (DEFAULT_ORDER, "tp-cp-ep-dp-pp"),
        ("cp-tp-dp_shard-dp_replicate-pp", "cp-tp-ep-dp-pp"),
        ("pp-tp-cp-dp_shard-dp_replicate", "pp-tp-cp-ep-dp"),
        ("dp_shard-dp_replicate-tp-cp-pp", "ep-dp-tp-cp-pp"),
        (SEED_ORDER, "cp-pp-tp-ep-dp"),
    ],
)
def test_megatron_order(order, expected):
    assert ParallelPlan(order=order).megatron_order() == expected


@pytest.mark.parametrize(
    "order",
    [
        "tp-cp-dp_replicate-dp_shard-pp",  # dp_shard outside dp_replicate
        "tp-dp_shard-cp-dp_replicate-pp",  # not adjacent
        "dp_replicate-tp-cp-pp-dp_shard",
    ],
)
def test_megatron_order_refuses(order):
    with pytest.raises(PlanError, match=f"order {order} does not keep dp_shard directly inside dp_replicate"):
        ParallelPlan(order=order).megatron_order()


def test_describe():
    text = ParallelPlan(tp=2, dp_shard=4, ep=2).describe()
    assert text.startswith("world 8: tp=2, cp=1, dp_shard=4, dp_replicate=1, pp=1 (innermost first)")
    assert "ep=2, etp=1" in text
    assert "ep=" not in ParallelPlan(tp=2).describe()
