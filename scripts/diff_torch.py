"""Recomputes kiln's gradient cases (JSON lines written by
kiln/tests/diff_torch.rs) with torch.autograd and reports every difference.

Each case holds the op, its parameters, the leaves (logical values, dtype,
shape), a weight w, kiln's output and kiln's gradient of sum(out * w) for
every leaf. PyTorch recomputes the output and the gradients in the same
dtype. max/min over a dimension are compared with torch.amax/amin (kiln's
max(dim) returns values only and, like amax, shares the gradient among ties;
torch.max(dim) gives it to the one index it returns).

Tolerance: a few ulps (4 * eps of the dtype) relative to each element, and
where the op sums or cancels (reductions, matmul, softmax, losses, sin, cos,
tanh, sigmoid, and gradients summed over broadcast dimensions) also 4 ulps
of the largest magnitude involved (the tensor's and w's), scaled by the
number of summed terms. An f32 element that misses this still passes when
kiln is at least as close as PyTorch to the exact value (PyTorch in f64).
NaN must be where PyTorch has NaN, infinities must agree. A gradient kiln
leaves unset (None) equals PyTorch's None or all-zero gradient.

Usage: python diff_torch.py CASES.jsonl   (exit status 1 on any difference)
"""
import json
import math
import sys
from collections import Counter

import torch
import torch.nn.functional as F

DT = {"f32": torch.float32, "f64": torch.float64, "i64": torch.int64, "i32": torch.int32, "u8": torch.uint8}

# Ops whose results sum terms or cancel: the tolerance grows with the largest
# magnitude in the tensor.
ACCUMULATING = {"gelu", "gelu_tanh", "silu", "logsumexp", "var", "std", "cumsum", "prod", "prod_all", "sum", "mean", "sum_all", "mean_all", "max", "min", "max_all", "min_all", "matmul", "softmax",
                "log_softmax", "mse_loss", "cross_entropy", "chain", "sin", "cos", "tanh", "sigmoid",
                "index_select", "index_add", "stack", "pow", "powf", "powi", "broadcast"}


def tensor(t, dtype=None):
    dt = DT[t["dtype"]]
    x = torch.tensor([float(v) for v in t["data"]], dtype=torch.float64)
    x = x.to(dt) if dtype is None else x.to(dt).to(dtype)
    return x.reshape(t["shape"])


def forward(c, T, dtype):
    """PyTorch's result of case c on the leaves T (dict of tensors)."""
    op = c["op"]
    a, b = T.get("a"), T.get("b")
    if c["family"] == "unary":
        return {
            "neg": lambda x: -x, "abs": torch.abs, "exp": torch.exp, "log": torch.log, "sqrt": torch.sqrt,
            "sqr": lambda x: x * x, "recip": torch.reciprocal, "sin": torch.sin, "cos": torch.cos,
            "tanh": torch.tanh, "sigmoid": torch.sigmoid, "relu": torch.relu, "erf": torch.erf,
            "gelu": F.gelu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"), "silu": F.silu,
        }[op](a)
    if c["family"] == "binary" or (c["family"] == "mixed" and op not in ("where", "cat")):
        return {"add": torch.add, "sub": torch.sub, "mul": torch.mul, "div": torch.div, "maximum": torch.maximum,
                "minimum": torch.minimum, "pow": torch.pow}[op](a, b)
    if c["family"] == "mixed" and op == "cat":
        return torch.cat([a, b], c["dim"])
    if c["family"] == "scalar":
        s, hi = c["s"], c["hi"]
        return {
            "add_scalar": lambda: a + s, "sub_scalar": lambda: a - s, "mul_scalar": lambda: a * s,
            "div_scalar": lambda: a / s, "maximum_scalar": lambda: torch.clamp(a, min=s),
            "minimum_scalar": lambda: torch.clamp(a, max=s), "clamp": lambda: torch.clamp(a, s, hi),
            "affine": lambda: a * s + hi,
        }[op]()
    if op == "powi":
        return torch.pow(a, int(c["n"]))
    if op == "powf":
        return torch.pow(a, float(c["p"]))
    if c["family"] == "reduce":
        if op == "sum_all":
            return a.sum()
        if op == "mean_all":
            return a.mean()
        if op == "max_all":
            return a.max()
        if op == "min_all":
            return a.min()
        if op == "prod_all":
            return a.prod()
        d, k = c["dim"], c["keepdim"]
        return {"sum": lambda: a.sum(d, keepdim=k), "mean": lambda: a.mean(d, keepdim=k),
                "max": lambda: torch.amax(a, d, keepdim=k), "min": lambda: torch.amin(a, d, keepdim=k),
                "prod": lambda: a.prod(d, keepdim=k), "cumsum": lambda: a.cumsum(d),
                "logsumexp": lambda: torch.logsumexp(a, d, keepdim=k),
                "var": lambda: torch.var(a, d, correction=c.get("correction"), keepdim=k),
                "std": lambda: torch.std(a, d, correction=c.get("correction"), keepdim=k)}[op]()
    if op == "matmul":
        return torch.matmul(a, b)
    if op == "softmax":
        return torch.softmax(a, c["dim"])
    if op == "log_softmax":
        return torch.log_softmax(a, c["dim"])
    if op == "mse_loss":
        return F.mse_loss(a, b)
    if op == "cross_entropy":
        return F.cross_entropy(a, tensor(c["labels"]).long())
    if op == "index_select":
        return torch.index_select(a, c["dim"], tensor(c["ids"]).long())
    if op == "index_add":
        return torch.index_add(a, c["dim"], tensor(c["ids"]).long(), b)
    if op == "cat":
        return torch.cat([a, b], c["dim"])
    if op == "stack":
        return torch.stack([a, b, a], c["dim"])
    if c["family"] == "view":
        if op == "narrow":
            y = a.narrow(c["dim"], c["start"], c["len"])
        elif op == "transpose":
            y = a.transpose(c["i"], c["j"])
        elif op == "permute":
            y = a.permute(c["perm"])
        elif op == "broadcast":
            y = a.expand(c["to"])
        elif op == "reshape":
            y = a.reshape(c["to"])
        else:
            u = a.unsqueeze(c["dim"])
            y = (u * u).squeeze(c["dim"])
        return y * (y.detach() + 1.0)
    if op == "cast_sqr":
        other = torch.float64 if c["inputs"]["a"]["dtype"] == "f32" else torch.float32
        x = a.to(other)
        return (x * x).to(dtype)
    if op == "where":
        return torch.where(tensor(c["cond"]).bool(), a, b)
    if op == "chain":
        return torch.log_softmax(torch.tanh(a @ b + T["c"]), -1).sum(-1)
    raise ValueError(f"unknown op {op}")


def run(c, dtype):
    """(output, {leaf: grad or None}) from PyTorch, computing in dtype (a
    case of two dtypes, family "mixed", keeps each leaf's own dtype and lets
    PyTorch promote, unless dtype is the f64 of the exact rerun)."""
    own = c["family"] == "mixed" and dtype == DT[c["out"]["dtype"]]
    T = {k: (tensor(v) if own else tensor(v, dtype)).requires_grad_() for k, v in c["inputs"].items()}
    y = forward(c, T, dtype)
    w = tensor(c["w"], dtype)
    loss = (y * w).sum()
    if loss.requires_grad:
        loss.backward()
    grads = {k: (None if t.grad is None else t.grad) for k, t in T.items()}
    y = y.detach()
    if c["op"] == "gelu":
        # The documented difference: gelu(+inf) = +inf (PyTorch's vectorised
        # f32 CPU kernel gives NaN, its scalar path and f64 +inf).
        y = torch.where(torch.isposinf(T["a"].detach()), T["a"].detach(), y)
    amax_nan_convention(c, T, grads)
    prod_nonfinite_convention(c, grads)
    return y, grads


def amax_nan_convention(c, T, grads):
    """The documented difference for max/min over a dimension with a NaN in
    a slice: torch.amax gives every element of that slice a NaN gradient
    (scale_grad_by_count with no element equal to the NaN result); kiln
    shares the gradient among the slice's NaNs, as torch.max() (all) and
    torch.max(dim) (the NaN's index) do. Recomputes kiln's convention."""
    if c["family"] != "reduce" or c["op"] not in ("max", "min") or "a" not in grads:
        return
    a = tensor(c["inputs"]["a"], grads["a"].dtype)
    d = c["dim"]
    if not torch.isnan(a).any():
        return
    out = (torch.amax if c["op"] == "max" else torch.amin)(a, d, keepdim=True)
    w = tensor(c["w"], a.dtype)
    w = w if c["keepdim"] else w.unsqueeze(d)
    has_nan = torch.isnan(a).any(d, keepdim=True)
    mask = torch.where(has_nan, torch.isnan(a), a == out).to(a.dtype)
    grads["a"] = w * mask / mask.sum(d, keepdim=True)


def prod_nonfinite_convention(c, grads):
    """The documented difference for prod's gradient when the input holds
    +-inf or NaN: PyTorch switches between result/input and products of
    the others depending on whether any element of the whole tensor is 0,
    so a slice's gradient depends on other slices; kiln decides per slice
    (result/input where it has no zero, the product of the others at its
    only zero, else 0; the identity for a product of one element), which is
    what PyTorch gives for a tensor without zeros. Recomputes kiln's rule."""
    if c["family"] != "reduce" or c["op"] not in ("prod", "prod_all") or "a" not in grads:
        return
    a = tensor(c["inputs"]["a"], grads["a"].dtype)
    if torch.isfinite(a).all() or a.numel() == 0:
        return
    w = tensor(c["w"], a.dtype)
    if a.numel() == math.prod(c["out"]["shape"]):
        # A product of one element: the identity, whatever its value.
        grads["a"] = w.reshape(a.shape)
        return
    if c["op"] == "prod_all":
        dims, w = list(range(a.dim())), w.reshape([1] * a.dim())
    else:
        dims = [c["dim"] % a.dim()]
        w = w if c["keepdim"] else w.unsqueeze(dims[0])
    zero = a == 0
    zeros = zero.sum(dims, keepdim=True)
    unz = torch.where(zero, torch.ones_like(a), a)
    y = a.prod(dims[0], keepdim=True) if len(dims) == 1 else a.reshape(-1).prod().reshape([1] * a.dim())
    rest = unz.prod(dims[0], keepdim=True) if len(dims) == 1 else unz.reshape(-1).prod().reshape([1] * a.dim())
    z = torch.zeros_like(a)
    g = torch.where(zero, torch.where(zeros == 1, rest, z), torch.where(zeros == 0, y / unz, z))
    grads["a"] = w * g


def compare(c, what, got, want, exact):
    """None when kiln's `got` matches PyTorch's `want`, else a message."""
    if list(got.shape) != list(want.shape):
        return f"{what}: shape {list(got.shape)}, torch {list(want.shape)}"
    if got.numel() == 0:
        return None
    g, t = got.double(), want.double()
    eps = torch.finfo(want.dtype).eps
    r = 4 * eps
    nan_g, nan_t = torch.isnan(g), torch.isnan(t)
    bad = nan_g != nan_t
    inf = torch.isinf(t) | torch.isinf(g)
    bad |= inf & (g != t) & ~nan_g & ~nan_t
    fin = ~nan_g & ~nan_t & ~inf
    tol = r * torch.maximum(g.abs(), t.abs())
    # A gradient summed over broadcast dimensions (smaller than the output) accumulates too.
    summed = what.startswith("grad") and got.numel() < math.prod(c["out"]["shape"])
    if summed or c["op"] in ACCUMULATING or c["family"] in ("reduce", "loss", "softmax", "matmul", "chain"):
        # Backward is linear in the incoming gradient w: its rounding error
        # is a few ulps of the magnitudes involved, w's included.
        finite = torch.cat([t[torch.isfinite(t)].reshape(-1), tensor(c["w"]).double().reshape(-1)])
        finite = finite[torch.isfinite(finite)]
        big = finite.abs().max().item() if finite.numel() else 0.0
        terms = max(int(math.prod(v["shape"])) for v in c["inputs"].values()) if c["inputs"] else 1
        tol = tol + r * big * max(1, terms) ** 0.5 * 2
    off = fin & ((g - t).abs() > tol)
    if exact is not None and off.any():
        # kiln at least as close to the exact value as PyTorch is.
        e = exact.double()
        off &= (g - e).abs() > 2 * (t - e).abs() + r * e.abs()
    bad |= off
    if not bad.any():
        return None
    i = bad.reshape(-1).nonzero()[0].item()
    return (f"{what}: {int(bad.sum())} of {bad.numel()} elements differ, first at flat index {i}: "
            f"kiln {g.reshape(-1)[i].item()!r}, torch {t.reshape(-1)[i].item()!r}")


def main(path):
    counts, families, diffs, none_zero = Counter(), Counter(), [], 0
    for line in open(path):
        c = json.loads(line)
        counts[c["op"]] += 1
        families[c["family"]] += 1
        dtype = DT[c["out"]["dtype"]]
        key = f'case {c["id"]} ({c["op"]} {c["out"]["dtype"]} on {c["device"]})'
        try:
            y, grads = run(c, dtype)
            y64, grads64 = run(c, torch.float64) if dtype == torch.float32 else (None, {})
        except Exception as e:  # noqa: BLE001 -- a case PyTorch refuses is a difference too
            diffs.append(f"{key}: torch raised {type(e).__name__}: {e}")
            continue
        msgs = []
        m = compare(c, "out", tensor(c["out"]), y, y64)
        if m:
            msgs.append(m)
        for name, kg in c["grads"].items():
            tg = grads[name]
            if kg is None or tg is None:
                if kg is None and tg is None:
                    continue
                other = tg if kg is None else tensor(kg)
                if not other.abs().gt(0).any() and not other.isnan().any():
                    none_zero += 1
                    continue
                msgs.append(f"grad {name}: kiln {'None' if kg is None else 'a tensor'}, torch {'None' if tg is None else 'a tensor'}")
                continue
            m = compare(c, f"grad {name}", tensor(kg), tg, grads64.get(name))
            if m:
                msgs.append(m)
        if msgs:
            shapes = {k: v["shape"] for k, v in c["inputs"].items()}
            params = {k: v for k, v in c.items() if k not in ("id", "device", "family", "op", "inputs", "w", "out", "grads")}
            ins = {k: v["data"][:6] for k, v in c["inputs"].items()}
            diffs.append(f"{key} shapes {shapes} {params}: " + "; ".join(msgs) + f"; inputs {ins}")
    total = sum(counts.values())
    print(f"differential vs torch {torch.__version__} (autograd): {total} cases, {len(diffs)} differences")
    print("  families: " + ", ".join(f"{k} {v}" for k, v in sorted(families.items())))
    print("  ops: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    if none_zero:
        print(f"  {none_zero} gradients kiln left unset where torch has zeros (or the reverse): equal")
    for d in diffs[:60]:
        print("  DIFF " + d)
    return 1 if diffs else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
