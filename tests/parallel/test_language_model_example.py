"""``keras_examples/text_lm.py`` trains under plain Horovod and every registered mode (``auto``
included): two workers, a tiny transformer, a few steps on one package of the standard library.
One ``horovodrun`` launch (``workers/text_lm_modes.py``) runs them all; the tests read its result lines."""

import math
import os
import sysconfig

import pytest

from tests.parallel.launch import run_workers
from tfsync.launch import results_in
from tfsync.policies import registry

pytestmark = pytest.mark.parallel

EPOCHS, STEPS_PER_EPOCH, BATCH, CONTEXT = 2, 8, 4, 32
FLAGS = ["--epochs", EPOCHS, "--steps-per-epoch", STEPS_PER_EPOCH, "--batch-size", BATCH, "--context", CONTEXT]
FLAGS += ["--layers", 1, "--width", 32, "--heads", 2, "--warmup-steps", 2, "--val-sequences", 16]
MODES = [m.name for m in registry.modes(switching=True)]


@pytest.fixture(scope="module")
def results():
    corpus = os.path.join(sysconfig.get_paths()["stdlib"], "email")  # (29 text files, 0.4 MB)
    _, out = run_workers("text_lm_modes.py", 2, [corpus, *FLAGS], timeout_s=420)
    found = results_in(out)
    assert len(found) == 1 + len(MODES), out[-6000:]
    return dict(zip(["horovod", *MODES], found))


@pytest.mark.parametrize("mode", ["horovod", *MODES])
def test_the_language_model_learns_and_ends_with_identical_replicas(results, mode):
    res = results[mode]
    assert res["mode"].startswith(mode), res["mode"]
    assert res["workers"] == 2 and res["files"] > 20, res
    # learned: below the loss of a uniform guess over the 256 bytes, and below its first evaluation
    assert res["val_loss"] < math.log(256) and res["val_loss"] < res["curve"][0][2], res["curve"]
    assert res["perplexity"] == pytest.approx(math.exp(res["val_loss"]))
    assert res["replicas_identical"], res
    tokens_per_epoch = 2 * STEPS_PER_EPOCH * BATCH * CONTEXT
    assert [p[1] for p in res["curve"]] == [tokens_per_epoch * (e + 1) for e in range(EPOCHS)], res["curve"]
    assert res["tokens"] == EPOCHS * tokens_per_epoch and res["tokens_per_s"] > 0, res
    if mode != "horovod":
        settled = sum(res[k] for k in ("applied", "compensated", "dropped", "rejected", "lost"))
        assert res["produced"] == settled > 0, res


def test_bytes_are_counted_alike_for_plain_horovod_and_tfsync(results):
    # plain Horovod: one ring allreduce of every float32 gradient a step, 2(n-1)/n = 1 of its bytes
    # on 2 workers; BSP sends the same gradients (in the compiled step, as Horovod does; through the
    # engine, with its metadata beside them), and DiLoCo one round per H steps
    steps = EPOCHS * STEPS_PER_EPOCH
    horovod, bsp, diloco = results["horovod"], results["bsp"], results["diloco"]
    assert horovod["bytes_sent"] == horovod["parameters"] * 4 * steps, horovod
    assert horovod["bytes_sent"] <= bsp["bytes_sent"] < 1.01 * horovod["bytes_sent"], (horovod, bsp)
    h = registry.get("diloco").build().inner_steps
    assert diloco["bytes_sent"] == pytest.approx(horovod["bytes_sent"] / h, rel=0.01), diloco
    for res in results.values():  # this worker's bytes so far, after each evaluation: up to the total
        sent = res["curve_bytes_sent"]
        assert sent == sorted(sent) and sent[-1] <= res["bytes_sent"], res
