"""Every layout gives the single-device result: losses and params after 3 AdamW steps."""

import numpy as np
import pytest
from helpers.gpt_util import LAYOUTS, batches, layout, rel_err, run

TOL = 1e-5
SHARDED = [n for n in LAYOUTS if n != "single"]


# the fast tier: one layout with seq (dp2_seq2_tp2; test_context checks the exchanges); the sweep: the others
SWEEP = ("fsdp2_seq4", "seq2_tp4_sp")


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.sweep) if n in SWEEP else n for n in SHARDED])
def test_layout_matches_single_device(name):
    ref_losses, ref_params = run("single")
    losses, params = run(name)
    np.testing.assert_allclose(losses, ref_losses, rtol=TOL)
    assert rel_err(params, ref_params) < TOL
    # the run really trained: parameters moved far more than the tolerance
    _, init = layout("single").run([])
    assert rel_err(ref_params, init) > 100 * TOL


def test_negative_control_perturbed_batch_is_caught():
    """One changed token in one batch must break the comparison: the tolerance is not vacuous."""
    data = batches(3)
    data[1]["inputs"] = data[1]["inputs"].copy()
    data[1]["inputs"][0, 0] = (data[1]["inputs"][0, 0] + 1) % 256
    losses, params = layout("dp2_fsdp2_tp2").run(data)
    ref_losses, ref_params = run("single")
    assert losses[0] == pytest.approx(ref_losses[0], rel=TOL)
    assert abs(losses[1] - ref_losses[1]) / ref_losses[1] > TOL or rel_err(params, ref_params) > TOL
    assert rel_err(params, ref_params) > TOL
