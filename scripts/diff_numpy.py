"""Recomputes kiln's differential cases (JSON lines written by
kiln/tests/differential.rs) with numpy and reports every difference.

Each case holds kiln's inputs (logical values, dtype, shape), the op and
kiln's output. The expected output follows PyTorch's semantics where numpy's
differ (documented in the README's table "Where kiln differs from PyTorch"):
integer `/` and integer tensors with a fractional or out-of-range scalar
compute in float32; integer sums keep their dtype (wrapping); scatter with
repeated indices keeps the last write along the dimension.

Usage: python diff_numpy.py CASES.jsonl   (exit status 1 on any difference)
"""
import json
import sys
from collections import Counter

import warnings

import numpy as np

warnings.simplefilter("ignore")  # numpy warns on empty means; NaN is the expected value

NP = {"f32": np.float32, "f64": np.float64, "i64": np.int64, "i32": np.int32, "u8": np.uint8}
LIMITS = {"u8": (0, 255), "i32": (-(2**31), 2**31 - 1), "i64": (-(2**63), 2**63 - 1)}


def arr(t):
    dt = t["dtype"]
    if dt in ("f32", "f64"):
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
    return {np.float32: "f32", np.float64: "f64", np.int64: "i64", np.int32: "i32", np.uint8: "u8"}[a.dtype.type]


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


def expected(c):
    op = c["op"]
    a = arr(c["a"])
    with np.errstate(all="ignore"):
        if op in ("neg", "abs", "sqr", "relu") or (op in ("exp", "sqrt") and not is_int(a)) or op in ("log", "sin", "cos", "tanh", "sigmoid", "recip"):
            if op == "neg":
                return -a
            if op == "abs":
                return np.abs(a)
            if op == "sqr":
                return a * a
            if op == "relu":
                return np.maximum(a, a.dtype.type(0))
            one = a.dtype.type(1)
            return {
                "exp": np.exp, "log": np.log, "sqrt": np.sqrt, "sin": np.sin, "cos": np.cos, "tanh": np.tanh,
                "sigmoid": lambda x: one / (one + np.exp(-x)), "recip": lambda x: one / x,
            }[op](a)
        if op in ("exp", "sqrt"):  # integer input: float32, as PyTorch
            return getattr(np, op)(a.astype(np.float32))
        if op == "clamp":
            return scalar_op(scalar_op(a, "maximum_scalar", c["s"]), "minimum_scalar", c["hi"])
        if op.endswith("_scalar"):
            return scalar_op(a, op, c["s"])
        if op in ("add", "sub", "mul", "div", "maximum", "minimum", "eq", "lt", "ge"):
            b = arr(c["b"])
            if op == "div" and is_int(a):
                a, b = a.astype(np.float32), b.astype(np.float32)
            f = {"add": np.add, "sub": np.subtract, "mul": np.multiply, "div": np.divide, "maximum": np.maximum,
                 "minimum": np.minimum, "eq": np.equal, "lt": np.less, "ge": np.greater_equal}[op]
            out = f(a, b)
            return out.astype(np.uint8) if out.dtype == np.bool_ else out
        if op == "sum_all":
            return np.sum(a, dtype=np.float64).astype(a.dtype) if not is_int(a) else np.sum(a, dtype=a.dtype)
        if op == "max_all":
            return np.max(a)
        if op in ("sum", "max", "min", "argmax", "argmin", "mean"):
            d, keep = c["dim"], c["keepdim"]
            if op == "sum":
                return np.sum(a, axis=d, keepdims=keep, dtype=np.float64).astype(a.dtype) if not is_int(a) else np.sum(a, axis=d, keepdims=keep, dtype=a.dtype)
            if op == "mean":
                return np.mean(a.astype(np.float64), axis=d, keepdims=keep).astype(a.dtype)
            if op in ("max", "min"):
                return getattr(np, op)(a, axis=d, keepdims=keep)
            out = getattr(np, op)(a, axis=d).astype(np.int64)
            return np.expand_dims(out, d) if keep else out
        if op == "matmul":
            b = arr(c["b"])
            if is_int(a):
                return np.matmul(a, b)
            return np.matmul(a.astype(np.float64), b.astype(np.float64)).astype(a.dtype)
        if op == "cast":
            return a.astype(NP[c["out"]["dtype"]])
        if op in ("softmax", "log_softmax"):
            x = a.astype(np.float64)
            d = c["dim"]
            if x.size == 0:
                return a.copy()
            m = np.max(x, axis=d, keepdims=True)
            lse = np.log(np.sum(np.exp(x - m), axis=d, keepdims=True))
            out = x - m - lse
            return (np.exp(out) if op == "softmax" else out).astype(a.dtype)
        if op == "index_select":
            ids = arr(c["ids"]).astype(np.int64)
            return np.take(a, ids, axis=c["dim"])
        if op in ("gather", "scatter", "scatter_add"):
            return gather_scatter(a, c)
        if op in ("sort", "argsort", "topk", "topk_indices"):
            return sort_like(a, c)
        if op == "index":
            return a[tuple(selector(s, n) for s, n in zip(c["sels"], a.shape))]
        if op == "cat_narrow":
            b = arr(c["b"])
            cat = np.concatenate([a, b], axis=c["dim"])
            idx = [slice(None)] * cat.ndim
            idx[c["dim"]] = slice(c["start"], c["start"] + c["len"])
            return cat[tuple(idx)]
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
    if op in ("sum", "sum_all", "mean", "matmul", "softmax", "log_softmax"):
        return (1e-5, 1e-5)
    if op in ("exp", "log", "sin", "cos", "tanh", "sigmoid", "sqrt", "recip"):
        return (2e-6, 1e-6)
    return (1e-6, 0.0)


def main(path):
    counts, diffs = Counter(), []
    for line in open(path):
        c = json.loads(line)
        counts[c["op"]] += 1
        got = arr(c["out"])
        exp = np.asarray(expected(c))
        key = f'case {c["id"]} ({c["op"]} on {c["device"]})'
        if got.shape != exp.shape:
            diffs.append(f"{key}: shape {got.shape}, numpy {exp.shape}")
            continue
        want = c["out"]["dtype"]
        if name(exp) != want and not (exp.dtype == np.int64 and want == "i64"):
            diffs.append(f"{key}: dtype {want}, numpy {exp.dtype}")
            continue
        if is_int(got):
            ok = np.array_equal(got, exp)
        else:
            rtol, atol = tolerance(c, want)
            ok = np.allclose(got.astype(np.float64), exp.astype(np.float64), rtol=rtol, atol=atol, equal_nan=True)
            # Infinities must agree in sign, NaN in place.
            ok = ok and np.array_equal(np.isnan(got), np.isnan(exp))
        if not ok:
            diffs.append(f"{key}: kiln {got.ravel()[:8].tolist()}, numpy {exp.ravel()[:8].tolist()}; input {c['a']['data'][:8]}")
    total = sum(counts.values())
    print(f"differential vs numpy {np.__version__}: {total} cases, {len(diffs)} differences")
    print("  " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    for d in diffs[:40]:
        print("  DIFF " + d)
    return 1 if diffs else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
