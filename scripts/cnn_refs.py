# Reference values of kiln/tests/cnn.rs (written to kiln/tests/common/cnn_refs.rs): PyTorch 2.x CPU, f64.
# Run: python scripts/cnn_refs.py (with torch installed), then copy /tmp/cnnref/refs.rs.
import torch, torch.nn.functional as F
torch.set_default_dtype(torch.float64)
def seq(n, a=7, m=11, s=5, d=4.0):
    return torch.tensor([((i*a) % m - s)/d for i in range(n)])
def fmt(t): return "&[" + ", ".join(repr(float(v)) for v in t.detach().flatten()) + "]"
out=[]
def emit(name, t): out.append(f"const {name}: &[f64] = {fmt(t)};")
# conv: x [2,4,5,6], w [6,2,3,2] groups 2, stride (2,1), padding (2,1), dilation (1,2), bias
x = seq(2*4*5*6).reshape(2,4,5,6).requires_grad_()
w = seq(6*2*3*2, 5, 13, 6, 5.0).reshape(6,2,3,2).requires_grad_()
b = seq(6, 3, 7, 3, 2.0).requires_grad_()
y = F.conv2d(x, w, b, stride=(2,1), padding=(2,1), dilation=(1,2), groups=2)
print("conv y", y.shape)
gy = seq(y.numel(), 3, 17, 8, 8.0).reshape(y.shape)
(y*gy).sum().backward()
emit("CONV_Y", y); emit("CONV_GX", x.grad); emit("CONV_GW", w.grad); emit("CONV_GB", b.grad)
# same padding, even kernel
x2 = seq(1*2*5*5).reshape(1,2,5,5); w2 = seq(3*2*2*4,5,13,6,5.0).reshape(3,2,2,4)
y2 = F.conv2d(x2, w2, None, padding="same", dilation=(2,1)); print("same", y2.shape); emit("SAME_Y", y2)
# conv transpose: x [1,2,3,3], w [2,3,3,3], stride 2, padding 1, output_padding 1
x3 = seq(18).reshape(1,2,3,3).requires_grad_(); w3 = seq(54,5,13,6,5.0).reshape(2,3,3,3).requires_grad_(); b3=seq(3,3,7,3,2.0).requires_grad_()
y3 = F.conv_transpose2d(x3, w3, b3, stride=2, padding=1, output_padding=1); print("convT", y3.shape)
gy3 = seq(y3.numel(),3,17,8,8.0).reshape(y3.shape); (y3*gy3).sum().backward()
emit("CONVT_Y", y3); emit("CONVT_GX", x3.grad); emit("CONVT_GW", w3.grad); emit("CONVT_GB", b3.grad)
# max pool: x [2,2,7,6] kernel 3 stride 2 padding 1 dilation (1,2)? padding <= kernel/2; ceil_mode
xm = seq(2*2*7*6, 13, 29, 14, 7.0).reshape(2,2,7,6).requires_grad_()
ym = F.max_pool2d(xm, 3, stride=2, padding=1, dilation=(1,2), ceil_mode=True); print("max", ym.shape)
gm = seq(ym.numel(),3,17,8,8.0).reshape(ym.shape); (ym*gm).sum().backward()
emit("MAX_Y", ym); emit("MAX_GX", xm.grad)
# avg pool: kernel (3,2), stride 2, padding 1, ceil_mode, count_include_pad False
xa = seq(2*2*7*6, 13, 29, 14, 7.0).reshape(2,2,7,6).requires_grad_()
ya = F.avg_pool2d(xa, (3,2), stride=2, padding=1, ceil_mode=True, count_include_pad=False); print("avg", ya.shape)
ga = seq(ya.numel(),3,17,8,8.0).reshape(ya.shape); (ya*ga).sum().backward()
emit("AVG_Y", ya); emit("AVG_GX", xa.grad)
ya2 = F.avg_pool2d(xa.detach(), 3, stride=2, padding=1); print("avg2", ya2.shape); emit("AVG2_Y", ya2)
# adaptive: [1,2,7,5] -> (3,2)
xd = seq(70, 13, 29, 14, 7.0).reshape(1,2,7,5).requires_grad_()
yd = F.adaptive_avg_pool2d(xd, (3,2)); gd = seq(yd.numel(),3,17,8,8.0).reshape(yd.shape); (yd*gd).sum().backward()
emit("ADA_Y", yd); emit("ADA_GX", xd.grad)
# batch norm training [3,2,2,2]
xb = seq(24, 13, 29, 14, 7.0).reshape(3,2,2,2).requires_grad_()
wb = torch.tensor([1.5, -0.5]).requires_grad_(); bb = torch.tensor([0.25, 1.0]).requires_grad_()
rm = torch.tensor([0.1, -0.2]); rv = torch.tensor([1.0, 2.0])
yb = F.batch_norm(xb, rm, rv, wb, bb, training=True, momentum=0.1, eps=1e-5)
gb = seq(24,3,17,8,8.0).reshape(3,2,2,2); (yb*gb).sum().backward()
emit("BN_Y", yb); emit("BN_GX", xb.grad); emit("BN_GW", wb.grad); emit("BN_GB", bb.grad); emit("BN_RM", rm); emit("BN_RV", rv)
xe = xb.detach().clone().requires_grad_()
ye = F.batch_norm(xe, rm, rv, wb.detach(), bb.detach(), training=False, eps=1e-5); (ye*gb).sum().backward()
emit("BNE_Y", ye); emit("BNE_GX", xe.grad)
# layer norm [2,3,4] normalized [3,4]
xl = seq(24, 13, 29, 14, 7.0).reshape(2,3,4).requires_grad_()
wl = seq(12, 5, 13, 6, 5.0).reshape(3,4).requires_grad_(); bl = seq(12,3,7,3,2.0).reshape(3,4).requires_grad_()
yl = F.layer_norm(xl, (3,4), wl, bl, eps=1e-5); gl = seq(24,3,17,8,8.0).reshape(2,3,4); (yl*gl).sum().backward()
emit("LN_Y", yl); emit("LN_GX", xl.grad); emit("LN_GW", wl.grad); emit("LN_GB", bl.grad)
open("/tmp/cnnref/refs.rs","w").write("\n".join(out)+"\n")
# interpolate [1,2,3,5] -> (5,4)
out2=[]
for name, kw in [("NEAREST", dict(mode="nearest")), ("BILINEAR", dict(mode="bilinear", align_corners=False)), ("BILINEAR_AC", dict(mode="bilinear", align_corners=True))]:
    xi = seq(30, 13, 29, 14, 7.0).reshape(1,2,3,5).requires_grad_()
    yi = F.interpolate(xi, size=(5,4), **kw); gi = seq(yi.numel(),3,17,8,8.0).reshape(yi.shape); (yi*gi).sum().backward()
    out2.append(f"const {name}_Y: &[f64] = {fmt(yi)};"); out2.append(f"const {name}_GX: &[f64] = {fmt(xi.grad)};")
open("/tmp/cnnref/refs.rs","a").write("\n".join(out2)+"\n")
