"""Recomputes kiln's differential cases (JSON lines written by
kiln/tests/differential.rs) with numpy and reports every difference.

Each case holds kiln's inputs (logical values, dtype, shape), the op and
kiln's output. The expected output follows PyTorch's semantics where numpy's
differ (documented in the README's table "Where kiln differs from PyTorch"):
integer `/` and integer tensors with a fractional or out-of-range scalar
compute in float32; integer sums keep their dtype (wrapping); scatter with
repeated indices keeps the last write along the dimension.

Dtypes promote as torch.result_type does (`result_type` below: bool < integer
< float, a 0-d tensor counted as a scalar); kiln's u8 plays torch.uint8. A case
kiln refused carries the error's kind instead of an output: `refusal` below
says whether PyTorch refuses it too, or which row of the README's table
documents it; any other refusal is a difference.

Usage: python diff_numpy.py CASES.jsonl   (exit status 1 on any difference)
"""
import json
import sys
from collections import Counter

import warnings

import numpy as np

warnings.simplefilter("ignore")  # numpy warns on empty means; NaN is the expected value

NP = {"f32": np.float32, "f64": np.float64, "i64": np.int64, "i32": np.int32, "u8": np.uint8, "f16": np.float16,
      "bf16": np.float32}  # bf16 values are held in float32 (numpy has no bfloat16)
FLOATS = ("f16", "bf16", "f32", "f64")
HALF = ("f16", "bf16")
WIDTH = {"u8": 0, "i32": 1, "i64": 2, "f16": 0, "bf16": 0, "f32": 1, "f64": 2}


def promote(a, b):
    """torch.promote_types over kiln's dtypes."""
    if a == b:
        return a
    if {a, b} == {"f16", "bf16"}:
        return "f32"
    if (a in FLOATS) != (b in FLOATS):
        return a if a in FLOATS else b
    return a if WIDTH[a] >= WIDTH[b] else b


def result_type(*ts):
    """torch.result_type of tensors given as (dtype, rank): dimensioned
    operands promote among themselves, 0-d ones among themselves, and a 0-d
    one only wins with a higher category."""
    dims = [d for d, r in ts if r > 0]
    zeros = [d for d, r in ts if r == 0]
    def fold(xs):
        out = None
        for x in xs:
            out = x if out is None else promote(out, x)
        return out
    dim, zero = fold(dims), fold(zeros)
    if dim is None:
        return zero
    if zero is None:
        return dim
    return promote(dim, zero) if (zero in FLOATS) and (dim not in FLOATS) else dim


def to_bf16(a):
    """Rounds float values to bfloat16 (nearest, ties to even), kept as float32."""
    f = np.asarray(a, dtype=np.float32)
    u = f.view(np.uint32).astype(np.uint64)
    r = (((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16).astype(np.uint32).view(np.float32)
    return np.where(np.isnan(f), np.float32(np.nan), r)


def cast(a, dt):
    """`a` converted to kiln dtype `dt` as kiln and PyTorch convert."""
    if dt == "bf16":
        return to_bf16(a.astype(np.float64).astype(np.float32) if a.dtype.kind in "iu" else a.astype(np.float32))
    return a.astype(NP[dt])


def wrap(d, n):
    """PyTorch's maybe_wrap_dim for `n` dimensions: the index, or None (IndexError)."""
    w = d + n if d < 0 else d
    return w if 0 <= w < n else None


# Cases kiln computes where PyTorch refuses, as the README's table says.
DOCUMENTED = Counter()


class Refused(Exception):
    """PyTorch refuses the case too (the reason names its error)."""
LIMITS = {"u8": (0, 255), "i32": (-(2**31), 2**31 - 1), "i64": (-(2**63), 2**63 - 1)}


def arr(t):
    dt = t["dtype"]
    if dt in FLOATS:
        a = np.array(t["data"], dtype=np.float64).astype(NP[dt])
    else:
        a = np.array([int(v) for v in t["data"]], dtype=np.int64).astype(NP[dt])
    return a.reshape(t["shape"])


def is_int(a):
    return a.dtype.kind in "iu"


def fits(s, dt):
    lo, hi = LIMITS[dt]
    return np.isfinite(s) and float(s).is_integer() and lo <= s <= hi


def name(a):
    return {np.float32: "f32", np.float64: "f64", np.int64: "i64", np.int32: "i32", np.uint8: "u8", np.float16: "f16"}[a.dtype.type]


def scalar_op(a, op, s):
    """kiln's tensor-scalar rule: an integer tensor computes in f32 when the
    scalar does not fit its dtype, and for division (true division)."""
    if is_int(a) and (op == "div_scalar" or not fits(s, name(a))):
        a = a.astype(np.float32)
    s = a.dtype.type(s)
    with np.errstate(all="ignore"):
        if op == "add_scalar":
            return a + s
        if op == "sub_scalar":
            return a - s
        if op == "mul_scalar":
            return a * s
        if op == "div_scalar":
            return a / s
        if op == "maximum_scalar":
            return np.maximum(a, s)
        if op == "minimum_scalar":
            return np.minimum(a, s)
    raise ValueError(op)


class Documented(Exception):
    """kiln refuses where PyTorch computes: a row of the README's table."""


def refuse_half(dt, why="arithmetic on f16/bf16 tensors"):
    if dt in HALF:
        raise Documented(why)


def unary_expected(op, a, dt):
    refuse_half(dt)
    if op in ("neg", "abs", "sqr", "relu"):
        if op == "neg":
            return -a, dt
        if op == "abs":
            return np.abs(a), dt
        if op == "sqr":
            return a * a, dt
        return np.maximum(a, a.dtype.type(0)), dt
    if dt not in FLOATS:  # float functions of integers: float32, as PyTorch
        a, dt = a.astype(np.float32), "f32"
    one = a.dtype.type(1)
    f = {"exp": np.exp, "log": np.log, "sqrt": np.sqrt, "sin": np.sin, "cos": np.cos, "tanh": np.tanh,
         "sigmoid": lambda x: one / (one + np.exp(-x)), "recip": lambda x: one / x}[op]
    return f(a), dt


def binary_expected(op, a, da, ra, b, db, rb):
    dt = result_type((da, ra), (db, rb))
    refuse_half(dt)
    if op == "pow" and dt not in FLOATS:
        raise Documented("pow of integer tensors")
    a, b = cast(a, dt), cast(b, dt)
    if op == "div" and dt not in FLOATS:
        a, b, dt = a.astype(np.float32), b.astype(np.float32), "f32"
    f = {"add": np.add, "sub": np.subtract, "mul": np.multiply, "div": np.divide, "maximum": np.maximum,
         "minimum": np.minimum, "eq": np.equal, "lt": np.less, "ge": np.greater_equal, "pow": np.power}[op]
    out = f(a, b)
    if out.dtype == np.bool_:
        return out.astype(np.uint8), "u8"
    return out, dt


def reduce_expected(op, a, dt, d, keep):
    rank = a.ndim
    w = wrap(d, max(rank, 1))
    if w is None:
        raise Refused("IndexError: dimension out of range")
    if op == "mean" and dt not in FLOATS:
        raise Refused("mean(): could not infer output dtype (integers)")
    refuse_half(dt)
    if rank == 0:  # a 0-d tensor is its own reduction; its only index is 0
        if op in ("argmax", "argmin"):
            return np.array(0, dtype=np.int64), "i64"
        return a.copy(), dt
    if op in ("max", "min", "argmax", "argmin") and a.shape[w] == 0:
        raise Refused("cannot reduce an empty dimension")
    if op == "sum":
        out = np.sum(a, axis=w, keepdims=keep, dtype=np.float64).astype(a.dtype) if dt in FLOATS else np.sum(a, axis=w, keepdims=keep, dtype=a.dtype)
    elif op == "mean":
        out = np.mean(a.astype(np.float64), axis=w, keepdims=keep).astype(a.dtype)
    elif op in ("max", "min"):
        out = getattr(np, op)(a, axis=w, keepdims=keep)
    else:
        out = getattr(np, op)(a, axis=w).astype(np.int64)
        out = np.expand_dims(out, w) if keep else out
        return out, "i64"
    return out, dt


def softmax_expected(op, a, dt, d):
    w = wrap(d, max(a.ndim, 1))
    if w is None:
        raise Refused("IndexError: dimension out of range")
    refuse_half(dt)
    if dt not in FLOATS:
        # The README's table: computed in f32 (PyTorch has no integer kernel).
        DOCUMENTED["softmax/log_softmax of integer tensors computed in f32"] += 1
        a, dt = a.astype(np.float32), "f32"
    # A 0-d tensor is one element over its only dimension: exp(x - max) / sum,
    # so 1 (or 0 for log_softmax) for a finite x and NaN for NaN or an
    # infinity, as PyTorch's kernel.
    x = a.astype(np.float64).reshape(a.shape or (1,))
    w = w if a.ndim else 0
    if x.size == 0:
        return a.copy(), dt
    m = np.max(x, axis=w, keepdims=True)
    out = x - m - np.log(np.sum(np.exp(x - m), axis=w, keepdims=True))
    return (np.exp(out) if op == "softmax" else out).reshape(a.shape).astype(a.dtype), dt


def dim_expected(op, a, dt, d):
    r = a.ndim
    if op in ("unsqueeze", "stack"):
        w = wrap(d, r + 1)
    elif op == "narrow":
        w = wrap(d, r) if r > 0 else None
    else:
        w = wrap(d, max(r, 1))
    if w is None:
        raise Refused("IndexError: dimension out of range")
    if op == "transpose":
        return (np.swapaxes(a, w, -1) if r > 0 else a.copy()), dt
    if op == "unsqueeze":
        return np.expand_dims(a, w), dt
    if op == "stack":
        return np.stack([a, a], axis=w), dt
    if op == "squeeze":
        return (np.squeeze(a, axis=w) if r > 0 and a.shape[w] == 1 else a.copy()), dt
    if op == "flatten_from":
        return (a.reshape(a.shape[:w] + (-1 if a.size else int(np.prod(a.shape[w:])),)) if r > 0 else a.reshape(1)), dt
    if op == "narrow":
        idx = [slice(None)] * r
        idx[w] = slice(0, min(1, a.shape[w]))
        return a[tuple(idx)], dt
    if op == "cumsum":
        refuse_half(dt)
        if r == 0:
            return a.copy(), dt
        if dt in FLOATS:
            return np.cumsum(a.astype(np.float64), axis=w).astype(a.dtype), dt
        return np.cumsum(a, axis=w, dtype=a.dtype), dt
    if op == "sum_keepdim":
        return reduce_expected("sum", a, dt, d, True)
    return reduce_expected("argmax", a, dt, d, False)


def expected(c):
    """(values, kiln dtype) as PyTorch computes them, or Refused/Documented."""
    op = c["op"]
    a = arr(c["a"])
    da = c["a"]["dtype"]
    with np.errstate(all="ignore"):
        if op in ("neg", "abs", "sqr", "relu", "exp", "log", "sqrt", "sin", "cos", "tanh", "sigmoid", "recip"):
            return unary_expected(op, a, da)
        if op == "clamp":
            refuse_half(da)
            out = scalar_op(scalar_op(a, "maximum_scalar", c["s"]), "minimum_scalar", c["hi"])
            return out, name(out)
        if op.endswith("_scalar"):
            refuse_half(da)
            out = scalar_op(a, op, c["s"])
            return out, name(out)
        if op in ("add", "sub", "mul", "div", "maximum", "minimum", "eq", "lt", "ge", "pow"):
            b = arr(c["b"])
            return binary_expected(op, a, da, a.ndim, b, c["b"]["dtype"], b.ndim)
        if op == "sum_all":
            refuse_half(da)
            return (np.sum(a, dtype=np.float64).astype(a.dtype) if da in FLOATS else np.sum(a, dtype=a.dtype)), da
        if op == "max_all":
            refuse_half(da)
            return np.max(a), da
        if op in ("sum", "max", "min", "argmax", "argmin", "mean"):
            return reduce_expected(op, a, da, c["dim"], c["keepdim"])
        if op == "matmul":
            b = arr(c["b"])
            if c["b"]["dtype"] != da:
                raise Refused("expected m1 and m2 to have the same dtype")
            if da not in FLOATS:
                return np.matmul(a, b), da
            return np.matmul(a.astype(np.float64), b.astype(np.float64)).astype(a.dtype), da
        if op == "cast":
            return cast(a, c["to"]), c["to"]
        if op in ("softmax", "log_softmax"):
            return softmax_expected(op, a, da, c["dim"])
        if op == "index_select":
            ids = arr(c["ids"]).astype(np.int64)
            return np.take(a, ids, axis=c["dim"]), da
        if op in ("gather", "scatter", "scatter_add"):
            return gather_scatter(a, c), da
        if op in ("sort", "topk"):
            return sort_like(a, c), da
        if op in ("argsort", "topk_indices"):
            return sort_like(a, c), "i64"
        if op == "index":
            return a[tuple(selector(s, n) for s, n in zip(c["sels"], a.shape))], da
        if op == "cat_narrow":
            b = arr(c["b"])
            dt = result_type((da, a.ndim), (c["b"]["dtype"], b.ndim))
            cat = np.concatenate([cast(a, dt), cast(b, dt)], axis=c["dim"])
            idx = [slice(None)] * cat.ndim
            idx[c["dim"]] = slice(c["start"], c["start"] + c["len"])
            return cat[tuple(idx)], dt
        if op == "where":
            cond, b = arr(c["c"]) != 0, arr(c["b"])
            dt = result_type((da, a.ndim), (c["b"]["dtype"], b.ndim))
            return np.where(cond, cast(a, dt), cast(b, dt)), dt
        if op == "norm":
            if da not in FLOATS:
                raise Refused("linalg.vector_norm: Expected a floating point or complex tensor")
            refuse_half(da)
            return np.sqrt(np.sum(a.astype(np.float64) ** 2)).astype(a.dtype), da
        if op.startswith("dim_"):
            return dim_expected(op[4:], a, da, c["dim"])
    raise ValueError(f"unknown op {op}")


def gather_scatter(a, c):
    """torch.gather / torch.scatter / torch.scatter_add: a row-major walk of
    the index (for scatter, a later write along dim wins, as kiln documents)."""
    idx = arr(c["index"]).astype(np.int64)
    d = c["dim"] % a.ndim
    if c["op"] == "gather":
        sl = tuple(slice(0, idx.shape[e]) if e != d else slice(None) for e in range(a.ndim))
        return np.take_along_axis(a[sl], idx, axis=d)
    src = arr(c["src"])
    out = a.copy()
    with np.errstate(all="ignore"):
        for pos in np.ndindex(*idx.shape):
            t = list(pos)
            t[d] = idx[pos]
            t = tuple(t)
            out[t] = out[t] + src[pos] if c["op"] == "scatter_add" else src[pos]
    return out


def sort_like(a, c):
    """torch.sort(stable=True) / argsort / topk: NaN is the largest value,
    ties keep their order (ascending and descending)."""
    d, desc = c["dim"] % a.ndim, c["descending"]
    moved = np.moveaxis(a, d, -1)
    order = np.empty(moved.shape, dtype=np.int64)
    for pos in np.ndindex(*moved.shape[:-1]):
        line = moved[pos]
        nan = np.isnan(line) if not is_int(line) else np.zeros(line.shape, bool)
        if desc:
            key = lambda k: (not nan[k], 0 if nan[k] else -line[k].item())
        else:
            key = lambda k: (bool(nan[k]), 0 if nan[k] else line[k].item())
        order[pos] = sorted(range(line.shape[0]), key=key)
    if c["op"] in ("topk", "topk_indices"):
        order = order[..., : c["k"]]
    values = np.take_along_axis(moved, order, axis=-1)
    out = values if c["op"] in ("sort", "topk") else order
    return np.moveaxis(out, -1, d)


def selector(sel, n):
    """kiln's Selector (kind, start, end) as a Python index."""
    kind, s, e = sel
    if kind == 0:
        return slice(None)
    if kind == 1:
        return s
    s = s + n if s < 0 else s
    e = e + n if e < 0 else e
    if kind == 2:
        return slice(s, e)
    if kind == 3:
        return slice(s, None)
    if kind == 4:
        return slice(0, e)
    return slice(s, e + 1)


def tolerance(c, dtype):
    op = c["op"]
    if dtype == "f64":
        return (1e-12, 1e-12) if op in ("add", "sub", "mul", "div", "neg", "abs", "sqr", "cast") else (1e-9, 1e-9)
    if op in ("sum", "sum_all", "mean", "matmul", "softmax", "log_softmax", "norm", "dim_cumsum", "dim_sum_keepdim"):
        return (1e-5, 1e-5)
    if op in ("exp", "log", "sin", "cos", "tanh", "sigmoid", "sqrt", "recip", "pow"):
        return (2e-6, 1e-6)
    return (1e-6, 0.0)


def main(path):
    counts, diffs, refused = Counter(), [], Counter()
    dtypes, mixed = Counter(), 0
    for line in open(path):
        c = json.loads(line)
        counts[c["op"]] += 1
        ins = [c[k]["dtype"] for k in ("a", "b") if k in c]
        dtypes.update(ins)
        mixed += len(set(ins)) > 1
        key = f'case {c["id"]} ({c["op"]} on {c["device"]})'
        try:
            exp, want = expected(c)
        except (Refused, Documented) as why:
            kind = "PyTorch too" if isinstance(why, Refused) else "documented"
            if "error" in c:
                refused[f"{kind}: {why}"] += 1
            else:
                diffs.append(f"{key}: kiln computed {c['out']['dtype']} {c['out']['data'][:8]}, PyTorch refuses ({why})")
            continue
        if "error" in c:
            diffs.append(f"{key}: kiln refused ({c['error']}), PyTorch gives {want} {np.asarray(exp).ravel()[:8].tolist()}; input {c['a']}")
            continue
        got = arr(c["out"])
        exp = np.asarray(exp)
        if got.shape != exp.shape:
            diffs.append(f"{key}: shape {got.shape}, PyTorch {exp.shape}")
            continue
        if c["out"]["dtype"] != want:
            diffs.append(f"{key}: dtype {c['out']['dtype']}, PyTorch {want}")
            continue
        if want in ("u8", "i32", "i64"):
            ok = np.array_equal(got, exp.astype(got.dtype))
        else:
            rtol, atol = tolerance(c, want)
            ok = np.allclose(got.astype(np.float64), exp.astype(np.float64), rtol=rtol, atol=atol, equal_nan=True)
            # Infinities must agree in sign, NaN in place.
            ok = ok and np.array_equal(np.isnan(got), np.isnan(exp.astype(np.float64)))
        if not ok:
            diffs.append(f"{key}: kiln {got.ravel()[:8].tolist()}, PyTorch {exp.ravel()[:8].tolist()}; input {c['a']['data'][:8]}")
    total = sum(counts.values())
    print(f"differential vs numpy {np.__version__} (PyTorch's rules): {total} cases, {mixed} with operands of two dtypes, {sum(refused.values())} refused, {len(diffs)} differences")
    print("  " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    print("  input dtypes: " + ", ".join(f"{k} {v}" for k, v in sorted(dtypes.items())))
    for why, n in sorted(refused.items()):
        print(f"  refused, {why}: {n}")
    for why, n in sorted(DOCUMENTED.items()):
        print(f"  computed, documented: {why}: {n}")
    for d in diffs[:40]:
        print("  DIFF " + d)
    return 1 if diffs else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
