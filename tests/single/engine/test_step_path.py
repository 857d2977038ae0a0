"""Which path a step's round takes (:func:`tfsync.engine.protocols.in_graph.step_path`): in the
compiled step where nothing needs the engine's Python, else the engine's, with the reason that
rank 0's configuration check shows when a rank differs."""

import types

import pytest
import tensorflow as tf

import tfsync
from tfsync.engine.cluster import HorovodCluster
from tfsync.engine.protocols import in_graph
from tfsync.engine.protocols.gradient import GradientProtocol
from tfsync.engine.protocols.update import UpdateProtocol


def engine(**changes):
    nonfinite = object()
    fields = {
        "nonfinite": nonfinite,
        "components": [nonfinite],
        "policy": tfsync.BSP(),
        "stragglers": tfsync.Stragglers(),
        "trace_dir": None,
        "elastic": None,
        "cluster": object.__new__(HorovodCluster),  # (Horovod's, never started: nothing runs here)
    }
    return types.SimpleNamespace(**{**fields, **changes})


WEIGHTS = [tf.Variable(tf.zeros([3, 2])), tf.Variable(tf.zeros([2]))]


def test_plain_bsp_on_horovod_runs_in_the_graph():
    assert in_graph.step_path(engine(), GradientProtocol, WEIGHTS) == in_graph.IN_GRAPH


@pytest.mark.parametrize(
    "changes,reason",
    [
        ({"policy": tfsync.SSP(staleness=2)}, "the mode decides per step"),
        ({"components": [object()]}, "the mode decides per step"),  # (a component of its binding or its own)
        ({"policy": tfsync.BSP(compression="fp16")}, "gradients are compressed"),
        ({"trace_dir": "traces"}, "a trace is written"),
        ({"stragglers": tfsync.Stragglers(base_s=0.01)}, "stragglers are simulated"),
        ({"stragglers": tfsync.Stragglers(jitter_s=0.01)}, "stragglers are simulated"),
        ({"elastic": object()}, "the job is elastic"),
        ({"cluster": object()}, "the cluster is not Horovod's"),
    ],
)
def test_anything_the_engine_must_see_each_step_keeps_its_path_and_says_why(changes, reason):
    path = in_graph.step_path(engine(**changes), GradientProtocol, WEIGHTS)
    assert path.startswith("the engine's: ") and reason in path, path


def test_weights_of_another_dtype_or_another_protocol_keep_the_engines_path():
    half = [tf.Variable(tf.zeros([2], tf.float16))]
    assert "not every weight is float32" in in_graph.step_path(engine(), GradientProtocol, half)
    assert "not the gradient exchange" in in_graph.step_path(engine(), UpdateProtocol, WEIGHTS)
