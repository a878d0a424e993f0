//! The macro that turns the reduction family's list (`mod.rs`) into the op
//! enum, its host kernels, its CUDA module and its gradients.

/// Builds the reduction family. Each member:
///
/// ```text
/// /// doc
/// Variant => "name", init IDENTITY, host |a, b| <combine in any Num>,
///     [map |x| <Num expr, applied to each source element first>,]
///     [finish |x| <Num expr, applied to each finished accumulator>,]
///     cuda init "<C expr of type A>" combine "<C expr of a, b>" [map "<C expr of x>"] [finish "<C expr of x>"],
///     grad |g, x, dims [, y]| <Result<Tensor>>;
/// ```
///
/// `IDENTITY` is a constant of `Num` (ZERO, ONE, LOWEST, HIGHEST). A `map`
/// (host and CUDA together) transforms each source element, in the
/// accumulator type, before it is combined (never a partial result); a
/// `finish` transforms each output's accumulator before its one rounding to
/// the dtype (a norm's square root of the f64 sum of squares). Floats
/// accumulate in f64 (so that a sum hardly depends on how the work was
/// split), integers in their own dtype (they wrap like every integer op).
/// Naming `y` keeps the forward output (with the reduced dimensions kept)
/// for the gradient. The `arg`
/// section names index-returning reductions, which `Tensor::reduce` hands to
/// their own op (`ops/argreduce.rs`).
macro_rules! reduce_family {
    (
        fold { $(
            $(#[$doc:meta])* $v:ident => $name:literal, init $init:ident, host |$ha:ident, $hb:ident| $host:expr,
            $(map |$mx:ident| $map:expr,)?
            $(finish |$fx:ident| $finish:expr,)?
            cuda init $cinit:literal combine $ccomb:literal $(map $cmap:literal)? $(finish $cfinish:literal)?,
            grad |$g:ident, $x:ident, $dims:ident $(, $y:ident)?| $grad:expr;
        )* }
        arg { $( $(#[$adoc:meta])* $av:ident => $aname:literal; )* }
    ) => {
        /// Reductions over some dimensions: the members of the reduction
        /// family (`ops/reduce/mod.rs`) and the arg-reductions.
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        #[non_exhaustive]
        pub enum Reduction {
            $( $(#[$doc])* $v, )*
            $( $(#[$adoc])* $av, )*
        }

        impl Reduction {
            /// The op's name, as errors report it.
            pub(crate) fn name(self) -> &'static str {
                match self {
                    $( Reduction::$v => $name, )*
                    $( Reduction::$av => $aname, )*
                }
            }
            /// True for the index-returning reductions (argmax, argmin).
            pub(crate) fn is_arg(self) -> bool {
                match self {
                    $( Reduction::$v => false, )*
                    $( Reduction::$av => true, )*
                }
            }
            /// Folds src over `dims` into `out`, accumulating in `T::Acc`.
            #[inline(always)]
            fn fold<T: Accumulate>(self, s: &[T], l: &Layout, dims: &[usize], out: &mut [T], threads: usize) -> bool {
                match self {
                    $( Reduction::$v => reduce(s, l, dims, out, threads, Fold {
                        init: <T::Acc as Num>::$init,
                        combine: |$ha: T::Acc, $hb: T::Acc| $host,
                        map: $crate::ops::reduce::family::pick!($(|$mx: T::Acc| $map)? ; |x: T::Acc| x),
                        finish: $crate::ops::reduce::family::pick!($(|$fx: T::Acc| $finish)? ; |x: T::Acc| x),
                    }), )*
                    $( Reduction::$av => return false, )*
                }
                true
            }
            /// True when the gradient reuses the forward output.
            pub(crate) fn saves_output(self) -> bool {
                match self {
                    $( Reduction::$v => $crate::ops::present!($($y)?), )*
                    $( Reduction::$av => false, )*
                }
            }
            /// The gradient of src from the output gradient `g` (of the kept
            /// shape), src `x` and, for members that name it, the output `y`.
            #[allow(unused_variables)]
            fn grad(self, g: &Tensor, x: &Tensor, y: Option<&Tensor>, dims: &[usize]) -> Result<Tensor> {
                match self {
                    $( Reduction::$v => {
                        let ($g, $x, $dims) = (g, x, dims);
                        $( let Some($y) = y else { return Err(Error::invalid($name, "the output was not kept (a kiln bug)")) }; )?
                        $grad
                    } )*
                    $( Reduction::$av => Err(Error::invalid($aname, "has no gradient (its output is indices)")), )*
                }
            }
        }

        /// (name, CUDA identity, CUDA combination, CUDA map of an element
        /// `x`, CUDA finish of an accumulator `x`) of every folding member.
        const MEMBERS: &[(&str, &str, &str, &str, &str)] = &[ $( (
            $name,
            $cinit,
            $ccomb,
            $crate::ops::reduce::family::pick!($($cmap)? ; "x"),
            $crate::ops::reduce::family::pick!($($cfinish)? ; "x"),
        ), )* ];
    };
}

/// The first of an optional item and a default: `pick!(a ; b)` is `a`,
/// `pick!( ; b)` is `b`.
macro_rules! pick {
    ( ; $default:expr) => {
        $default
    };
    ($given:expr ; $default:expr) => {
        $given
    };
}

pub(crate) use pick;
pub(crate) use reduce_family;
