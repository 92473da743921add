"""The catalogue of torch ops a row-layout ShardTensor may meet, by family: data, no logic.

A block in a row layout ("owned" or "halo") holds this rank's rows of a per-atom
array, the atom dimension first. An op is run on the block only if its family
is known to keep every atom's row to itself (row-local), or it has a layout
meaning (a sum over atoms: owned rows, then an all-reduce). Everything else is
refused (default deny): an op that is in no family below, a custom op without an
installed `OpAdapter`, and a known op called in a way that mixes rows of the
block (pairs them, gathers them by index, reduces or reorders along them, moves
or merges the atom dimension). `meaning.classify` applies the families'
conditions; docs/guide.md ("What a ShardTensor refuses") shows the same table,
and tests/torch/test_op_catalogue.py checks one case per family.
"""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(frozen=True)
class Family:
    """One op family: its ops (names as `meaning.short_name` gives them) and what a row block gets."""

    key: str
    ops: frozenset[str]
    meaning: str  # what happens on a row-layout block
    refused: str  # when the family is refused ("" if never)


def _aten_pointwise() -> frozenset[str]:
    """aten ops torch itself tags `pointwise` (elementwise with broadcasting), in-place forms included."""
    names = set()
    for name in dir(torch.ops.aten):
        packet = getattr(torch.ops.aten, name, None)
        if not isinstance(packet, torch._ops.OpOverloadPacket):
            continue
        if any(torch.Tag.pointwise in getattr(packet, o).tags for o in packet.overloads()):
            names |= {name, name if name.endswith("_") else name + "_"}
    return frozenset(names)


# Python operators -> the aten op they call (for the family lookup and the message).
DUNDER = {
    "__add__": "add", "__radd__": "add", "__iadd__": "add_", "__sub__": "sub", "__rsub__": "rsub",
    "__isub__": "sub_", "__mul__": "mul", "__rmul__": "mul", "__imul__": "mul_", "__truediv__": "div",
    "__rtruediv__": "div", "__itruediv__": "div_", "__div__": "div", "__rdiv__": "div", "__idiv__": "div_",
    "__floordiv__": "floor_divide", "__rfloordiv__": "floor_divide", "__ifloordiv__": "floor_divide_",
    "__mod__": "remainder", "__rmod__": "remainder", "__imod__": "remainder_", "__pow__": "pow",
    "__rpow__": "pow", "__ipow__": "pow_", "__neg__": "neg", "__pos__": "positive", "__abs__": "abs",
    "__invert__": "bitwise_not", "__and__": "bitwise_and", "__rand__": "bitwise_and", "__iand__": "bitwise_and_",
    "__or__": "bitwise_or", "__ror__": "bitwise_or", "__ior__": "bitwise_or_", "__xor__": "bitwise_xor",
    "__rxor__": "bitwise_xor", "__ixor__": "bitwise_xor_", "__lshift__": "bitwise_left_shift",
    "__rlshift__": "bitwise_left_shift", "__rshift__": "bitwise_right_shift",
    "__rrshift__": "bitwise_right_shift", "__eq__": "eq", "__ne__": "ne", "__lt__": "lt", "__le__": "le",
    "__gt__": "gt", "__ge__": "ge", "__matmul__": "matmul", "__rmatmul__": "matmul", "__getitem__": "index",
    "__setitem__": "index_put_", "__reversed__": "flip", "__iter__": "unbind",
}
# Python-level names whose aten op is spelled differently (for the message only)
ATEN_OF = {
    "T": "permute", "H": "permute", "mT": "transpose", "mH": "transpose", "adjoint": "transpose",
    "item": "_local_scalar_dense", "tolist": "_local_scalar_dense", "__float__": "_local_scalar_dense",
    "__int__": "_local_scalar_dense", "__index__": "_local_scalar_dense", "__bool__": "is_nonzero",
    "__complex__": "_local_scalar_dense", "numpy": "_to_copy", "__array__": "_to_copy", "__dlpack__": "alias",
    "__contains__": "eq", "concat": "cat", "concatenate": "cat", "new_tensor": "_to_copy",
    **{n: "_to_copy" for n in ("float", "double", "half", "bfloat16", "int", "long", "short", "bool", "byte",
                               "char", "cfloat", "cdouble", "type")},
    "to": "_to_copy", "cpu": "_to_copy", "cuda": "_to_copy", "data": "alias",
}

_ELEMENTWISE_EXTRA = {  # elementwise too, but not tagged pointwise by torch (aliases, conversions, copies)
    "to", "type", "type_as", "float", "double", "half", "bfloat16", "int", "long", "short", "bool", "byte",
    "char", "cfloat", "cdouble", "cpu", "cuda", "clone", "detach", "detach_", "contiguous", "data",
    "requires_grad_", "pin_memory", "share_memory_", "copy_", "fill_", "zero_", "zeros_like", "ones_like",
    "empty_like", "full_like", "rand_like", "randn_like", "randint_like", "dropout", "dropout_",
    "alpha_dropout", "feature_alpha_dropout", "dropout1d", "dropout2d", "dropout3d", "bernoulli", "bernoulli_",
    "floor_divide", "floor_divide_", "float_power", "float_power_", "hardswish", "hardswish_", "softsign",
    "tanhshrink", "rrelu", "rrelu_", "glu", "logsigmoid", "relu6", "hardtanh", "threshold_", "prelu",
    "subtract", "subtract_", "multiply", "multiply_", "divide", "divide_", "true_divide_", "negative",
    "negative_", "absolute", "absolute_", "arccos", "arcsin", "arctan", "arctan2", "arccosh", "arcsinh",
    "arctanh", "fix", "fix_", "greater", "greater_equal", "less", "less_equal", "not_equal", "isclose", "isreal",
    "real", "imag", "conj", "resolve_conj", "resolve_neg", "polar", "complex", "abs_", "square_", "clip_",
    "sigmoid_", "exp_", "log_", "sqrt_", "neg_", "sign_", "ne_", "eq_", "lt_", "le_", "gt_", "ge_",
    "masked_fill_", "where", "special_expit", "special_erf", "logical_not", "nan_to_num",
}

POINTWISE = _aten_pointwise() | frozenset(_ELEMENTWISE_EXTRA) - {"max", "min"}  # max/min: see REDUCE

SUM = frozenset({"sum", "nansum", "mean", "all", "any"})
# reductions: name -> (position of `dim` counting self as 0, its default); None = all dims
REDUCE = {n: (1, None) for n in (
    "nanmean", "prod", "amax", "amin", "argmax", "argmin", "std", "var", "std_mean", "var_mean",
    "logsumexp", "count_nonzero", "median", "nanmedian", "max", "min", "aminmax")}
REDUCE |= {"mode": (1, -1), "norm": (2, None), "vector_norm": (2, None), "linalg_vector_norm": (2, None),
           "linalg_norm": (2, None), "matrix_norm": (2, (-2, -1)), "linalg_matrix_norm": (2, (-2, -1)),
           "quantile": (2, None), "nanquantile": (2, None), "kthvalue": (2, -1), "topk": (2, -1)}
# shape-preserving ops that mix entries along `dim`: name -> (position, default)
ALONG = {n: (1, None) for n in ("cumsum", "cumprod", "cummax", "cummin", "logcumsumexp", "softmax",
                                "log_softmax", "softmin", "flip")}
ALONG |= {"sort": (1, -1), "argsort": (1, -1), "diff": (2, -1), "normalize": (2, 1), "renorm": (2, None),
          "roll": (2, None), "msort": (None, 0), "flipud": (None, 0), "take_along_dim": (2, None),
          "cross": (2, None), "linalg_cross": (2, -1), "cosine_similarity": (2, 1), "unfold": (1, None)}
TRANSPOSE = frozenset({"T", "H", "t", "t_", "mT", "mH", "adjoint", "transpose", "transpose_", "swapaxes",
                       "swapaxes_", "swapdims", "swapdims_", "permute", "movedim", "moveaxis", "rot90"})
RESHAPE = frozenset({"view", "view_as", "reshape", "reshape_as", "flatten", "ravel", "unflatten", "squeeze",
                     "squeeze_", "unsqueeze", "unsqueeze_", "expand", "expand_as", "broadcast_to", "repeat",
                     "tile", "repeat_interleave", "narrow", "select", "split", "split_with_sizes", "chunk",
                     "unbind", "tensor_split", "cat", "concat", "concatenate", "stack"})
MATMUL = frozenset({"matmul", "mm", "mv", "bmm", "addmm", "addmv", "baddbmm", "dot", "vdot", "inner", "outer",
                    "ger", "linear", "einsum", "bilinear"})
PAIRS = frozenset({"cdist", "pdist", "cartesian_prod", "combinations", "meshgrid", "kron", "tensordot",
                   "block_diag", "addbmm", "chain_matmul", "multi_dot", "dist", "trace", "tril_indices",
                   "triu_indices", "pairwise_distance"})
BATCHED_MATRIX = frozenset({"det", "linalg_det", "inverse", "linalg_inv", "matrix_exp", "linalg_matrix_exp",
                            "tril", "triu", "linalg_eigh", "linalg_eigvalsh", "linalg_svd", "linalg_svdvals",
                            "logdet", "slogdet", "linalg_slogdet"})
NORMS = frozenset({"layer_norm", "rms_norm", "group_norm", "instance_norm", "batch_norm"})
GATHER = frozenset({"__getitem__", "index_select", "gather", "embedding", "one_hot", "take", "masked_select",
                    "nonzero", "argwhere", "unique", "unique_consecutive", "histc", "histogram", "histogramdd",
                    "index_fill", "index_fill_"})
INDEX_SUM = frozenset({"index_add", "index_add_", "scatter_add", "scatter_add_"})
SCATTER_REDUCE = frozenset({"scatter_reduce", "scatter_reduce_", "index_reduce", "index_reduce_", "bincount",
                            "segment_reduce", "_segment_reduce"})
SCATTER_COPY = frozenset({"index_copy", "index_copy_", "scatter", "scatter_", "index_put", "index_put_", "put",
                          "put_", "masked_scatter", "masked_scatter_", "__setitem__"})
HOST = frozenset({"item", "tolist", "numpy", "__array__", "__float__", "__int__", "__index__", "__complex__",
                  "__bool__", "__contains__", "is_nonzero", "equal", "allclose", "__dlpack__"})
FACTORIES = frozenset({"new_zeros", "new_ones", "new_empty", "new_full", "new_tensor", "new_empty_strided"})
# no tensor of atom rows comes out: shape and dtype queries, autograd and printing plumbing
QUERIES = frozenset({
    "shape", "size", "dim", "ndim", "ndimension", "numel", "nelement", "dtype", "device", "layout", "is_leaf",
    "requires_grad", "grad_fn", "_version", "data_ptr", "element_size", "stride", "storage_offset", "get_device",
    "names", "itemsize", "nbytes", "__len__", "__hash__", "output_nr", "retains_grad", "register_hook",
    "retain_grad", "record_stream", "untyped_storage", "_is_view", "dim_order", "__dlpack_device__",
    "register_post_accumulate_grad_hook", "grad", "backward", "__reduce_ex__", "__deepcopy__", "__setstate__",
    "__repr__", "__format__", "__get__", "__set__", "_typed_storage", "storage", "is_same_size", "_base",
    "_cdata", "_grad", "_grad_fn", "_backward_hooks", "_post_accumulate_grad_hooks", "_is_zerotensor"})

CATALOGUE = (
    Family("queries", QUERIES, "run; the result holds no atom rows (shape, dtype, device, `is_*`, autograd "
           "plumbing such as `backward`, `grad`, `register_hook`)", "a result that is a tensor of atom rows"),
    Family("elementwise", POINTWISE, "row-local: runs on the block, the result keeps the layout (torch's "
           "`pointwise` ops, conversions, copies, `*_like`)", "an operand's atom dimension would land away from "
           "dim 0 (`x[:, None] - x`), a one-row block would be spread over rows, or atom rows would be "
           "written into a plain tensor (`plain.copy_(x)`, `out=plain`)"),
    Family("reshape", RESHAPE | TRANSPOSE, "keeps the layout when the atom dimension stays dim 0, whole",
           "dim 0 is merged, split, moved, selected or broadcast: `x[None]`, `x.unsqueeze(0)`, "
           "`x.view(1, -1, 3)`, `x.reshape(-1)`, `x.T`, `x.repeat(n, 1)`, `torch.stack([x, y])`, `list(x)`"),
    Family("slicing", frozenset({"__getitem__"}), "`x[:, ...]` keeps the layout; `x[:x.n_owned]` is an "
           "'owned' block; `torch.cat([x, pad])` adds pad rows", "a subset of atom rows: `x[i]`, `x[2:5]`, "
           "`x[idx]`, `x[mask]`"),
    Family("sum over atoms", SUM, "owned rows summed on each rank, then an all-reduce (a replicated result; "
           "`mean` divides by the job's count, `all` / `any` count deciding entries); over other dims row-local", ""),
    Family("other reductions", frozenset(REDUCE), "row-local over dims other than 0", "the reduction includes "
           "dim 0: `x.max()`, `x.norm()`, `torch.logsumexp(x, 0)`"),
    Family("along dim", frozenset(ALONG), "row-local along dims other than 0", "along dim 0: `sort`, "
           "`cumsum`, `roll`, `flip`, `softmax`, `diff`"),
    Family("products", MATMUL | NORMS | BATCHED_MATRIX, "row-local when the block's atom dimension stays the "
           "result's dim 0 (`x @ W`, `linear`, batched `x @ y` of per-atom matrices, `layer_norm`)",
           "dim 0 is contracted, paired or moved (`x @ x.T`, `einsum('id,jd->ij')`, `outer`, `dot`, "
           "`batch_norm` in training)"),
    Family("pairs", PAIRS, "", "always (every pair of rows): `torch.cdist`, `torch.pdist`, `kron`, `tensordot`"),
    Family("gathers", GATHER, "an atom block used as the index into a plain table keeps the layout "
           "(`embedding(species, table)`, `table[species]`)", "rows of the block picked by an index: "
           "`x[idx]`, `index_select`, `gather`, `take`, `masked_select`, `embedding(idx, x)`"),
    Family("per-system sums", INDEX_SUM, "`zeros.index_add_(0, batch, x)` / `scatter_add` into another row "
           "space: owned rows, then an all-reduce", "into the atom rows themselves (message passing)"),
    Family("scatters", SCATTER_REDUCE | SCATTER_COPY, "a copy into the block's own rows by a plain index",
           "a reduction by index, or atom rows scattered elsewhere"),
    Family("host reads", HOST, "", "always: `.item()`, `.tolist()`, `.numpy()`, `float(x)`, `equal`"),
    Family("factories", FACTORIES, "a plain tensor (no atom rows): `x.new_zeros(k)`", "`x.new_tensor(x)`"),
    Family("custom ops", frozenset(), "the installed `OpAdapter` decides", "no `OpAdapter` installed on it"),
    Family("anything else", frozenset(), "", "always (default deny)"),
)


def family(name: str) -> Family:
    """The family of an op name (`short_name`); 'anything else' when none lists it."""
    for fam in CATALOGUE:
        if name in fam.ops:
            return fam
    return CATALOGUE[-1]
