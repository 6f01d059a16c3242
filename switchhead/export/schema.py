"""The ``switchhead.expert_projection`` ONNX operator: schema, function body and exporter translation.

The operator mirrors the torch custom op ``switchhead::expert_projection`` (switchhead/kernels/ops.py)::

    Y[n, s // (S/R)] += G[n, s] * X[n, s // (S/I)] @ W[INDEX[n, s]]        (R = attribute n_out)

with X [N, I, D_in], W [E, D_in, D_out], INDEX [N, S] int64, G [N, S] -> Y [N, R, D_out]. Unlike the torch op the
gate is a required input: the exporter feeds ones where torch passes None (an absent optional input cannot be
tested for inside an ONNX function body).

The model file carries the definition as a model-local FunctionProto made of standard opset-18 operators, so stock
ONNX Runtime (any execution provider) and ``onnx.reference`` run it; a runtime with a real kernel for the
``switchhead`` domain would use that instead. The body picks one of two formulations with an ``If`` on the
(static) shapes, both of which read every expert matrix once per call and issue a single large MatMul:

- I <= R ("expand", V/K/Q projections): every input row through every expert, [N*I, D_in] x [D_in, E*D_out],
  then gather the selected (row, expert) outputs, gate and sum the slots of each output row.
- I > R ("contract", O projections and second halves of MoA / sigma-MoE): fold the gates into a one-hot
  coefficient tensor, contract the inputs to [N*R, E*D_in] and multiply once by W viewed as [E*D_in, D_out].

Each computes E / (slots per output row) times the useful FLOPs, the cheaper side being chosen, which measured
faster in ONNX Runtime than gathering the selected weight matrices (see docs/EXPORT.md). Like the CUDA dense path
of the torch op (and unlike its CPU paths, which check), the contract formulation multiplies zero coefficients by
every expert matrix: an inf or nan in the weights of an expert no token chose makes its outputs nan.
"""

from __future__ import annotations

import onnx
from onnx import TensorProto, helper

DOMAIN = "switchhead"
OP = "expert_projection"
VERSION = 1
OPSET = 18

_registered = False


def register_schema() -> None:
    """Make the operator known to onnx (checker, shape inference) and hence to onnxscript; idempotent."""
    global _registered
    if _registered:
        return
    try:
        onnx.defs.get_schema(OP, VERSION, DOMAIN)
        _registered = True
        return
    except onnx.defs.SchemaError:
        pass
    param = onnx.defs.OpSchema.FormalParameter
    schema = onnx.defs.OpSchema(
        OP, DOMAIN, VERSION,
        doc="Top-k mixture-of-experts projection; see switchhead/export/schema.py.",
        inputs=[
            param("X", "T", "inputs [N, I, D_in]"),
            param("W", "T", "expert matrices [E, D_in, D_out]"),
            param("INDEX", "tensor(int64)", "expert of each (token, slot) [N, S]"),
            param("G", "TG", "gate of each (token, slot) [N, S]"),
        ],
        outputs=[param("Y", "T", "[N, n_out, D_out]")],
        type_constraints=[
            ("T", ["tensor(float)", "tensor(float16)", "tensor(bfloat16)", "tensor(double)"], "activations"),
            ("TG", ["tensor(float)", "tensor(float16)", "tensor(bfloat16)", "tensor(double)"], "gates"),
        ],
        attributes=[onnx.defs.OpSchema.Attribute("n_out", onnx.defs.OpSchema.AttrType.INT,
                                                 "output rows R (divides S)", required=True)],
    )
    onnx.defs.register_schema(schema)
    _registered = True


def _i64(name: str, values: list[int]) -> onnx.NodeProto:
    return helper.make_node("Constant", [], [name], value=helper.make_tensor(name, TensorProto.INT64,
                                                                            [len(values)], values))


def _attr_constant(out: str, attribute: str) -> onnx.NodeProto:
    """Constant scalar holding the value of the function's int attribute `attribute`."""
    node = helper.make_node("Constant", [], [out])
    ref = onnx.AttributeProto()
    ref.name, ref.ref_attr_name, ref.type = "value_int", attribute, onnx.AttributeProto.INT
    node.attribute.append(ref)
    return node


def function_proto() -> onnx.FunctionProto:
    """The operator's definition in standard ONNX (opset 18)."""
    n = helper.make_node
    common = [
        _i64("zero", [0]), _i64("one", [1]), _i64("minus1", [-1]),
        n("Constant", [], ["zero_s"], value=helper.make_tensor("zero_s", TensorProto.INT64, [], [0])),
        n("Constant", [], ["one_s"], value=helper.make_tensor("one_s", TensorProto.INT64, [], [1])),
        # n_out as a 1-D tensor: Constant can only copy an attribute of its own type, so go via a scalar.
        _attr_constant("r_s", "n_out"),
        n("Shape", ["X"], ["n1"], start=0, end=1),
        n("Shape", ["X"], ["i1"], start=1, end=2),
        n("Shape", ["X"], ["din1"], start=2, end=3),
        n("Shape", ["W"], ["e1"], start=0, end=1),
        n("Shape", ["W"], ["dout1"], start=2, end=3),
        n("Shape", ["INDEX"], ["s1"], start=1, end=2),
        n("Reshape", ["r_s", "one"], ["r1"]),
        n("Squeeze", ["s1"], ["s_s"]),
        # Input row read by each slot: s // (S / I).
        n("Div", ["s1", "i1"], ["per_in1"]),
        # Slots summed into each output row, S / R: spelled out in the reshapes below rather than left to -1,
        # which Reshape cannot infer when N = 0 (no tokens) makes every other product zero.
        n("Div", ["s1", "r1"], ["per_out1"]),
        n("Squeeze", ["per_in1"], ["per_in_s"]),
        n("Range", ["zero_s", "s_s", "one_s"], ["slots"]),
        n("Div", ["slots", "per_in_s"], ["in_row"]),
        n("CastLike", ["G", "X"], ["g"]),
        n("Unsqueeze", ["g", "minus1"], ["g3"]),
        n("LessOrEqual", ["i1", "r1"], ["expand1"]),
        n("Squeeze", ["expand1"], ["expand"]),
    ]
    expand = [
        n("Transpose", ["W"], ["wt"], perm=[1, 0, 2]),
        n("Concat", ["din1", "minus1"], ["wt_shape"], axis=0),
        n("Reshape", ["wt", "wt_shape"], ["w_all"]),  # [D_in, E*D_out]
        n("Concat", ["minus1", "din1"], ["x_shape"], axis=0),
        n("Reshape", ["X", "x_shape"], ["x2"]),  # [N*I, D_in]
        n("MatMul", ["x2", "w_all"], ["y_all"]),  # [N*I, E*D_out]
        n("Concat", ["minus1", "dout1"], ["rows_shape"], axis=0),
        n("Reshape", ["y_all", "rows_shape"], ["y_rows"]),  # [N*I*E, D_out]
        # Row of y_rows for (n, s): (n*I + in_row[s]) * E + INDEX[n, s].
        n("Squeeze", ["n1"], ["n_s"]),
        n("Range", ["zero_s", "n_s", "one_s"], ["tokens"]),
        n("Unsqueeze", ["tokens", "minus1"], ["tokens2"]),
        n("Mul", ["tokens2", "i1"], ["tok_base"]),
        n("Add", ["tok_base", "in_row"], ["row_in"]),  # [N, S]
        n("Mul", ["row_in", "e1"], ["row_e"]),
        n("Add", ["row_e", "INDEX"], ["pick"]),
        n("Gather", ["y_rows", "pick"], ["y_sel"], axis=0),  # [N, S, D_out]
        n("Mul", ["y_sel", "g3"], ["y_gated"]),
        n("Concat", ["zero", "r1", "per_out1", "dout1"], ["grp_shape"], axis=0),
        n("Reshape", ["y_gated", "grp_shape"], ["y_grp"]),  # [N, R, S/R, D_out]
        n("ReduceSum", ["y_grp", "two"], ["y_expand"], keepdims=0),
    ]
    expand.insert(0, _i64("two", [2]))
    contract = [
        n("Gather", ["X", "in_row"], ["xs"], axis=1),  # [N, S, D_in]
        n("Squeeze", ["e1"], ["e_s"]),
        n("Range", ["zero_s", "e_s", "one_s"], ["experts"]),
        n("Unsqueeze", ["INDEX", "minus1"], ["idx3"]),
        n("Equal", ["idx3", "experts"], ["hot"]),
        n("CastLike", ["hot", "X"], ["hot_f"]),
        n("Mul", ["hot_f", "g3"], ["coef"]),  # [N, S, E]
        n("Concat", ["zero", "r1", "per_out1", "e1"], ["coef_shape"], axis=0),
        n("Reshape", ["coef", "coef_shape"], ["coef4"]),  # [N, R, S/R, E]
        n("Transpose", ["coef4"], ["coef4t"], perm=[0, 1, 3, 2]),  # [N, R, E, S/R]
        n("Concat", ["zero", "r1", "per_out1", "din1"], ["xs_shape"], axis=0),
        n("Reshape", ["xs", "xs_shape"], ["xs4"]),  # [N, R, S/R, D_in]
        n("MatMul", ["coef4t", "xs4"], ["z"]),  # [N, R, E, D_in]
        n("Mul", ["e1", "din1"], ["ed1"]),
        n("Concat", ["minus1", "ed1"], ["z_shape"], axis=0),
        n("Reshape", ["z", "z_shape"], ["z2"]),  # [N*R, E*D_in]
        n("Concat", ["minus1", "dout1"], ["wf_shape"], axis=0),
        n("Reshape", ["W", "wf_shape"], ["w_flat"]),  # [E*D_in, D_out]
        n("MatMul", ["z2", "w_flat"], ["y2"]),
        n("Concat", ["minus1", "r1", "dout1"], ["y_shape"], axis=0),
        n("Reshape", ["y2", "y_shape"], ["y_contract"]),
    ]
    then_graph = helper.make_graph(expand, "expand", [], [onnx.ValueInfoProto(name="y_expand")])
    else_graph = helper.make_graph(contract, "contract", [], [onnx.ValueInfoProto(name="y_contract")])
    body = common + [n("If", ["expand"], ["Y"], then_branch=then_graph, else_branch=else_graph)]
    return helper.make_function(DOMAIN, OP, ["X", "W", "INDEX", "G"], ["Y"], body,
                                opset_imports=[helper.make_opsetid("", OPSET)], attributes=["n_out"])


def translation():
    """custom_translation_table entry for torch.onnx.export(dynamo=True): a bare node of our domain."""
    import onnxscript
    from onnxscript import opset18 as op

    register_schema()
    domain = onnxscript.values.Opset(DOMAIN, VERSION)

    def expert_projection(x, weight, index, gate=None, n_out: int = 1):
        if gate is None:
            # ones of the activations' dtype: CastLike keeps the graph valid for fp16 exports too.
            gate = op.CastLike(op.ConstantOfShape(op.Shape(index)), x)
            gate = op.Add(gate, op.CastLike(op.Constant(value_float=1.0), x))
        return domain.expert_projection(x, weight, index, gate, n_out=n_out)

    return expert_projection
