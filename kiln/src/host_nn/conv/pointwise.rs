//! 1×1 convolutions with stride 1 and no padding: per image and group, one
//! product of the weight with the input planes as they lie in memory.

use super::geom::Geom;
use crate::host_nn::matmul::{gemm, MatRef};
use crate::host_nn::work::{for_each_unit, SharedMut};
use crate::host_nn::{NnFloat, NnResult};

pub(crate) fn forward<T: NnFloat>(g: &Geom, input: &[T], weight: &[T], bias: Option<&[T]>, out: &mut [T], threads: usize) -> NnResult<()> {
    let hw = g.in_plane();
    let units = g.n * g.groups;
    let inner = if units < threads { threads } else { 1 };
    let dst = SharedMut::new(out);
    for_each_unit(
        threads,
        units,
        || Ok(()),
        |_, u| {
            let (n, grp) = (u / g.groups, u % g.groups);
            // SAFETY: unit (n, grp) alone writes its group's channels of image n.
            let o = unsafe { dst.slice((n * g.c_out() + grp * g.ocg) * hw, g.ocg * hw) };
            if let Some(b) = bias {
                for (i, row) in o.chunks_mut(hw).enumerate() {
                    row.fill(b[grp * g.ocg + i]);
                }
            }
            gemm(
                (g.ocg, hw, g.icg),
                o,
                (hw, 1),
                MatRef { data: &weight[grp * g.ocg * g.icg..][..g.ocg * g.icg], rs: g.icg, cs: 1 },
                MatRef { data: &input[(n * g.c_in() + grp * g.icg) * hw..][..g.icg * hw], rs: hw, cs: 1 },
                bias.is_some(),
                inner,
            );
            Ok(())
        },
    )
}

pub(crate) fn backward_input<T: NnFloat>(g: &Geom, weight: &[T], dout: &[T], gin: &mut [T], threads: usize) -> NnResult<()> {
    let hw = g.in_plane();
    let units = g.n * g.groups;
    let inner = if units < threads { threads } else { 1 };
    let dst = SharedMut::new(gin);
    for_each_unit(
        threads,
        units,
        || Ok(()),
        |_, u| {
            let (n, grp) = (u / g.groups, u % g.groups);
            // SAFETY: unit (n, grp) alone writes its group's channels of image n.
            let gi = unsafe { dst.slice((n * g.c_in() + grp * g.icg) * hw, g.icg * hw) };
            gemm(
                (g.icg, hw, g.ocg),
                gi,
                (hw, 1),
                MatRef { data: &weight[grp * g.ocg * g.icg..][..g.ocg * g.icg], rs: 1, cs: g.icg },
                MatRef { data: &dout[(n * g.c_out() + grp * g.ocg) * hw..][..g.ocg * hw], rs: hw, cs: 1 },
                false,
                inner,
            );
            Ok(())
        },
    )
}

/// Adds to `acc` (`[ocg, c1 − c0]`) the weight gradient of group `grp`'s
/// input channels `c0..c1` over images `n0..n1`.
pub(crate) fn accumulate_weight<T: NnFloat>(
    g: &Geom,
    input: &[T],
    dout: &[T],
    (n0, n1): (usize, usize),
    grp: usize,
    (c0, c1): (usize, usize),
    acc: &mut [T],
) -> NnResult<()> {
    let hw = g.in_plane();
    let cb = c1 - c0;
    for n in n0..n1 {
        gemm(
            (g.ocg, cb, hw),
            acc,
            (cb, 1),
            MatRef { data: &dout[(n * g.c_out() + grp * g.ocg) * hw..][..g.ocg * hw], rs: hw, cs: 1 },
            MatRef { data: &input[(n * g.c_in() + grp * g.icg + c0) * hw..][..cb * hw], rs: 1, cs: hw },
            true,
            1,
        );
    }
    Ok(())
}
