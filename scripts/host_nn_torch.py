#!/usr/bin/env python3
"""Recomputes the cases of kiln/tests/host_nn_torch.rs with PyTorch and reports every
difference: the forward and every gradient (autograd of sum(y * dy)) of conv2d,
conv_transpose2d, max_pool2d (values and indices), avg_pool2d, adaptive_avg_pool2d,
batch norm (output, saved statistics, running statistics), layer norm and interpolate,
within 1e-10 (f64) or 1e-5 (f32) of each result's scale (the larger of 1 and its largest
finite magnitude), NaN and infinities in the same places; and, for the argument cases,
that kiln refuses exactly what PyTorch refuses and agrees on the output shape.

    python scripts/host_nn_torch.py cases.jsonl

Exit status 0 when everything agrees, 1 otherwise (each failure listed, grouped by op and
result: a bug class).
"""
import json
import math
import sys
from collections import defaultdict

import torch
import torch.nn.functional as F
import warnings

warnings.filterwarnings("ignore", message="Using padding='same'")

TOL = {"f32": 1e-5, "f64": 1e-10}
# The largest error seen per (op, dtype), relative to the result's scale.
WORST = {}
# Cases where kiln and PyTorch differ by design (counted, listed in the report).
DOCUMENTED = {}
DT = {"f32": torch.float32, "f64": torch.float64}
torch.set_num_threads(1)


def t(case, key, shape=None, grad=True, exact=False):
    """The case's values as a tensor of its dtype (f64 when `exact`: the inputs of f32
    cases are exact in f64 too)."""
    v = torch.tensor(case[key], dtype=torch.float64).to(torch.float64 if exact else DT[case["dtype"]])
    if shape is not None:
        v = v.reshape(shape)
    return v.requires_grad_(grad)


def compare(failures, case, what, kiln, ref, tol=None, peer=None):
    """kiln's result against `ref`. `peer` is PyTorch's own result in the case's dtype where
    `ref` is computed in f64: an error beyond the tolerance passes when, element by element,
    it is within the tolerance plus twice PyTorch's own error on the same inputs (an
    ill-conditioned case, such as batch norm over two samples whose invstd is 60, where f32
    rounding is amplified for anyone)."""
    tol = TOL[case["dtype"]] if tol is None else tol
    k = torch.tensor(kiln, dtype=torch.float64).flatten()
    r = ref.detach().to(torch.float64).flatten()
    if k.numel() != r.numel():
        failures.append((case["op"], what, f"{k.numel()} elements, PyTorch {r.numel()}"))
        return
    if k.numel() == 0:
        return
    kn, rn = torch.isnan(k), torch.isnan(r)
    if not torch.equal(kn, rn):
        i = int((kn != rn).nonzero()[0])
        failures.append((case["op"], what, f"NaN at different places (element {i}: kiln {k[i].item()}, PyTorch {r[i].item()})"))
        return
    ki, ri = torch.isinf(k), torch.isinf(r)
    if not torch.equal(ki, ri) or not torch.equal(k[ki], r[ri]):
        failures.append((case["op"], what, "infinities differ"))
        return
    fin = ~(kn | ki)
    if fin.any():
        scale = max(1.0, r[fin].abs().max().item())
        err = (k[fin] - r[fin]).abs().max().item()
        key = (case["op"], case["dtype"])
        if err / scale >= WORST.get(key, (0.0, ""))[0]:
            WORST[key] = (err / scale, what)
        if err > tol * scale and peer is not None:
            # Element by element: each of kiln's errors within the tolerance plus twice
            # PyTorch's own error at that element, so that an ill-conditioned channel
            # cannot excuse an error in a well-conditioned one.
            p = peer.detach().to(torch.float64).flatten()
            peer_err = (p - r).abs().nan_to_num(0.0, posinf=0.0, neginf=0.0)
            if bool(((k - r).abs()[fin] <= tol * scale + 2 * peer_err[fin]).all()):
                why = f"{case['op']} {what} [{case['dtype']}]: beyond {tol:.0e} of the scale, within twice PyTorch's own {case['dtype']} error element by element"
                DOCUMENTED[why] = DOCUMENTED.get(why, 0) + 1
                return
        if err > tol * scale:
            i = int(((k - r).abs().nan_to_num(0.0) * fin).argmax())
            failures.append((case["op"], what, f"max error {err:.3e} > {tol:.0e} x {scale:.3g} (element {i}: kiln {k[i].item()!r}, PyTorch {r[i].item()!r})"))


def grads(y, dy, *leaves):
    (y * dy).sum().backward()
    return [None if v is None else (v.grad if v.grad is not None else torch.zeros_like(v)) for v in leaves]


def conv2d(c, fail):
    x, w = t(c, "x", c["x_shape"]), t(c, "w", c["w_shape"])
    b = t(c, "b") if c["bias"] else None
    top, bottom, left, right = c["padding"]
    if c["x_shape"][1] == 0:
        # No input channels: PyTorch returns an output of 0 channels; kiln (a documented
        # difference) returns the sum over no inputs, the bias, with out_channels channels.
        DOCUMENTED["conv2d with no input channels: PyTorch's output has 0 channels, kiln's out_channels (the bias)"] = DOCUMENTED.get(
            "conv2d with no input channels: PyTorch's output has 0 channels, kiln's out_channels (the bias)", 0) + 1
        n, oc = c["x_shape"][0], c["w_shape"][0]
        dy = t(c, "dy", grad=False)
        spatial = dy.numel() // max(1, n * oc)
        y = torch.zeros(n, oc, spatial, dtype=dy.dtype) + (b.detach().reshape(1, oc, 1) if b is not None else 0)
        compare(fail, c, "forward (no input channels)", c["y"], y)
        if b is not None:
            compare(fail, c, "grad bias (no input channels)", c["gb"], dy.reshape(n, oc, spatial).sum((0, 2)))
        return
    if c["same"]:
        y = F.conv2d(x, w, b, stride=1, padding="same", dilation=c["dilation"], groups=c["groups"])
    elif top == bottom and left == right:
        y = F.conv2d(x, w, b, stride=c["stride"], padding=(top, left), dilation=c["dilation"], groups=c["groups"])
    else:
        y = F.conv2d(F.pad(x, (left, right, top, bottom)), w, b, stride=c["stride"], dilation=c["dilation"], groups=c["groups"])
    dy = t(c, "dy", y.shape, grad=False)
    compare(fail, c, "forward", c["y"], y)
    gx, gw, gb = grads(y, dy, x, w, b)
    compare(fail, c, "grad input", c["gx"], gx)
    compare(fail, c, "grad weight", c["gw"], gw)
    if b is not None:
        compare(fail, c, "grad bias", c["gb"], gb)


def conv_transpose2d(c, fail):
    x, w = t(c, "x", c["x_shape"]), t(c, "w", c["w_shape"])
    b = t(c, "b") if c["bias"] else None
    y = F.conv_transpose2d(x, w, b, stride=c["stride"], padding=c["padding"], output_padding=c["output_padding"],
                           groups=c["groups"], dilation=c["dilation"])
    dy = t(c, "dy", y.shape, grad=False)
    compare(fail, c, "forward", c["y"], y)
    gx, gw, gb = grads(y, dy, x, w, b)
    compare(fail, c, "grad input", c["gx"], gx)
    compare(fail, c, "grad weight", c["gw"], gw)
    if b is not None:
        compare(fail, c, "grad bias", c["gb"], gb)


def max_pool2d(c, fail):
    x = t(c, "x", c["x_shape"])
    y, idx = F.max_pool2d(x, c["kernel"], c["stride"], c["padding"], c["dilation"], ceil_mode=c["ceil_mode"], return_indices=True)
    dy = t(c, "dy", y.shape, grad=False)
    compare(fail, c, "forward", c["y"], y, tol=0.0)
    if c["indices"] != idx.flatten().tolist():
        k, r = c["indices"], idx.flatten().tolist()
        i = next(i for i in range(len(k)) if k[i] != r[i]) if len(k) == len(r) else 0
        fail.append((c["op"], "indices", f"element {i}: kiln {k[i] if i < len(k) else '-'}, PyTorch {r[i] if i < len(r) else '-'}"))
    if x.numel() and y.numel():
        # A window that covers no input element has an index that may lie outside the
        # plane; PyTorch's backward scatters its gradient there anyway (into another
        # plane, or past the buffer: it corrupts the heap), kiln drops it. For those
        # cases the gradient is PyTorch's rule without the out-of-plane writes.
        plane = c["x_shape"][2] * c["x_shape"][3]
        if all(i < plane for i in c["indices"]):
            (gx,) = grads(y, dy, x)
        else:
            gx = torch.zeros_like(x).flatten(2)
            flat_dy, flat_idx = dy.flatten(2), idx.flatten(2)
            for n in range(flat_idx.shape[0]):
                for ch in range(flat_idx.shape[1]):
                    for o in range(flat_idx.shape[2]):
                        i = int(flat_idx[n, ch, o])
                        if i < plane:
                            gx[n, ch, i] += flat_dy[n, ch, o]
        compare(fail, c, "grad input", c["gx"], gx)


def avg_pool2d(c, fail):
    x = t(c, "x", c["x_shape"])
    y = F.avg_pool2d(x, c["kernel"], c["stride"], c["padding"], ceil_mode=c["ceil_mode"],
                     count_include_pad=c["count_include_pad"], divisor_override=c["divisor_override"])
    dy = t(c, "dy", y.shape, grad=False)
    compare(fail, c, "forward", c["y"], y)
    if x.numel():
        (gx,) = grads(y, dy, x)
        compare(fail, c, "grad input", c["gx"], gx)


def adaptive_avg_pool2d(c, fail):
    x = t(c, "x", c["x_shape"])
    y = F.adaptive_avg_pool2d(x, c["output"])
    dy = t(c, "dy", y.shape, grad=False)
    compare(fail, c, "forward", c["y"], y)
    if x.numel():
        (gx,) = grads(y, dy, x)
        compare(fail, c, "grad input", c["gx"], gx)


# Normalisation in f32 is compared with PyTorch computing in f64 on the same inputs:
# PyTorch's own f32 result carries rounding amplified by invstd (a constant row has
# invstd = 1/sqrt(eps) = 316 at eps = 1e-5, and PyTorch's f32 gradient there is 3e-5
# where the exact one, and kiln's, is 0).


def batch_norm_in_dtype(c):
    """PyTorch's batch norm in the case's own dtype: the forward and the gradients."""
    x = t(c, "x", c["x_shape"])
    w, b = (t(c, "w"), t(c, "b")) if c["affine"] else (None, None)
    rm, rv = t(c, "rm", grad=False), t(c, "rv", grad=False)
    y = F.batch_norm(x, rm, rv, w, b, training=c["training"], momentum=c["momentum"], eps=c["eps"])
    dy = t(c, "dy", y.shape, grad=False)
    return (y, *grads(y, dy, x, w, b))[:3]


def batch_norm(c, fail):
    peer = batch_norm_in_dtype(c) if c["dtype"] != "f64" else (None, None, None)
    x = t(c, "x", c["x_shape"], exact=True)
    w, b = (t(c, "w", exact=True), t(c, "b", exact=True)) if c["affine"] else (None, None)
    rm, rv = t(c, "rm", grad=False, exact=True), t(c, "rv", grad=False, exact=True)
    if c["training"]:
        _, mean, invstd = torch.native_batch_norm(x.detach(), None if w is None else w.detach(), None if b is None else b.detach(),
                                                  rm.clone(), rv.clone(), True, c["momentum"], c["eps"])
        compare(fail, c, "saved mean", c["mean"], mean)
        compare(fail, c, "saved invstd", c["invstd"], invstd)
    y = F.batch_norm(x, rm, rv, w, b, training=c["training"], momentum=c["momentum"], eps=c["eps"])
    compare(fail, c, "forward", c["y"], y, peer=peer[0])
    compare(fail, c, "running mean", c["rm_after"], rm)
    compare(fail, c, "running var", c["rv_after"], rv)
    dy = t(c, "dy", y.shape, grad=False, exact=True)
    gx, gw, gb = grads(y, dy, x, w, b)
    compare(fail, c, "grad input", c["gx"], gx, peer=peer[1])
    if w is not None:
        compare(fail, c, "grad weight", c["gw"], gw, peer=peer[2])
        # The bias gradient is a sum of dy, which invstd does not touch: no excuse.
        compare(fail, c, "grad bias", c["gb"], gb)


def layer_norm(c, fail):
    x = t(c, "x", c["x_shape"], exact=True)
    w, b = (t(c, "w", c["normalized_shape"], exact=True), t(c, "b", c["normalized_shape"], exact=True)) if c["affine"] else (None, None)
    y = F.layer_norm(x, c["normalized_shape"], w, b, eps=c["eps"])
    compare(fail, c, "forward", c["y"], y)
    if x.numel():
        _, mean, rstd = torch.native_layer_norm(x.detach(), c["normalized_shape"], None, None, c["eps"])
        compare(fail, c, "saved mean", c["mean"], mean)
        compare(fail, c, "saved rstd", c["rstd"], rstd)
        dy = t(c, "dy", y.shape, grad=False, exact=True)
        gx, gw, gb = grads(y, dy, x, w, b)
        compare(fail, c, "grad input", c["gx"], gx)
        if w is not None:
            compare(fail, c, "grad weight", c["gw"], gw)
            compare(fail, c, "grad bias", c["gb"], gb)


def interpolate(c, fail):
    x = t(c, "x", c["x_shape"])
    kw = {"mode": c["mode"]}
    if c["mode"] == "bilinear":
        kw["align_corners"] = c["align_corners"]
    if "size" in c:
        kw["size"] = c["size"]
    else:
        kw["scale_factor"] = c["scale_factor"]
    y = F.interpolate(x, **kw)
    compare(fail, c, "forward", c["y"], y)
    if x.numel():
        dy = t(c, "dy", y.shape, grad=False)
        (gx,) = grads(y, dy, x)
        compare(fail, c, "grad input", c["gx"], gx)


def torch_verdict(call):
    try:
        with torch.no_grad():
            out = call()
        if isinstance(out, tuple):
            out = out[0]
        return list(out.shape), None
    except (RuntimeError, ValueError, IndexError) as e:
        return None, str(e).splitlines()[0]


def args_case(c, fail):
    z = lambda s: torch.zeros(s, dtype=torch.float64)
    op = c["op"]
    if op == "conv2d_args":
        top, bottom, left, right = c["padding"]

        def call():
            x = z(c["x_shape"])
            if top != bottom or left != right:
                x = F.pad(x, (left, right, top, bottom))
                return F.conv2d(x, z(c["w_shape"]), None, c["stride"], 0, c["dilation"], c["groups"])
            return F.conv2d(x, z(c["w_shape"]), None, c["stride"], (top, left), c["dilation"], c["groups"])
    elif op == "conv_transpose2d_args":
        def call():
            return F.conv_transpose2d(z(c["x_shape"]), z(c["w_shape"]), None, c["stride"], c["padding"], c["output_padding"],
                                      c["groups"], c["dilation"])
    elif op == "max_pool2d_args":
        def call():
            return F.max_pool2d(z(c["x_shape"]), c["kernel"], c["stride"], c["padding"], c["dilation"], ceil_mode=c["ceil_mode"])
    elif op == "avg_pool2d_args":
        def call():
            return F.avg_pool2d(z(c["x_shape"]), c["kernel"], c["stride"], c["padding"], c["ceil_mode"], c["count_include_pad"],
                                c["divisor_override"])
    else:
        def call():
            return F.interpolate(z(c["x_shape"]), size=c["size"], mode="bilinear", align_corners=False)
    shape, err = torch_verdict(call)
    kshape, kerr = c.get("kiln_shape"), c.get("kiln_error")
    # Documented differences. With an empty batch PyTorch skips some argument checks
    # (a zero dilation, and the kernel size against the input): kiln checks the
    # arguments whatever the batch. With no input channels PyTorch's conv2d output has
    # no channels; kiln's has out_channels (the bias).
    if op == "conv2d_args" and 0 in c["x_shape"][2:] and (c["padding"][0] != c["padding"][1] or c["padding"][2] != c["padding"][3]):
        # Asymmetric padding is F.pad then conv2d in PyTorch, which sees a non-empty padded image.
        return
    if 0 in c["x_shape"][:2] and shape is not None and kerr is not None:
        why = f"{op[:-5]} of an empty input: PyTorch skips a check kiln makes ({kerr.split(': ', 1)[1].split(',')[0]})"
        DOCUMENTED[why] = DOCUMENTED.get(why, 0) + 1
        return
    if op == "conv2d_args" and c["x_shape"][1] == 0 and shape is not None and kshape is not None:
        shape = [shape[0], c["w_shape"][0], shape[2], shape[3]]
    if (shape is None) != (kshape is None):
        fail.append((op, "verdict", f"{c} -> PyTorch {'refuses: ' + err if err else 'accepts ' + str(shape)}; kiln "
                     f"{'refuses: ' + kerr if kerr else 'accepts ' + str(kshape)}"))
    elif shape is not None and shape != kshape:
        fail.append((op, "shape", f"{c}: PyTorch {shape}, kiln {kshape}"))


OPS = {f.__name__: f for f in (conv2d, conv_transpose2d, max_pool2d, avg_pool2d, adaptive_avg_pool2d, batch_norm, layer_norm, interpolate)}


def main():
    cases = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
    failures, counts = [], defaultdict(int)
    for i, c in enumerate(cases):
        fail = []
        op = c["op"]
        counts[op] += 1
        try:
            (args_case if op.endswith("_args") else OPS[op])(c, fail)
        except Exception as e:  # PyTorch refused a case kiln ran
            fail.append((op, "PyTorch raised", f"{type(e).__name__}: {str(e).splitlines()[0]}"))
        for f in fail:
            failures.append((i, c.get("dtype", "-"), *f))
    print("cases: " + ", ".join(f"{op} {n}" for op, n in counts.items()))
    print("largest error relative to the result's scale:")
    for (op, dt), (e, what) in sorted(WORST.items()):
        print(f"  {op:<20} {dt}  {e:.1e}  ({what})")
    for why, n in sorted(DOCUMENTED.items()):
        print(f"documented difference, {n} cases: {why}")
    if not failures:
        print(f"all {len(cases)} cases agree with PyTorch {torch.__version__}")
        return 0
    classes = defaultdict(list)
    for i, dtype, op, what, msg in failures:
        classes[(op, what, dtype)].append((i, msg))
    print(f"{len(failures)} differences in {len(classes)} bug classes (op, result, dtype):")
    for (op, what, dtype), items in sorted(classes.items()):
        print(f"  {op} {what} [{dtype}]: {len(items)} cases, e.g. case {items[0][0]}: {items[0][1]}")
        for i, msg in items[1:3]:
            print(f"      case {i}: {msg}")
    return 1


if __name__ == "__main__":
    sys.exit(main())
