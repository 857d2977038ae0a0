"""BatchNormalization's moving statistics: averaged over the workers at the end of fit."""

import numpy as np
import pytest

from tests.parallel.launch import results_of

pytestmark = pytest.mark.parallel


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return results_of("bn_statistics.py", 2, tmp_path_factory.mktemp("statistics"), timeout_s=240)


def flat(arrays):
    return np.concatenate([np.ravel(np.asarray(a, np.float64)) for a in arrays])


@pytest.mark.parametrize("case", ["bsp/average", "ssp/average", "strategy"])
def test_statistics_are_the_workers_mean_and_replicas_identical(results, case):
    before = [flat(results[r][case]["before"]) for r in (0, 1)]
    assert np.max(np.abs(before[0] - before[1])) > 1e-3, "the workers' statistics did not differ: the test is void"
    expected = (before[0] + before[1]) / 2
    for r in (0, 1):
        np.testing.assert_allclose(flat(results[r][case]["after"]), expected, rtol=1e-6, atol=1e-7)
    assert flat(results[0][case]["weights"]).tobytes() == flat(results[1][case]["weights"]).tobytes()


@pytest.mark.parametrize("case", ["bsp/average", "ssp/average", "bsp/keep", "strategy"])
def test_a_frozen_layer_keeps_its_exact_weights(results, case):
    # the frozen kernel is non-trainable and equal on every worker: its float64 mean is itself
    for r in (0, 1):
        assert results[r][case]["frozen_kept"], (r, case)


def test_without_averaging_each_worker_keeps_its_own_statistics(results):
    after = [flat(results[r]["bsp/keep"]["after"]) for r in (0, 1)]
    assert np.max(np.abs(after[0] - after[1])) > 1e-3
    for r in (0, 1):
        assert flat(results[r]["bsp/keep"]["after"]).tobytes() == flat(results[r]["bsp/keep"]["before"]).tobytes()
