//! The macro that turns the unary family's list (`mod.rs`) into the op
//! enum, its host kernels, its CUDA module and its gradients. Every match it
//! writes is over the whole list: a member without a kernel or a gradient
//! does not compile.

/// Builds the unary family from its members. Each member:
///
/// ```text
/// /// doc
/// Variant(param: type, ...) => "name", host |x| <expr of x: T>,
///     cuda "<C expr of x, a, b, n>" [| "<C expr for f64>"] [scalars (a, b, n)],
///     grad |g, x [, y]| <Result<Tensor>>;
/// ```
///
/// under `num` (every numeric dtype) or `float` (f32 and f64; integers are
/// promoted to f32 by the front end). `T` is the element type; naming `y`
/// in the gradient keeps the forward output for it (no second forward).
macro_rules! unary_family {
    (
        num { $(
            $(#[$ndoc:meta])* $nv:ident $(( $($np:ident : $npt:ty),* ))? => $nname:literal,
            host |$nhx:ident| $nhost:expr,
            cuda $ncuda:literal $(scalars ($na:expr, $nb:expr, $nn:expr))?,
            grad |$ng:ident, $ngx:ident $(, $ngy:ident)?| $ngrad:expr;
        )* }
        float { $(
            $(#[$fdoc:meta])* $fv:ident $(( $($fp:ident : $fpt:ty),* ))? => $fname:literal,
            host |$fhx:ident| $fhost:expr,
            cuda $fcuda:literal $(| $fcuda64:literal)? $(scalars ($fa:expr, $fb:expr, $fn_:expr))?,
            grad |$fg:ident, $fgx:ident $(, $fgy:ident)?| $fgrad:expr;
        )* }
    ) => {
        /// Elementwise functions of one operand (and maybe a scalar): the
        /// members of the unary family (`ops/unary/mod.rs`).
        #[derive(Clone, Copy, Debug, PartialEq)]
        #[non_exhaustive]
        pub enum UnaryOp {
            $( $(#[$ndoc])* $nv $(( $($npt),* ))?, )*
            $( $(#[$fdoc])* $fv $(( $($fpt),* ))?, )*
        }

        #[allow(unused_variables)]
        impl UnaryOp {
            /// The op's name, as errors report it.
            pub(crate) fn name(self) -> &'static str {
                match self {
                    $( UnaryOp::$nv { .. } => $nname, )*
                    $( UnaryOp::$fv { .. } => $fname, )*
                }
            }
            /// Ops that are only defined for floats.
            pub(crate) fn float_only(self) -> bool {
                match self {
                    $( UnaryOp::$nv { .. } => false, )*
                    $( UnaryOp::$fv { .. } => true, )*
                }
            }
            /// True when the gradient reuses the forward output.
            pub(crate) fn saves_output(self) -> bool {
                match self {
                    $( UnaryOp::$nv { .. } => $crate::ops::present!($($ngy)?), )*
                    $( UnaryOp::$fv { .. } => $crate::ops::present!($($fgy)?), )*
                }
            }
            /// The scalars the CUDA kernel gets as `a`, `b`, `n`.
            fn scalars(self) -> (f64, f64, i64) {
                match self {
                    $( UnaryOp::$nv $(( $($np),* ))? => $crate::ops::or_else!([$(($na as f64, $nb as f64, $nn as i64))?] (0.0, 0.0, 0)), )*
                    $( UnaryOp::$fv $(( $($fp),* ))? => $crate::ops::or_else!([$(($fa as f64, $fb as f64, $fn_ as i64))?] (0.0, 0.0, 0)), )*
                }
            }
            /// The element function on an integer dtype; false for float-only ops.
            #[inline(always)]
            fn host_num<T: Num, A: Apply<T>>(self, a: A) -> bool {
                match self {
                    $( UnaryOp::$nv $(( $($np),* ))? => a.apply(move |$nhx: T| $nhost), )*
                    $( UnaryOp::$fv { .. } => return false, )*
                }
                true
            }
            /// The element function on a float dtype.
            #[inline(always)]
            fn host_float<T: Float, A: Apply<T>>(self, a: A) -> bool {
                match self {
                    $( UnaryOp::$nv $(( $($np),* ))? => a.apply(move |$nhx: T| $nhost), )*
                    $( UnaryOp::$fv $(( $($fp),* ))? => a.apply(move |$fhx: T| $fhost), )*
                }
                true
            }
            /// d(op(x))/dx · g, from x and (for members that name it) the
            /// forward output y.
            fn grad(self, g: &Tensor, x: &Tensor, y: Option<&Tensor>) -> Result<Tensor> {
                match self {
                    $( UnaryOp::$nv $(( $($np),* ))? => {
                        let ($ng, $ngx) = (g, x);
                        $( let Some($ngy) = y else { return Err(missing_output(self)) }; )?
                        $ngrad
                    } )*
                    $( UnaryOp::$fv $(( $($fp),* ))? => {
                        let ($fg, $fgx) = (g, x);
                        $( let Some($fgy) = y else { return Err(missing_output(self)) }; )?
                        $fgrad
                    } )*
                }
            }
        }

        /// (name, float only, CUDA expression for f32 and integers, for f64) of every member.
        const MEMBERS: &[(&str, bool, &str, &str)] = &[
            $( ($nname, false, $ncuda, $ncuda), )*
            $( ($fname, true, $fcuda, $crate::ops::or_else!([$($fcuda64)?] $fcuda)), )*
        ];
    };
}

pub(crate) use unary_family;
