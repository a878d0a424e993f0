"""PyTorch's figures for the book's LeNet recipe on the digits, from kiln's
initial weights: the reference that tests/cnn_models.rs compares kiln with.

    cargo run --profile release-tests -p kiln --example lenet_digits -- --save-init /tmp/lenet_init.safetensors
    python scripts/lenet_digits_torch.py /tmp/lenet_init.safetensors 150 > kiln/tests/data/lenet_digits_torch.txt

Same data (scikit-learn's digits, /16, bilinear to 28x28, the first 1437 for
training and the last 360 for validation), same weights, same batches in the
same order (kiln's permutation_for_epoch under shuffle seed 0, ported below),
sigmoid LeNet, cross-entropy, SGD lr 0.9, batch 256, float32. Needs torch,
scikit-learn and safetensors.
"""
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import load_file
from sklearn.datasets import load_digits

M64 = (1 << 64) - 1


def mix(z):
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def permutation_from_seed(n, seed):
    v = list(range(n))
    state = seed
    for i in range(n - 1, 0, -1):
        state = (state + 0x9E3779B97F4A7C15) & M64
        j = (mix(state) * (i + 1)) >> 64
        v[i], v[j] = v[j], v[i]
    return v


def permutation_for_epoch(n, seed, epoch):
    if epoch == 0:
        return permutation_from_seed(n, seed)
    return permutation_from_seed(n, mix(seed ^ mix((epoch * 0x9E3779B97F4A7C15) & M64)))


def main():
    init, epochs = sys.argv[1], int(sys.argv[2])
    torch.set_num_threads(2)
    d = load_digits()
    x = torch.tensor(d.images, dtype=torch.float32).unsqueeze(1) / 16
    x = F.interpolate(x, size=(28, 28), mode="bilinear", align_corners=False)
    y = torch.tensor(d.target, dtype=torch.int64)
    ntr = 1797 - 360
    xt, yt, xv, yv = x[:ntr], y[:ntr], x[ntr:], y[ntr:]
    net = nn.Sequential(
        nn.Conv2d(1, 6, 5, padding=2), nn.Sigmoid(), nn.AvgPool2d(2, 2),
        nn.Conv2d(6, 16, 5), nn.Sigmoid(), nn.AvgPool2d(2, 2), nn.Flatten(),
        nn.Linear(400, 120), nn.Sigmoid(), nn.Linear(120, 84), nn.Sigmoid(), nn.Linear(84, 10))
    net.load_state_dict(load_file(init))
    opt = torch.optim.SGD(net.parameters(), lr=0.9)
    print(f"# torch {torch.__version__}: epoch, train loss (mean over examples), validation accuracy")
    for epoch in range(epochs):
        perm = torch.tensor(permutation_for_epoch(ntr, 0, epoch))
        total = 0.0
        for start in range(0, ntr, 256):
            idx = perm[start:start + 256]
            loss = F.cross_entropy(net(xt[idx]), yt[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += loss.item() * len(idx)
        with torch.no_grad():
            acc = (net(xv).argmax(1) == yv).double().mean().item()
        print(f"{epoch + 1} {total / ntr:.6f} {acc:.6f}")


if __name__ == "__main__":
    main()
