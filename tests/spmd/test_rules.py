"""Rule sets: logical dims -> PartitionSpecs for every preset, validation errors, spec_for checks."""

from __future__ import annotations

import logging

import pytest
from jax.sharding import PartitionSpec as P

import meshes
import spmd
from spmd import Rules
from spmd.rules import RulesError

W_IN = ("embed", "mlp")  # W_in[D, F]
W_OUT = ("mlp", "embed")  # W_out[F, D]
EMBED = ("vocab", "embed")  # E[V, D]
W_Q = ("embed", "heads", "head_dim")  # W_q[D, H, K]
STACKED = ("layers", "embed", "mlp")  # a Stack's W_in[layers, D, F]
X = ("batch", "length", "embed")  # x[B, L, D]
H = ("batch", "length", "mlp")  # h[B, L, F]
LOGITS = ("batch", "length", "vocab")
RES = ("batch", "residual_length", "embed")  # the residual stream x[B, L, D]
W_EXPERT = ("expert", "embed", None, "mlp")  # MoE w_gate_up[E, D, 2, F]

# preset -> {dims: (param spec, activation spec)}
EXPECTED = {
    "none": {W_IN: P(), W_OUT: P(), EMBED: P(), W_Q: P(), X: P(), H: P()},
    "dp": {W_IN: P(), W_OUT: P(), EMBED: P(), W_Q: P(), X: P("data"), H: P("data")},
    "fsdp": {
        W_IN: P("fsdp"), W_OUT: P(None, "fsdp"), EMBED: P(None, "fsdp"), W_Q: P("fsdp"), STACKED: P("pipe", "fsdp"),
        X: P(("data", "fsdp")), H: P(("data", "fsdp")),
    },
    "tp": {
        W_IN: P(None, "tensor"), W_OUT: P("tensor"), EMBED: P("tensor"), W_Q: P(None, "tensor"),
        X: P(), H: P(None, None, "tensor"), LOGITS: P(None, None, "tensor"),
    },
    "dp_tp": {
        W_IN: P(None, "tensor"), W_OUT: P("tensor"), EMBED: P("tensor"), W_Q: P(None, "tensor"),
        X: P("data"), H: P("data", None, "tensor"), RES: P("data"),
    },
    "fsdp_tp": {
        W_IN: P("fsdp", "tensor"), W_OUT: P("tensor", "fsdp"), EMBED: P("tensor", "fsdp"), W_Q: P("fsdp", "tensor"),
        STACKED: P("pipe", "fsdp", "tensor"), X: P(("data", "fsdp")), H: P(("data", "fsdp"), None, "tensor"),
    },
    # sequence parallel: the parameters of dp_tp / fsdp_tp, and the residual stream's L over tensor
    "dp_tp_sp": {
        W_IN: P(None, "tensor"), W_OUT: P("tensor"), W_Q: P(None, "tensor"),
        X: P("data"), H: P("data", None, "tensor"), RES: P("data", "tensor"),
    },
    "fsdp_tp_sp": {
        W_IN: P("fsdp", "tensor"), W_OUT: P("tensor", "fsdp"), STACKED: P("pipe", "fsdp", "tensor"),
        X: P(("data", "fsdp")), H: P(("data", "fsdp"), None, "tensor"), RES: P(("data", "fsdp"), "tensor"),
    },
    "dp_ep": {W_IN: P(), W_Q: P(), W_EXPERT: P("expert"), X: P(("data", "expert")), H: P(("data", "expert"))},
    "fsdp_ep": {
        W_IN: P("fsdp"), W_EXPERT: P("expert", "fsdp"), X: P(("data", "fsdp", "expert")), H: P(("data", "fsdp", "expert")),
    },
    "fsdp_tp_ep": {
        W_IN: P("fsdp", "tensor"), W_Q: P("fsdp", "tensor"), W_EXPERT: P("expert", "fsdp", None, "tensor"),
        X: P(("data", "fsdp", "expert")), H: P(("data", "fsdp", "expert"), None, "tensor"),
    },
}
ACTIVATION_DIMS = {X, H, LOGITS, RES}


def test_presets_are_all_covered():
    assert set(EXPECTED) == set(spmd.rules.RULE_SETS)
    assert spmd.get_rules("fsdp_tp") is spmd.rules.FSDP_TP
    assert spmd.get_rules(spmd.rules.DP) is spmd.rules.DP


# EXPECTED is each preset on a mesh whose seq axis has size 1 (every other axis in use)
NO_SEQ = {**{axis: 2 for axis in meshes.AXES}, "seq": 1}


@pytest.mark.parametrize("preset, dims", [(p, d) for p, table in EXPECTED.items() for d in table])
def test_preset_specs(preset, dims):
    kind = "activations" if dims in ACTIVATION_DIMS else "params"
    assert spmd.get_rules(preset).spec(dims, kind=kind, mesh_sizes=NO_SEQ) == EXPECTED[preset][dims]


@pytest.mark.parametrize("preset", sorted(spmd.rules.RULE_SETS))
def test_every_preset_splits_length_over_seq(preset):
    """Context parallelism: activation ``length`` (and the residual stream with it) over ``seq``;
    parameters never name ``seq``."""
    rules = spmd.get_rules(preset)
    for dims in (X, H, RES):
        assert "seq" in spmd.rules.axes_of(rules.spec(dims, kind="activations")[1]), (preset, dims)
    assert all("seq" not in spmd.rules.axes_of(axes) for _, axes in rules.params)


def test_residual_length_follows_length_unless_mapped():
    """The residual stream is split like ``length`` (a context-parallel rule set maps only ``length``
    to ``seq``) unless the rule set maps ``residual_length`` itself (the ``*_sp`` presets)."""
    cp = spmd.rules.DP_TP.replace(name="dp_tp_cp", activations={"length": "seq"})
    assert cp.spec(RES, kind="activations") == P("data", "seq")
    assert cp.spec(X, kind="activations") == P("data", "seq")
    both = spmd.rules.DP_TP_SP.replace(name="dp_tp_sp_cp", activations={"length": "seq",
                                                                        "residual_length": ("seq", "tensor")})
    assert both.spec(RES, kind="activations") == P("data", ("seq", "tensor"))
    assert both.spec(X, kind="activations") == P("data", "seq")
    assert spmd.rules.DP_TP_SP.spec(RES, kind="activations") == P("data", ("seq", "tensor"))
    assert spmd.rules.DP_TP.spec(RES, kind="activations") == P("data", "seq")  # follows length
    plain = spmd.rules.DP_TP.replace(name="dp_tp_whole", activations={"length": None})
    assert plain.spec(RES, kind="activations") == P("data")  # neither mapped: whole


def test_params_and_activations_differ_for_the_same_dim():
    # FSDP shards the embed dim of weights, never the embed dim of activations.
    assert spmd.rules.FSDP.spec(("embed",), kind="params") == P("fsdp")
    assert spmd.rules.FSDP.spec(("embed",), kind="activations") == P()
    assert spmd.rules.DP.spec(("batch",), kind="params") == P()


def test_size_one_axes_are_dropped_with_mesh_sizes():
    sizes = {"data": 1, "fsdp": 8, "tensor": 1}
    assert spmd.rules.FSDP_TP.spec(W_IN, mesh_sizes=sizes) == P("fsdp")
    assert spmd.rules.FSDP_TP.spec(H, kind="activations", mesh_sizes=sizes) == P("fsdp")
    assert spmd.rules.FSDP_TP.spec(H, kind="activations", mesh_sizes={"data": 2, "fsdp": 2, "tensor": 2}) == P(
        ("data", "fsdp"), None, "tensor"
    )
    # Axes the mesh lacks entirely count as size 1.
    assert spmd.rules.DP_TP.spec(H, kind="activations", mesh_sizes={"tensor": 4}) == P(None, None, "tensor")
    # Without mesh_sizes nothing is dropped (negative control).
    assert spmd.rules.FSDP_TP.spec(W_IN) == P("fsdp", "tensor")


def test_one_axis_for_two_dims_of_one_array_raises_naming_both():
    bad = Rules("bad", params=(("embed", "tensor"), ("mlp", "tensor")))
    with pytest.raises(RulesError, match=r"'bad' shards w_in dims 'embed' and 'mlp' both over mesh axis 'tensor'"):
        bad.spec(W_IN, what="w_in")
    assert bad.spec(("embed", None)) == P("tensor")  # one dim alone is fine


def test_rule_set_validation_errors():
    with pytest.raises(RulesError, match=r"unknown mesh axis 'model'; valid axes: data, pipe, fsdp"):
        Rules("bad", params=(("embed", "model"),))
    with pytest.raises(RulesError, match=r"unknown mesh axis 'model'"):
        Rules("bad", activations=(("batch", ("data", "model")),))
    with pytest.raises(RulesError, match=r"logical dim 'embed' more than once"):
        Rules("bad", params=(("embed", "fsdp"), ("embed", "tensor")))
    with pytest.raises(RulesError, match=r"repeats a mesh axis"):
        Rules("bad", params=(("embed", ("fsdp", "fsdp")),))
    with pytest.raises(RulesError, match=r"kind must be 'params' or 'activations', got 'grads'"):
        spmd.rules.DP.spec(W_IN, kind="grads")
    assert issubclass(RulesError, ValueError)


def test_unknown_logical_dim_raises_and_a_rule_makes_it_known():
    with pytest.raises(RulesError, match=r"w has unknown logical dim 'experts'; known dims: batch, embed"):
        spmd.rules.FSDP.spec(("experts", "embed"), what="w")
    moe = spmd.rules.FSDP.replace(name="fsdp_ep", params={"experts": "expert"})
    assert moe.spec(("experts", "embed")) == P("expert", "fsdp")


def test_replace():
    new = spmd.rules.FSDP.replace(params={"vocab": "tensor"})
    assert new.name == "fsdp"
    assert new.spec(EMBED) == P("tensor", "fsdp")
    assert spmd.rules.FSDP.spec(EMBED) == P(None, "fsdp")  # the original is unchanged (frozen data)
    off = spmd.rules.FSDP_TP.replace(name="fsdp_tp_novocab", params={"vocab": None}, activations={"batch": "data"})
    assert off.name == "fsdp_tp_novocab"
    assert off.spec(EMBED) == P(None, "fsdp")
    assert off.spec(X, kind="activations") == P("data", "seq")
    with pytest.raises(RulesError, match="unknown mesh axis 'model'"):
        spmd.rules.FSDP.replace(params={"vocab": "model"})


def test_get_rules_unknown_lists_presets():
    with pytest.raises(RulesError, match=r"unknown rule set 'nope'; valid presets: none, dp, fsdp, tp, dp_tp, fsdp_tp"):
        spmd.get_rules("nope")


# --- spec_for: checked against shapes and a real mesh ------------------------------------------


@pytest.fixture(scope="module")
def mesh():
    return meshes.make_mesh({"data": 2, "tensor": 4})


def test_spec_for_divisible(mesh):
    assert spmd.sharding.spec_for((64, 128), W_IN, "dp_tp", mesh) == P(None, "tensor")
    assert spmd.sharding.spec_for((64, 128), W_IN, "fsdp_tp", mesh) == P(None, "tensor")  # fsdp has size 1 here
    assert spmd.sharding.spec_for((64, 128), None, "dp_tp", mesh) == P()
    with pytest.raises(RulesError, match=r"w has shape \(64, 128\) but 3 logical dims"):
        spmd.sharding.spec_for((64, 128), W_Q, "dp_tp", mesh, path="w")


def test_spec_for_indivisible_raises_naming_path_dim_size_axes(mesh):
    with pytest.raises(RulesError, match=r"blocks/mlp/w_in: dim 1 \('mlp'\) has size 6.*tensor=4 = 4.*'dp_tp'"):
        spmd.sharding.spec_for((64, 6), W_IN, "dp_tp", mesh, path="blocks/mlp/w_in")
    fsdp = meshes.make_mesh({"data": 2, "fsdp": 4})
    with pytest.raises(RulesError, match=r"x: dim 0 \('batch'\) has size 12.*data=2 x fsdp=4 = 8"):
        spmd.sharding.spec_for((12, 16), ("batch", "length"), "fsdp", fsdp, kind="activations", path="x")
    with pytest.raises(RulesError, match=r"on_indivisible must be 'error' or 'replicate', got 'pad'"):
        spmd.sharding.spec_for((64, 6), W_IN, "dp_tp", mesh, on_indivisible="pad")


def test_spec_for_indivisible_replicate_logs_a_warning(mesh, caplog):
    with caplog.at_level(logging.WARNING, logger="spmd.sharding"):
        spec = spmd.sharding.spec_for((6, 64), W_OUT, "dp_tp", mesh, path="blocks/w_down", on_indivisible="replicate")
    assert spec == P()
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "blocks/w_down" in warnings[0].getMessage() and "replicating" in warnings[0].getMessage()
    # Only the indivisible dim is replicated; a divisible one keeps its axis.
    caplog.clear()
    rules = spmd.rules.DP_TP.replace(params={"vocab": "data"})
    with caplog.at_level(logging.WARNING, logger="spmd.sharding"):
        spec = spmd.sharding.spec_for((64, 6), ("vocab", "mlp"), rules, mesh, path="w", on_indivisible="replicate")
    assert spec == P("data")
    assert len(caplog.records) == 1
    # A divisible array logs nothing (negative control).
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="spmd.sharding"):
        assert spmd.sharding.spec_for((64, 8), ("vocab", "mlp"), rules, mesh, on_indivisible="replicate") == P("data", "tensor")
    assert caplog.records == []


def test_names_that_left_the_package_face_are_gone():
    """Pre-1.0: a moved name is not kept as an alias (docs/api/README.md lists where each one went)."""
    for old in ("FSDP", "flops", "PRESETS", "abstract_model", "Schedule", "current"):
        assert not hasattr(spmd, old), old
    assert not hasattr(spmd.rules, "PRESETS") and not hasattr(spmd.variables, "abstract_model")
    assert spmd.rules.FSDP is not None and spmd.inspection.compiled_flops is not None  # where they live
    with pytest.raises(AttributeError):
        spmd.no_such_name
