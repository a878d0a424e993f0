"""numpy's side of kiln/tests/io_numpy.rs: .npy/.npz files checked in both
directions against numpy itself.

  python io_numpy.py write DIR   numpy writes arrays of every dtype kiln has
                                 (numpy's bool too), both byte orders, C and
                                 Fortran order, 0-d and empty, header versions
                                 1.0/2.0/3.0, np.savez and np.savez_compressed;
                                 beside each array, its expected elements as
                                 raw little-endian C-order bytes (NAME.raw)
                                 and a line in DIR/manifest.txt.
  python io_numpy.py check DIR   numpy reads the files kiln wrote in DIR
                                 (listed in DIR/manifest.txt, with .raw files
                                 of the elements kiln wrote) and compares
                                 dtype, shape and every byte.

manifest.txt lines: `npy FILE DTYPE SHAPE` or `npz FILE MEMBER DTYPE SHAPE`,
DTYPE a kiln dtype name, SHAPE comma-separated (empty for 0-d). The raw file
of an npy is FILE.raw, of an npz member FILE.MEMBER.raw. Exit status 1 on any
difference.
"""
import io
import os
import sys

import numpy as np

try:  # bfloat16 as ML code writes it; without it, numpy's raw V2 stands in.
    import ml_dtypes
except ImportError:
    ml_dtypes = None

KILN = {"f32": "f4", "f64": "f8", "i64": "i8", "i32": "i4", "u8": "u1", "f16": "f2"}
rng = np.random.default_rng(7)


def values(kind, shape):
    """Values that exercise every bit of the dtype: extremes, NaN, inf, -0."""
    n = int(np.prod(shape)) if shape else 1
    if kind in ("f4", "f8", "f2"):
        a = rng.standard_normal(n) * 1e3
        special = [np.nan, np.inf, -np.inf, -0.0, 0.0, 1e-40, 65504.0]
        a[: min(n, len(special))] = special[: min(n, len(special))]
        return a.astype(kind).reshape(shape)
    if kind == "u1":
        return rng.integers(0, 256, n, dtype=np.uint8).reshape(shape)
    if kind == "b1":
        return (rng.integers(0, 2, n) == 1).reshape(shape)
    info = np.iinfo(kind)
    a = rng.integers(info.min, info.max, n, dtype=kind, endpoint=True)
    a[: min(n, 2)] = [info.min, info.max][: min(n, 2)]
    return a.reshape(shape)


def bf16(shape):
    """A bfloat16 array (ml_dtypes'), or its raw bits as numpy's V2."""
    n = int(np.prod(shape)) if shape else 1
    bits = (np.asarray(values("f4", (n,)), dtype="<f4").view("<u4") >> 16).astype("<u2")
    if ml_dtypes is not None:
        return bits.view(ml_dtypes.bfloat16).reshape(shape)
    return bits.view("V2").reshape(shape)


def raw(a, kiln_dtype):
    """The elements kiln must hold: little-endian, C order."""
    if kiln_dtype == "bf16":
        return np.ascontiguousarray(a).tobytes()  # two raw bytes each, as written
    if a.dtype == np.bool_:
        return np.ascontiguousarray(a).astype(np.uint8).tobytes()
    return np.ascontiguousarray(a.astype(a.dtype.newbyteorder("<"))).tobytes()


def cases():
    """(name, kiln dtype, array, save options) of every .npy case."""
    shapes = {"3d": (2, 3, 4), "0d": (), "empty": (0, 3), "1d": (5,), "empty0d": (3, 0, 2)}
    out = []
    for dt, code in list(KILN.items()) + [("u8", "b1")]:
        orders = "<>" if code not in ("u1", "b1") else "|"
        for order in orders:
            for sname, shape in shapes.items():
                a = values(code, shape)
                if code not in ("u1", "b1"):
                    a = a.astype(a.dtype.newbyteorder(order))
                name = f"{code}{'be' if order == '>' else ''}_{sname}"
                out.append((name, dt, a, {}))
                if len(shape) >= 2:
                    out.append((name + "_fortran", dt, np.asfortranarray(a), {}))
    for sname, shape in (("3d", (2, 3, 4)), ("0d", ()), ("empty", (0, 3))):
        out.append((f"bf16_{sname}", "bf16", bf16(shape), {}))
    out.append(("bf16_fortran", "bf16", np.asfortranarray(bf16((3, 5))), {}))
    for version in ((1, 0), (2, 0), (3, 0)):
        out.append((f"f4_v{version[0]}", "f32", values("f4", (4, 2)), {"version": version}))
    return out


def write(d):
    manifest = []
    all_cases = cases()
    for name, dt, a, opts in all_cases:
        path = os.path.join(d, name + ".npy")
        if opts:
            with open(path, "wb") as f:
                np.lib.format.write_array(f, a, **opts)
        else:
            np.save(path, a)
        with open(path + ".raw", "wb") as f:
            f.write(raw(a, dt))
        manifest.append(f"npy {name}.npy {dt} {','.join(map(str, a.shape))}")
    members = [c for c in all_cases if "3d" in c[0] or "0d" in c[0] or "empty" in c[0] or "fortran" in c[0]]
    for archive, save in (("stored.npz", np.savez), ("deflated.npz", np.savez_compressed)):
        path = os.path.join(d, archive)
        save(path, **{name: a for name, _, a, _ in members})
        for name, dt, a, _ in members:
            with open(f"{path}.{name}.raw", "wb") as f:
                f.write(raw(a, dt))
            manifest.append(f"npz {archive} {name} {dt} {','.join(map(str, a.shape))}")
    with open(os.path.join(d, "manifest.txt"), "w") as f:
        f.write("\n".join(manifest) + "\n")
    print(f"numpy {np.__version__} wrote {len(all_cases)} .npy files and 2 .npz archives of {len(members)} arrays"
          f" ({'ml_dtypes ' + ml_dtypes.__version__ if ml_dtypes else 'no ml_dtypes: bf16 as V2'})")


def check(d):
    bad = []
    checked = 0
    archives = {}
    for line in open(os.path.join(d, "manifest.txt")).read().splitlines():
        parts = line.split(" ")
        if parts[0] == "npy":
            _, fname, dt, shape = parts
            a = np.load(os.path.join(d, fname))
            rawfile = os.path.join(d, fname + ".raw")
            what = fname
        else:
            _, fname, member, dt, shape = parts
            if fname not in archives:
                archives[fname] = np.load(os.path.join(d, fname))
            z = archives[fname]
            a = z[member]
            rawfile = os.path.join(d, f"{fname}.{member}.raw")
            what = f"{fname}[{member}]"
        shape = tuple(int(s) for s in shape.split(",") if s)
        expect_dtype = np.dtype("V2") if dt == "bf16" else np.dtype(KILN[dt])
        if a.dtype != expect_dtype:
            bad.append(f"{what}: dtype {a.dtype}, expected {expect_dtype}")
        if a.shape != shape:
            bad.append(f"{what}: shape {a.shape}, expected {shape}")
        if dt == "bf16" and ml_dtypes is not None:
            a.view(ml_dtypes.bfloat16)  # what a user does to get the values back
        got = raw(a, dt)
        want = open(rawfile, "rb").read()
        if got != want:
            bad.append(f"{what}: the elements differ ({len(got)} bytes read, {len(want)} expected)")
        checked += 1
    for fname, z in archives.items():
        expect = [l.split(" ")[2] for l in open(os.path.join(d, "manifest.txt")).read().splitlines() if l.startswith(f"npz {fname} ")]
        if list(z.files) != expect:
            bad.append(f"{fname}: members {z.files}, expected {expect} in that order")
    for b in bad:
        print("MISMATCH", b)
    print(f"numpy {np.__version__} read {checked} arrays kiln wrote; {len(bad)} mismatches")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    {"write": write, "check": check}[sys.argv[1]](sys.argv[2])
