"""The FLSimCo report's check for a collapsed SimCo encoder."""

import math

from fedagent_experiments.flsimco import collapse_check


def test_collapse_check_flags_log_m_loss_and_knn_below_untrained():
    log_m = math.log(64)
    base = {"knn_accuracy": 0.93, "simco_loss": 4.3}
    assert collapse_check({"final_heldout_loss": 2.0, "final_knn": 0.95}, base) == []
    assert len(collapse_check({"final_heldout_loss": 0.97 * log_m, "final_knn": 0.95}, base)) == 1
    assert len(collapse_check({"final_heldout_loss": 2.0, "final_knn": 0.93}, base)) == 1
    assert len(collapse_check({"final_heldout_loss": math.nan, "final_knn": 0.5}, base)) == 2
