//! The macro that turns the binary family's list (`mod.rs`) into the op
//! enum, its host kernels, its CUDA module and its gradients. Every match it
//! writes is over the whole list.

/// Builds the binary family. Each member:
///
/// ```text
/// /// doc
/// Variant => "name", host |x, y| <expr: T (u8 for cmp)>, cuda "<C expr of x, y>",
///     grad |g, a, b| <Result<(Option<Tensor>, Option<Tensor>)>>;   (not for cmp)
/// ```
///
/// under `num` (every numeric dtype), `float` (f32, f64) or `cmp`
/// (comparisons: every numeric dtype in, u8 out, no gradient). The
/// gradients are of the broadcast output's shape; the front end sums them
/// back to each operand's shape.
macro_rules! binary_family {
    (
        num { $( $(#[$ndoc:meta])* $nv:ident => $nname:literal, host |$nx:ident, $ny:ident| $nhost:expr, cuda $ncuda:literal,
                 grad |$ng:ident, $na:ident, $nb:ident| $ngrad:expr; )* }
        float { $( $(#[$fdoc:meta])* $fv:ident => $fname:literal, host |$fx:ident, $fy:ident| $fhost:expr, cuda $fcuda:literal,
                 grad |$fg:ident, $fa:ident, $fb:ident| $fgrad:expr; )* }
        cmp { $( $(#[$cdoc:meta])* $cv:ident => $cname:literal, host |$cx:ident, $cy:ident| $chost:expr, cuda $ccuda:literal; )* }
    ) => {
        /// Elementwise functions of two operands: the members of the binary
        /// family (`ops/binary/mod.rs`).
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        #[non_exhaustive]
        pub enum BinaryOp {
            $( $(#[$ndoc])* $nv, )*
            $( $(#[$fdoc])* $fv, )*
            $( $(#[$cdoc])* $cv, )*
        }

        impl BinaryOp {
            /// The op's name, as errors report it.
            pub(crate) fn name(self) -> &'static str {
                match self {
                    $( BinaryOp::$nv => $nname, )*
                    $( BinaryOp::$fv => $fname, )*
                    $( BinaryOp::$cv => $cname, )*
                }
            }
            /// Comparisons give u8 0/1 and no gradient.
            pub(crate) fn is_comparison(self) -> bool {
                match self {
                    $( BinaryOp::$nv => false, )*
                    $( BinaryOp::$fv => false, )*
                    $( BinaryOp::$cv => true, )*
                }
            }
            /// Ops that are only defined for floats.
            pub(crate) fn float_only(self) -> bool {
                match self {
                    $( BinaryOp::$nv => false, )*
                    $( BinaryOp::$fv => true, )*
                    $( BinaryOp::$cv => false, )*
                }
            }
            /// Applies the element function of an arithmetic member to an
            /// integer dtype; false for float-only members and comparisons.
            #[inline(always)]
            fn arith_num<T: Num, A: Apply2<T, T>>(self, a: A) -> bool {
                match self {
                    $( BinaryOp::$nv => a.apply(|$nx: T, $ny: T| $nhost), )*
                    $( BinaryOp::$fv => return false, )*
                    $( BinaryOp::$cv => return false, )*
                }
                true
            }
            /// The same for a float dtype.
            #[inline(always)]
            fn arith_float<T: Float, A: Apply2<T, T>>(self, a: A) -> bool {
                match self {
                    $( BinaryOp::$nv => a.apply(|$nx: T, $ny: T| $nhost), )*
                    $( BinaryOp::$fv => a.apply(|$fx: T, $fy: T| $fhost), )*
                    $( BinaryOp::$cv => return false, )*
                }
                true
            }
            /// Applies a comparison (u8 out); false for arithmetic members.
            #[inline(always)]
            fn compare<T: Num, A: Apply2<T, u8>>(self, a: A) -> bool {
                match self {
                    $( BinaryOp::$nv => return false, )*
                    $( BinaryOp::$fv => return false, )*
                    $( BinaryOp::$cv => a.apply(|$cx: T, $cy: T| $chost), )*
                }
                true
            }
            /// The gradients of both operands, of the output's shape, from
            /// the output gradient `g` (comparisons record none).
            #[allow(unused_variables)]
            fn grad(self, g: &Tensor, a: &Tensor, b: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
                match self {
                    $( BinaryOp::$nv => { let ($ng, $na, $nb) = (g, a, b); $ngrad } )*
                    $( BinaryOp::$fv => { let ($fg, $fa, $fb) = (g, a, b); $fgrad } )*
                    $( BinaryOp::$cv => Ok((None, None)), )*
                }
            }
        }

        /// (name, kind, CUDA expression) of every member.
        const MEMBERS: &[(&str, Kind, &str)] = &[
            $( ($nname, Kind::Num, $ncuda), )*
            $( ($fname, Kind::Float, $fcuda), )*
            $( ($cname, Kind::Cmp, $ccuda), )*
        ];
    };
}

pub(crate) use binary_family;

/// Which dtypes a member computes, and what it gives.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    /// Every numeric dtype, giving the same dtype.
    Num,
    /// f32 and f64.
    Float,
    /// Every numeric dtype, giving u8.
    Cmp,
}
