// Op definitions (REGISTER_OP + shape functions) for tfsync's relaxed-synchronization
// kernels; the kernels themselves live in ops/cc/kernels/.
//
//  * TfSync>PartialAggregate: PSP (partial pushing) Algorithm 1, server lines 5-13,
//    and Sync-SGD with backup workers, Algorithm 4: sum the contributions stamped
//    recently enough, drop the rest, report how many were aggregated (d, for the
//    linear learning-rate scaling lr*d/k) and whether the minimum c was reached.
//  * TfSync>MaskStale: the same timestamp test applied to ONE worker's own
//    contribution before a Horovod allreduce (the sum happens in the collective).
//  * TfSync>DelayCompensate / TfSync>DelayCompensateAdaptive: DC-ASGD (Zheng et
//    al., ICML 2017) g~ = g + lambda * g (.) g (.) (w_now - w_stale), with constant
//    lambda (DC-ASGD-c) or lambda_t = lambda0 / sqrt(v_t + eps) (DC-ASGD-a).
//  * TfSync>UpdatePushShare / TfSync>UpdateApplyRound: the per-step state updates of
//    the "updates" protocol (SSP, DSSP, ElasticBSP), each one pass over the model's
//    variable, w_bar and pending in place.
//
// The shape functions check ranks and shapes so that graph construction fails
// early (a ValueError in Python) with the same wording the kernels use at run time.
#include "tensorflow/core/framework/common_shape_fns.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/framework/tensor.h"

namespace tfsync {
namespace {

using ::tensorflow::Status;
using ::tensorflow::Tensor;
using ::tensorflow::shape_inference::DimensionHandle;
using ::tensorflow::shape_inference::InferenceContext;
using ::tensorflow::shape_inference::ShapeHandle;
namespace errors = ::tensorflow::errors;

Status RequireScalar(InferenceContext* c, int index, const char* name) {
  ShapeHandle s = c->input(index);
  if (c->RankKnown(s) && c->Rank(s) != 0) {
    return errors::InvalidArgument(name, " must be a scalar, got shape ", c->DebugString(s));
  }
  return absl::OkStatus();
}

// Merges `b` into `a`, replacing TensorFlow's generic message by one naming both inputs.
Status RequireSameShape(InferenceContext* c, ShapeHandle a, const char* a_name, ShapeHandle b,
                        const char* b_name, ShapeHandle* out) {
  if (!c->Merge(a, b, out).ok()) {
    return errors::InvalidArgument(b_name, " must have the same shape as ", a_name, ": ", a_name,
                                   " has shape ", c->DebugString(a), ", ", b_name, " has shape ",
                                   c->DebugString(b));
  }
  return absl::OkStatus();
}

// The value of a scalar int64 input when it is a graph constant, to check it at graph
// construction; returns false when it is only known at run time.
bool ConstantInt64(InferenceContext* c, int index, int64_t* value) {
  const Tensor* t = c->input_tensor(index);
  if (t == nullptr || t->dims() != 0) return false;
  *value = t->scalar<int64_t>()();
  return true;
}

Status PartialAggregateShape(InferenceContext* c) {
  ShapeHandle contributions = c->input(0);
  if (c->RankKnown(contributions) && c->Rank(contributions) < 1) {
    return errors::InvalidArgument(
        "contributions must have rank >= 1 (shape [k, ...], one row per contribution), got "
        "shape ",
        c->DebugString(contributions));
  }
  ShapeHandle timestamps = c->input(1);
  if (c->RankKnown(timestamps) && c->Rank(timestamps) != 1) {
    return errors::InvalidArgument("timestamps must be a vector of shape [k], got shape ",
                                   c->DebugString(timestamps));
  }
  TF_RETURN_IF_ERROR(RequireScalar(c, 2, "step"));
  TF_RETURN_IF_ERROR(RequireScalar(c, 3, "min_contributions"));
  TF_RETURN_IF_ERROR(RequireScalar(c, 4, "max_staleness"));

  DimensionHandle k = c->UnknownDim();
  if (c->RankKnown(contributions)) k = c->Dim(contributions, 0);
  if (c->RankKnown(timestamps)) {
    DimensionHandle kt = c->Dim(timestamps, 0);
    if (!c->Merge(k, kt, &k).ok()) {
      return errors::InvalidArgument(
          "timestamps must have one entry per contribution: contributions has shape ",
          c->DebugString(contributions), " (k = ", c->DebugString(c->Dim(contributions, 0)),
          "), timestamps has shape ", c->DebugString(timestamps));
    }
  }

  int64_t min_contributions, max_staleness;
  if (ConstantInt64(c, 3, &min_contributions)) {
    if (min_contributions < 0) {
      return errors::InvalidArgument("min_contributions must be >= 0, got ", min_contributions);
    }
    if (c->ValueKnown(k) && min_contributions > c->Value(k)) {
      return errors::InvalidArgument("min_contributions must be <= k = ", c->Value(k),
                                     " (the number of contributions), got ", min_contributions,
                                     "; never wait for more contributions than there are workers");
    }
  }
  if (ConstantInt64(c, 4, &max_staleness) && max_staleness < 0) {
    return errors::InvalidArgument("max_staleness must be >= 0 (0 accepts only the current step), got ",
                                   max_staleness);
  }

  ShapeHandle aggregate = c->UnknownShape();
  if (c->RankKnown(contributions)) {
    TF_RETURN_IF_ERROR(c->Subshape(contributions, 1, &aggregate));
  }
  c->set_output(0, aggregate);
  c->set_output(1, c->Scalar());
  c->set_output(2, c->Vector(k));
  c->set_output(3, c->Scalar());
  return absl::OkStatus();
}

Status MaskStaleShape(InferenceContext* c) {
  TF_RETURN_IF_ERROR(RequireScalar(c, 1, "timestamp"));
  TF_RETURN_IF_ERROR(RequireScalar(c, 2, "step"));
  TF_RETURN_IF_ERROR(RequireScalar(c, 3, "max_staleness"));
  int64_t max_staleness;
  if (ConstantInt64(c, 3, &max_staleness) && max_staleness < 0) {
    return errors::InvalidArgument("max_staleness must be >= 0 (0 accepts only the current step), got ",
                                   max_staleness);
  }
  c->set_output(0, c->input(0));
  c->set_output(1, c->Scalar());
  return absl::OkStatus();
}

// Shared by both delay-compensation ops; `first` is the index of the gradient input.
Status DelayCompensateShapes(InferenceContext* c, int first, ShapeHandle* out) {
  ShapeHandle shape = c->input(first);
  TF_RETURN_IF_ERROR(RequireSameShape(c, shape, "gradient", c->input(first + 1), "w_now", &shape));
  TF_RETURN_IF_ERROR(
      RequireSameShape(c, shape, "gradient", c->input(first + 2), "w_stale", &shape));
  *out = shape;
  return absl::OkStatus();
}

Status DelayCompensateShape(InferenceContext* c) {
  ShapeHandle shape;
  TF_RETURN_IF_ERROR(DelayCompensateShapes(c, 0, &shape));
  TF_RETURN_IF_ERROR(RequireScalar(c, 3, "lambda_"));
  c->set_output(0, shape);
  return absl::OkStatus();
}

Status DelayCompensateAdaptiveShape(InferenceContext* c) {
  ShapeHandle shape;
  TF_RETURN_IF_ERROR(DelayCompensateShapes(c, 1, &shape));
  TF_RETURN_IF_ERROR(RequireScalar(c, 4, "lambda0"));
  TF_RETURN_IF_ERROR(RequireScalar(c, 5, "momentum"));
  TF_RETURN_IF_ERROR(RequireScalar(c, 6, "epsilon"));
  // The variable's shape travels with its handle when the graph knows it.
  auto* handle_data = c->input_handle_shapes_and_types(0);
  if (handle_data != nullptr && handle_data->size() == 1) {
    TF_RETURN_IF_ERROR(
        RequireSameShape(c, shape, "gradient", (*handle_data)[0].shape, "mean_square", &shape));
  }
  c->set_output(0, shape);
  return absl::OkStatus();
}

// The shape of the variable behind resource input `index`, when the graph knows it.
ShapeHandle VariableShape(InferenceContext* c, int index) {
  auto* handle_data = c->input_handle_shapes_and_types(index);
  if (handle_data != nullptr && handle_data->size() == 1) return (*handle_data)[0].shape;
  return c->UnknownShape();
}

Status UpdateVariablesShape(InferenceContext* c, ShapeHandle* out) {
  ShapeHandle shape = VariableShape(c, 0);
  TF_RETURN_IF_ERROR(RequireSameShape(c, shape, "variable", VariableShape(c, 1), "w_bar", &shape));
  TF_RETURN_IF_ERROR(RequireSameShape(c, shape, "variable", VariableShape(c, 2), "pending", &shape));
  *out = shape;
  return absl::OkStatus();
}

Status UpdatePushShareShape(InferenceContext* c) {
  ShapeHandle shape;
  TF_RETURN_IF_ERROR(UpdateVariablesShape(c, &shape));
  TF_RETURN_IF_ERROR(RequireScalar(c, 3, "size"));
  c->set_output(0, shape);
  return absl::OkStatus();
}

Status UpdateApplyRoundShape(InferenceContext* c) {
  ShapeHandle shape;
  TF_RETURN_IF_ERROR(UpdateVariablesShape(c, &shape));
  TF_RETURN_IF_ERROR(RequireSameShape(c, shape, "variable", c->input(3), "total", &shape));
  TF_RETURN_IF_ERROR(RequireSameShape(c, shape, "variable", c->input(4), "own_share", &shape));
  return absl::OkStatus();
}

}  // namespace

REGISTER_OP("TfSync>PartialAggregate")
    .Input("contributions: T")
    .Input("timestamps: int64")
    .Input("step: int64")
    .Input("min_contributions: int64")
    .Input("max_staleness: int64")
    .Output("aggregate: T")
    .Output("num_accepted: int64")
    .Output("dropped: bool")
    .Output("min_contributions_met: bool")
    .Attr("T: {half, bfloat16, float, double}")
    .Attr("reduction: {'sum', 'mean'} = 'mean'")
    .SetShapeFn(PartialAggregateShape)
    .Doc(R"doc(
Aggregates the contributions stamped within max_staleness steps of `step`.

Contribution i is accepted when step - max_staleness <= timestamps[i] <= step;
a timestamp after `step` is an error. aggregate is the sum (reduction='sum') or the
mean (reduction='mean', zeros when none is accepted) of the accepted rows,
num_accepted is d, dropped[i] is true for rejected rows and min_contributions_met
is d >= min_contributions.
)doc");

REGISTER_OP("TfSync>MaskStale")
    .Input("tensor: T")
    .Input("timestamp: int64")
    .Input("step: int64")
    .Input("max_staleness: int64")
    .Output("masked: T")
    .Output("weight: float")
    .Attr("T: {half, bfloat16, float, double}")
    .SetShapeFn(MaskStaleShape)
    .Doc(R"doc(
One worker's contribution before an allreduce: `tensor` unchanged with weight 1.0
when step - max_staleness <= timestamp <= step, zeros with weight 0.0 otherwise.
After summing both over workers, sum(masked) / sum(weight) is the mean of the
accepted contributions.
)doc");

REGISTER_OP("TfSync>DelayCompensate")
    .Input("gradient: T")
    .Input("w_now: T")
    .Input("w_stale: T")
    .Input("lambda_: float")
    .Output("compensated: T")
    .Attr("T: {half, bfloat16, float, double}")
    .SetShapeFn(DelayCompensateShape)
    .Doc(R"doc(
DC-ASGD-c: compensated = gradient + lambda_ * gradient * gradient * (w_now - w_stale).
)doc");

REGISTER_OP("TfSync>DelayCompensateAdaptive")
    .Input("mean_square: resource")
    .Input("gradient: T")
    .Input("w_now: T")
    .Input("w_stale: T")
    .Input("lambda0: float")
    .Input("momentum: float")
    .Input("epsilon: float")
    .Output("compensated: T")
    .Attr("T: {half, bfloat16, float, double}")
    .SetShapeFn(DelayCompensateAdaptiveShape)
    .Doc(R"doc(
DC-ASGD-a: mean_square <- momentum * mean_square + (1 - momentum) * gradient^2 (in
place), then compensated = gradient + lambda0 / sqrt(mean_square + epsilon) *
gradient * gradient * (w_now - w_stale). mean_square is float32, or float64 when T
is double.
)doc");

REGISTER_OP("TfSync>UpdatePushShare")
    .Input("variable: resource")
    .Input("w_bar: resource")
    .Input("pending: resource")
    .Input("size: float")
    .Output("share: T")
    .Attr("T: {half, bfloat16, float, double}")
    .SetIsStateful()
    .SetShapeFn(UpdatePushShareShape)
    .Doc(R"doc(
The "updates" protocol's push (SSP, DSSP, ElasticBSP), in place, after the optimizer
moved variable from w_bar + pending by D: share = (variable - (w_bar + pending)) /
size, the share pushed into the round; pending += share; variable = w_bar + pending.
)doc");

REGISTER_OP("TfSync>UpdateApplyRound")
    .Input("variable: resource")
    .Input("w_bar: resource")
    .Input("pending: resource")
    .Input("total: T")
    .Input("own_share: T")
    .Attr("T: {half, bfloat16, float, double}")
    .SetIsStateful()
    .SetShapeFn(UpdateApplyRoundShape)
    .Doc(R"doc(
The "updates" protocol's application of a complete round, in place: w_bar += total
(the round's sum of shares); pending -= own_share (this worker's share in it);
variable = w_bar + pending.
)doc");

}  // namespace tfsync
