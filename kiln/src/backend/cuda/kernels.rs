//! The CUDA C sources of kiln's kernels (`kernels.cu`, embedded), split into
//! families that are compiled separately on first use, and the codes the
//! host passes to them.

use crate::op::{BinaryOp, ReduceOp, UnaryOp};

/// The whole kernel file. Everything before the first `//@family` line is a
/// prelude shared by every family.
const SOURCE: &str = include_str!("kernels.cu");

/// Most dimensions a layout may have after merging; matches `KILN_MAXD`.
pub(crate) const MAX_DIMS: usize = 8;

/// `(family, full source)` for every family, in file order.
pub(crate) fn families() -> Vec<(&'static str, String)> {
    let mut parts = SOURCE.split("//@family ");
    let prelude = parts.next().unwrap_or_default();
    parts
        .map(|part| {
            let name = part.lines().next().unwrap_or_default().trim();
            // `name` borrows from a 'static str.
            (name, format!("{prelude}//@family {part}"))
        })
        .collect()
}

/// The family that holds kernel `name`.
pub(crate) fn family_of(name: &str) -> &'static str {
    const TABLE: [(&str, &str); 14] = [
        ("fill_", "create"),
        ("arange_", "create"),
        ("random_", "create"),
        ("unary_", "elementwise"),
        ("binary_", "elementwise"),
        ("compare_", "elementwise"),
        ("reduce_", "elementwise"),
        ("arg_reduce_", "elementwise"),
        ("arg_partial_", "elementwise"),
        ("arg_final_", "elementwise"),
        ("index_add_", "elementwise"),
        ("index_select_", "index"),
        ("matmul_", "matmul"),
        ("copy_", "copy"),
    ];
    TABLE.iter().find(|(prefix, _)| name.starts_with(prefix)).map(|(_, f)| *f).unwrap_or("where")
}

/// The suffix kernels use for a dtype.
pub(crate) fn dtype_tag(dtype: crate::DType) -> &'static str {
    use crate::DType::*;
    match dtype {
        F32 => "f32",
        F64 => "f64",
        I64 => "i64",
        I32 => "i32",
        U8 => "u8",
        F16 => "f16",
        BF16 => "bf16",
    }
}

/// (op code, scalar a, scalar b, integer power) of a unary op, as `unary_op`
/// in kernels.cu reads them.
pub(crate) fn unary_code(op: UnaryOp) -> (i32, f64, f64, i32) {
    match op {
        UnaryOp::Neg => (0, 0., 0., 0),
        UnaryOp::Abs => (1, 0., 0., 0),
        UnaryOp::Sqr => (2, 0., 0., 0),
        UnaryOp::Relu => (3, 0., 0., 0),
        UnaryOp::Powi(n) => (4, 0., 0., n),
        UnaryOp::AddScalar(v) => (5, v, 0., 0),
        UnaryOp::SubScalar(v) => (6, v, 0., 0),
        UnaryOp::RSubScalar(v) => (7, v, 0., 0),
        UnaryOp::MulScalar(v) => (8, v, 0., 0),
        UnaryOp::DivScalar(v) => (9, v, 0., 0),
        UnaryOp::MaxScalar(v) => (10, v, 0., 0),
        UnaryOp::MinScalar(v) => (11, v, 0., 0),
        UnaryOp::Affine(a, b) => (12, a, b, 0),
        UnaryOp::Exp => (20, 0., 0., 0),
        UnaryOp::Log => (21, 0., 0., 0),
        UnaryOp::Sqrt => (22, 0., 0., 0),
        UnaryOp::Recip => (23, 0., 0., 0),
        UnaryOp::Sin => (24, 0., 0., 0),
        UnaryOp::Cos => (25, 0., 0., 0),
        UnaryOp::Tanh => (26, 0., 0., 0),
        UnaryOp::Sigmoid => (27, 0., 0., 0),
        UnaryOp::Powf(p) => (28, p, 0., 0),
        UnaryOp::RDivScalar(v) => (29, v, 0., 0),
    }
}

/// Code of an arithmetic op for `binary_*`, or of a comparison for `compare_*`.
pub(crate) fn binary_code(op: BinaryOp) -> i32 {
    match op {
        BinaryOp::Add | BinaryOp::Eq => 0,
        BinaryOp::Sub | BinaryOp::Ne => 1,
        BinaryOp::Mul | BinaryOp::Lt => 2,
        BinaryOp::Div | BinaryOp::Le => 3,
        BinaryOp::Pow | BinaryOp::Gt => 4,
        BinaryOp::Maximum | BinaryOp::Ge => 5,
        BinaryOp::Minimum => 6,
    }
}

/// Code of Sum/Max/Min for `reduce_*`.
pub(crate) fn reduce_code(op: ReduceOp) -> i32 {
    match op {
        ReduceOp::Sum => 0,
        ReduceOp::Max | ReduceOp::ArgMax => 1,
        ReduceOp::Min | ReduceOp::ArgMin => 2,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn families_cover_every_kernel_prefix() {
        let fams = families();
        let names: Vec<_> = fams.iter().map(|(n, _)| *n).collect();
        assert_eq!(names, ["create", "elementwise", "matmul", "index", "copy", "where"]);
        for (name, src) in &fams {
            assert!(src.contains("struct Lay"), "family {name} lacks the prelude");
        }
        for (kernel, fam) in [("copy_f32_f16", "copy"), ("where_u8_f32", "where"), ("arg_reduce_f32", "elementwise")] {
            assert_eq!(family_of(kernel), fam);
            let src = &fams.iter().find(|(n, _)| *n == fam).unwrap().1;
            let prefix = kernel.split('_').next().unwrap();
            assert!(src.contains(&format!("{prefix}_")), "{kernel} not in family {fam}");
        }
    }
}
