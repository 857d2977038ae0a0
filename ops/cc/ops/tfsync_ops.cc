// Op definitions (REGISTER_OP + shape functions) for tfsync's relaxed-synchronization
// kernels; the kernels themselves live in ops/cc/kernels/.
//
//  * TfSync>DelayCompensate / TfSync>DelayCompensateAdaptive: DC-ASGD (Zheng et
//    al., ICML 2017) g~ = g + lambda * g (.) g (.) (w_now - w_stale), with constant
//    lambda (DC-ASGD-c) or lambda_t = lambda0 / sqrt(v_t + eps) (DC-ASGD-a).
//  * TfSync>UpdatePushShare / TfSync>UpdateApplyRound: the per-step state updates of
//    the "updates" protocol (SSP, DSSP, ElasticBSP), each one pass over the model's
//    variable, w_bar and pending in place; the push also says whether its share is
//    finite.
//  * TfSync>AllFinite: whether each tensor of a list is finite (a worker's gradients,
//    checked before they go into a round).
//  * TfSync>ScaleAllFinite: each tensor of a list scaled, and whether it is finite,
//    from one pass (a round's sum divided by its number of contributions, checked).
//
// The shape functions check ranks and shapes so that graph construction fails
// early (a ValueError in Python) with the same wording the kernels use at run time.
#include "tensorflow/core/framework/common_shape_fns.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/shape_inference.h"

namespace tfsync {
namespace {

using ::tensorflow::Status;
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
  c->set_output(1, c->Scalar());
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
    .Output("finite: bool")
    .Attr("T: {half, bfloat16, float, double}")
    .SetIsStateful()
    .SetShapeFn(UpdatePushShareShape)
    .Doc(R"doc(
The "updates" protocol's push (SSP, DSSP, ElasticBSP), in place, after the optimizer
moved variable from w_bar + pending by D: share = (variable - (w_bar + pending)) /
size, the share pushed into the round; pending += share; variable = w_bar + pending.
An element whose share is not finite leaves pending as it was (so variable returns to
w_bar + pending there), and finite is false: a share that is not finite is rejected
whole, and pending can then be restored exactly where the share was not finite.
)doc");

REGISTER_OP("TfSync>AllFinite")
    .Input("tensors: T")
    .Output("finite: bool")
    .Attr("T: list({half, bfloat16, float, double}) >= 1")
    .SetShapeFn([](InferenceContext* c) {
      c->set_output(0, c->Vector(c->num_inputs()));
      return absl::OkStatus();
    })
    .Doc(R"doc(
finite[i]: whether every element of tensors[i] is finite (neither NaN nor infinite).
)doc");

REGISTER_OP("TfSync>ScaleAllFinite")
    .Input("tensors: T")
    .Input("scale: double")
    .Output("scaled: T")
    .Output("finite: bool")
    .Attr("T: list({half, bfloat16, float, double}) >= 1")
    .SetShapeFn([](InferenceContext* c) {
      const int n = c->num_inputs() - 1;
      TF_RETURN_IF_ERROR(RequireScalar(c, n, "scale"));
      for (int i = 0; i < n; ++i) c->set_output(i, c->input(i));
      c->set_output(n, c->Vector(n));
      return absl::OkStatus();
    })
    .Doc(R"doc(
scaled[i] = scale * tensors[i] (half and bfloat16 computed in float32), and
finite[i]: whether every element of tensors[i] is finite, from the same pass.
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
