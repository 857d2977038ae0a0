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
//  * TfSync>QuantizeBlocks / TfSync>DequantizeBlocks / TfSync>DequantizeSum: int8 and
//    4-bit codes with one float32 scale per block (Local SGD's and DiLoCo's quantized
//    outer rounds), the residual for error feedback, and the fused sum of received rows.
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

// The packed row of `length` values: the codes (`bits` each), then one float32 scale per block.
int64_t PackedRowBytes(int64_t length, int64_t bits, int64_t block_size) {
  return length * bits / 8 + 4 * (length / block_size);
}

Status QuantizeAttrs(InferenceContext* c, int64_t* bits, int64_t* block_size) {
  TF_RETURN_IF_ERROR(c->GetAttr("bits", bits));
  TF_RETURN_IF_ERROR(c->GetAttr("block_size", block_size));
  if (*bits != 8 && *bits != 4) return errors::InvalidArgument("bits must be 8 or 4, got ", *bits);
  if (*block_size < 2 || *block_size % 2) {
    return errors::InvalidArgument("block_size must be an even number >= 2, got ", *block_size);
  }
  return absl::OkStatus();
}

Status RequireWholeBlocks(int64_t length, int64_t block_size) {
  if (length <= 0 || length % block_size) {
    return errors::InvalidArgument("the row length must be a positive multiple of block_size=", block_size,
                                   ", got ", length, "; pad each row with zeros to a whole number of blocks");
  }
  return absl::OkStatus();
}

Status QuantizeBlocksShape(InferenceContext* c) {
  int64_t bits, block_size;
  TF_RETURN_IF_ERROR(QuantizeAttrs(c, &bits, &block_size));
  bool with_residual;
  TF_RETURN_IF_ERROR(c->GetAttr("with_residual", &with_residual));
  ShapeHandle x;
  TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 2, &x));
  auto length = c->Dim(x, 1);
  auto row = c->UnknownDim();
  if (c->ValueKnown(length)) {
    TF_RETURN_IF_ERROR(RequireWholeBlocks(c->Value(length), block_size));
    row = c->MakeDim(PackedRowBytes(c->Value(length), bits, block_size));
  }
  c->set_output(0, c->Matrix(c->Dim(x, 0), row));
  c->set_output(1, with_residual ? x : c->Vector(0));
  return absl::OkStatus();
}

Status DequantizeShape(InferenceContext* c, bool sum) {
  int64_t bits, block_size, length;
  TF_RETURN_IF_ERROR(QuantizeAttrs(c, &bits, &block_size));
  TF_RETURN_IF_ERROR(c->GetAttr("length", &length));
  TF_RETURN_IF_ERROR(RequireWholeBlocks(length, block_size));
  ShapeHandle packed;
  TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 2, &packed));
  const int64_t want = PackedRowBytes(length, bits, block_size);
  auto row = c->Dim(packed, 1);
  if (c->ValueKnown(row) && c->Value(row) != want) {
    return errors::InvalidArgument("packed must have rows of ", want, " bytes (", length, " values at ", bits,
                                   " bits in blocks of ", block_size, "), got shape ", c->DebugString(packed));
  }
  if (sum) {
    TF_RETURN_IF_ERROR(RequireScalar(c, 1, "scale"));
    c->set_output(0, c->Vector(length));
  } else {
    c->set_output(0, c->Matrix(c->Dim(packed, 0), length));
  }
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

REGISTER_OP("TfSync>QuantizeBlocks")
    .Input("x: float")
    .Output("packed: uint8")
    .Output("residual: float")
    .Attr("bits: int")
    .Attr("block_size: int")
    .Attr("with_residual: bool = false")
    .SetShapeFn(QuantizeBlocksShape)
    .Doc(R"doc(
Symmetric block quantization of each row of x [rows, length]: per block of block_size
values, scale = max|x| / qmax (qmax 127 for bits=8, 7 for bits=4) and codes
round(x / scale) (ties to even) in [-qmax, qmax]. packed[r] holds the row's codes (int8,
or two 4-bit codes per byte offset by 8, the even element in the low nibble) then its
scales as little-endian float32. residual = x - codes * scale when with_residual, else
an empty vector.
)doc");

REGISTER_OP("TfSync>DequantizeBlocks")
    .Input("packed: uint8")
    .Output("values: float")
    .Attr("bits: int")
    .Attr("block_size: int")
    .Attr("length: int")
    .SetShapeFn([](InferenceContext* c) { return DequantizeShape(c, false); })
    .Doc(R"doc(
values[r] = codes * scale of packed row r (TfSync>QuantizeBlocks' format).
)doc");

REGISTER_OP("TfSync>DequantizeSum")
    .Input("packed: uint8")
    .Input("scale: float")
    .Output("total: float")
    .Attr("bits: int")
    .Attr("block_size: int")
    .Attr("length: int")
    .SetShapeFn([](InferenceContext* c) { return DequantizeShape(c, true); })
    .Doc(R"doc(
total = scale * the sum, in row order and float32, of the values each packed row stands for.
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
