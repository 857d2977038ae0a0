"""Local SGD and DiLoCo under horovodrun (2 workers): the guarantees of
tests/single/frontends/test_localsgd_fake.py, on Horovod's collectives."""

import numpy as np
import pytest

from tests.parallel.launch import results_of

pytestmark = pytest.mark.parallel

OUTER_CASES = ["localsgd", "diloco", "diloco/strategy", "diloco-overlap", "localsgd-int8", "diloco-int4/strategy"]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return results_of("local_steps.py", 2, tmp_path_factory.mktemp("local_steps"), timeout_s=300)


def flat(arrays):
    return np.concatenate([np.ravel(np.asarray(a, np.float32)) for a in arrays])


@pytest.mark.parametrize("case", OUTER_CASES)
def test_replicas_are_identical_after_every_outer_step(results, case):
    a, b = results[0][case], results[1][case]
    assert a["steps"] == b["steps"] == 16 and len(a["outer"]) == 4
    for k, (x, y) in enumerate(zip(a["outer"], b["outer"])):
        assert flat(x).tobytes() == flat(y).tobytes(), f"outer step {k}: the replicas differ"
    assert flat(a["inner"]).tobytes() != flat(b["inner"]).tobytes(), "an inner step, yet identical: the test is void"
    assert flat(a["weights"]).tobytes() == flat(b["weights"]).tobytes()


@pytest.mark.parametrize("case", [*OUTER_CASES, "diloco-sgd1"])
def test_every_outer_step_is_one_counted_contribution_and_the_optimizer_counts_every_step(results, case):
    for r in (0, 1):
        counts = results[r][case]["counts"]
        assert counts["produced"] == counts["applied"] == 4, counts
        assert counts["rejected"] == counts["dropped"] == counts["skipped"] == 0, counts
        assert results[r][case]["iterations"] == 16


def test_localsgd_with_period_1_and_plain_sgd_trains_as_bsp(results):
    for r in (0, 1):
        np.testing.assert_allclose(
            flat(results[r]["localsgd1"]["weights"]), flat(results[r]["bsp"]["weights"]), rtol=1e-5, atol=1e-6
        )


def test_diloco_with_outer_sgd_at_1_trains_as_localsgd(results):
    for r in (0, 1):
        np.testing.assert_allclose(
            flat(results[r]["diloco-sgd1"]["weights"]), flat(results[r]["localsgd"]["weights"]), rtol=1e-5, atol=1e-6
        )
    # the paper's Nesterov outer step does something else (the comparison above is not void)
    assert not np.allclose(flat(results[0]["diloco"]["weights"]), flat(results[0]["localsgd"]["weights"]))


@pytest.mark.parametrize("case,exact", [("localsgd-int8", "localsgd"), ("diloco-int4/strategy", "diloco/strategy")])
def test_quantized_outer_rounds_stay_near_the_float32_ones(results, case, exact):
    """The same training with its outer rounds quantized: close to the float32 run, and not it
    (the codes went over the wire)."""
    q, f = flat(results[0][case]["weights"]), flat(results[0][exact]["weights"])
    assert not np.array_equal(q, f)
    assert np.abs(q - f).max() < 0.1 * np.abs(f).max(), (np.abs(q - f).max(), np.abs(f).max())


def test_fragments_end_with_identical_replicas_every_fragments_round_counted(results):
    """DiLoCo(H=4, fragments=2, overlap 1) over 16 steps: 8 fragment rounds (each carrying half the
    model) and a last round of the whole model."""
    a, b = results[0]["diloco-fragments"], results[1]["diloco-fragments"]
    assert flat(a["weights"]).tobytes() == flat(b["weights"]).tobytes()
    for r in (0, 1):
        counts = results[r]["diloco-fragments"]["counts"]
        assert counts["produced"] == counts["applied"] == 9 and counts["rejected"] == 0, counts


def test_paced_quantized_fragments_end_with_identical_replicas(results):
    """DiLoCo(H=4, fragments=2, overlap 1, int8) with 8.4M parameters: each fragment's round in
    pieces over Horovod's alltoall and all-gather, the replicas bit-identical at the end."""
    a, b = results[0]["diloco-paced-int8"], results[1]["diloco-paced-int8"]
    assert a["pieces"] > 1 and b["pieces"] > 1, (a["pieces"], b["pieces"])
    assert a["digest"] == b["digest"] and a["finite"]
    for r in (0, 1):
        counts = results[r]["diloco-paced-int8"]["counts"]
        assert counts["produced"] == counts["applied"] == 9 and counts["rejected"] == 0, counts
