#!/usr/bin/env python3
"""PyTorch on the GPU beside `kiln bench --device gpu(0)` and `kiln train`:
the same workloads, sizes and timing, so scripts/gpu-check.sh can print the
two side by side on a machine with an NVIDIA GPU.

    python3 scripts/gpu_peer_torch.py            # W1-W5, LeNet and ResNet-18 epochs
    python3 scripts/gpu_peer_torch.py --quick    # small sizes, as `kiln bench --quick`

Each workload is warmed up, then timed as the median of N runs, with
torch.cuda.synchronize() where kiln's run ends in block_until_ready or a host
read. Matrix products run in full f32 (TF32 off), as kiln's cuBLAS calls do.
The networks train on synthetic 28x28 images held on the GPU (4096 to train,
1024 to validate, 4 classes, batch 256, SGD lr 0.1), as `kiln train --model
lenet|resnet18` without --data: an epoch is the training batches, the
validation pass and one read of the losses to the host.
"""
import argparse
import json
import statistics
import sys
import time


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--epochs", type=int, default=4)
    args = ap.parse_args()
    try:
        import torch
        from torch import nn
    except ImportError:
        print("SKIPPED: PyTorch is not installed in " + sys.executable)
        return 0
    if not torch.cuda.is_available():
        print("SKIPPED: PyTorch sees no CUDA device")
        return 0
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cudnn.benchmark = True
    dev = torch.device("cuda:0")
    sync = torch.cuda.synchronize
    quick = args.quick
    print(f"torch {torch.__version__} on {torch.cuda.get_device_name(0)}, cuDNN {torch.backends.cudnn.version()}")

    def bench(fn, warmup=1, runs=7):
        for _ in range(warmup):
            fn()
        ts = []
        for _ in range(runs):
            t0 = time.perf_counter()
            fn()
            ts.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(ts)

    def emit(workload, variant, ms, rate, unit):
        print(json.dumps({"lib": "torch", "workload": workload, "variant": variant, "median_ms": round(ms, 4),
                          "rate": round(rate, 4), "unit": unit}))

    # W1: f32 matmul.
    n = 256 if quick else 2048
    a, b = torch.rand(n, n, device=dev), torch.rand(n, n, device=dev)

    def w1():
        c = a @ b
        sync()
    ms = bench(w1, warmup=2)
    emit("W1", f"matmul {n}x{n} f32", ms, 2 * n**3 / (ms * 1e-3) / 1e9, "GFLOP/s")

    # W2: many small products, each norm read to the host.
    iters = 100 if quick else 1000
    a2, b2 = torch.rand(100, 100, device=dev), torch.rand(100, 100, device=dev)

    def w2():
        s = 0.0
        for _ in range(iters):
            s += (a2 @ b2).norm().item()
    ms = bench(w2)
    emit("W2", f"{iters}x (matmul 100x100, norm to host)", ms, ms, "ms")

    # W3: elementwise, 32 bytes moved per element (as kiln counts it).
    n3 = 1_000_000 if quick else 100_000_000
    x = torch.rand(n3, device=dev)

    def w3():
        y = x * x - 0.5
        z = y ** 3 - 0.2
        sync()
    ms = bench(w3, runs=5)
    emit("W3", f"n={n3}: y=x^2-0.5, z=y^3-0.2", ms, 32 * n3 / (ms * 1e-3) / 1e9, "GB/s")

    # W4: a chain of 1-element adds.
    iters4 = 1000 if quick else 10_000
    one = torch.ones(1, device=dev)

    def w4():
        acc = torch.zeros(1, device=dev)
        for _ in range(iters4):
            acc = acc + one
        sync()
    ms = bench(w4)
    emit("W4", f"{iters4}x (a = a + b), 1 element", ms, ms * 1e3 / iters4, "us/op")

    # W5: linear regression from scratch with autograd (the book's 3.4).
    nn5, batch5, lr5 = 1000, 32, 0.03
    epochs5 = 2 if quick else 10
    true_w = torch.tensor([[2.0], [-3.4]], device=dev)
    feats = torch.randn(nn5, 2, device=dev)
    labels = feats @ true_w + 4.2 + 0.01 * torch.randn(nn5, 1, device=dev)

    def w5():
        w = (0.01 * torch.randn(2, 1, device=dev)).requires_grad_()
        bias = torch.zeros(1, device=dev, requires_grad=True)
        for _ in range(epochs5):
            perm = torch.randperm(nn5, device=dev)
            for s in range(0, nn5, batch5):
                ids = perm[s:s + batch5]
                loss = ((feats[ids] @ w + bias - labels[ids]) ** 2).mean()
                loss.backward()
                with torch.no_grad():
                    for p in (w, bias):
                        p -= lr5 * p.grad
                        p.grad = None
        sync()
    ms = bench(w5)
    emit("W5", f"linreg autograd, n={nn5} bs={batch5}, {epochs5} epochs", ms / epochs5, ms / epochs5, "ms/epoch")

    # The networks of `kiln train` on synthetic images.
    def lenet():
        return nn.Sequential(
            nn.Conv2d(1, 6, 5, padding=2), nn.Sigmoid(), nn.AvgPool2d(2, 2),
            nn.Conv2d(6, 16, 5), nn.Sigmoid(), nn.AvgPool2d(2, 2), nn.Flatten(),
            nn.Linear(400, 120), nn.Sigmoid(), nn.Linear(120, 84), nn.Sigmoid(), nn.Linear(84, 4))

    def resnet18():
        import torchvision
        m = torchvision.models.resnet18(num_classes=4)
        m.conv1 = nn.Conv2d(1, 64, 7, 2, 3, bias=False)
        return m

    ntrain, nval, batch = (1024, 256, 256) if quick else (4096, 1024, 256)
    xs = torch.rand(ntrain + nval, 1, 28, 28, device=dev)
    ys = torch.randint(0, 4, (ntrain + nval,), device=dev)
    for name, make in (("LeNet", lenet), ("ResNet-18", resnet18)):
        try:
            net = make().to(dev)
        except Exception as e:  # torchvision missing
            print(f"SKIPPED: {name}: {e}")
            continue
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        lossf = nn.CrossEntropyLoss()
        times = []
        for epoch in range(args.epochs):
            sync()
            t0 = time.perf_counter()
            net.train()
            total = torch.zeros((), device=dev)
            perm = torch.randperm(ntrain, device=dev)
            for s in range(0, ntrain, batch):
                ids = perm[s:s + batch]
                loss = lossf(net(xs[ids]), ys[ids])
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                total += loss.detach()
            net.eval()
            with torch.no_grad():
                vtotal = torch.zeros((), device=dev)
                for s in range(ntrain, ntrain + nval, batch):
                    vtotal += lossf(net(xs[s:s + batch]), ys[s:s + batch])
            total.item(), vtotal.item()
            times.append(time.perf_counter() - t0)
        later = times[1:] or times
        emit("Train", f"{name} epoch, {ntrain} images + {nval} validation, batch {batch}", statistics.median(later) * 1e3,
             statistics.median(later), "s/epoch")
    return 0


if __name__ == "__main__":
    sys.exit(main())
