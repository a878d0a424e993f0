//! interpolate: nearest and bilinear.

use super::{close, fd_check, to, tol, Rng};
use crate::host_nn::reference;
use crate::host_nn::*;

fn random_interp(r: &mut Rng) -> InterpParams {
    let input = [r.range(1, 8), r.range(1, 8)];
    let mode = match r.below(3) {
        0 => InterpMode::Nearest,
        1 => InterpMode::Bilinear { align_corners: false },
        _ => InterpMode::Bilinear { align_corners: true },
    };
    let (output, scales) = if r.below(3) == 0 {
        // A scale factor, the output size floor(in · scale) as PyTorch makes it.
        let s = [r.pick(&[0.5, 1.5, 2.0, 2.7, 3.0, 0.75]), r.pick(&[0.5, 1.5, 2.0, 1.3, 3.0])];
        let o = [((input[0] as f64 * s[0]).floor() as usize).max(1), ((input[1] as f64 * s[1]).floor() as usize).max(1)];
        (o, [Some(s[0]), Some(s[1])])
    } else {
        ([r.range(1, 12), r.range(1, 12)], [None, None])
    };
    InterpParams { batch: r.pick(&[0, 1, 2]), channels: r.range(1, 3), input, output, mode, scales }
}

#[test]
fn interpolate_matches_the_definition() {
    let mut r = Rng(13);
    for case in 0..500 {
        let p = random_interp(&mut r);
        let out = p.validate().unwrap();
        let (x, dy) = (r.vals(p.batch * p.channels * p.input[0] * p.input[1]), r.vals(out.iter().product()));
        let threads = 1 + case % 3;
        for f32_run in [false, true] {
            let (want, want_gx) = reference::interpolate(&p, &x, &dy, f32_run);
            if f32_run {
                let mut y = vec![f32::NAN; want.len()];
                interpolate_forward(&p, &to::<f32>(&x), &mut y, threads).unwrap();
                close(&y, &want, tol::<f32>(), &format!("interpolate f32 of {p:?}"));
                let mut gx = vec![f32::NAN; x.len()];
                interpolate_backward(&p, &to::<f32>(&dy), &mut gx, threads).unwrap();
                close(&gx, &want_gx, tol::<f32>(), &format!("interpolate f32 backward of {p:?}"));
            } else {
                let mut y = vec![f64::NAN; want.len()];
                interpolate_forward(&p, &x, &mut y, threads).unwrap();
                close(&y, &want, 1e-12, &format!("interpolate of {p:?}"));
                let mut gx = vec![f64::NAN; x.len()];
                interpolate_backward(&p, &dy, &mut gx, threads).unwrap();
                close(&gx, &want_gx, 1e-12, &format!("interpolate backward of {p:?}"));
            }
        }
        if case % 10 == 0 {
            let mut gx = vec![0.0; x.len()];
            interpolate_backward(&p, &dy, &mut gx, 1).unwrap();
            fd_check(
                &x,
                &gx,
                |x| {
                    let mut y = vec![0.0; dy.len()];
                    interpolate_forward(&p, x, &mut y, 1).unwrap();
                    y.iter().zip(&dy).map(|(a, b)| a * b).sum()
                },
                &format!("{p:?}"),
            );
        }
    }
}

#[test]
fn interpolate_follows_pytorchs_nearest_rule() {
    // PyTorch: 3 -> 7 takes floor(o · 3/7) in f32: 0 0 0 1 1 2 2.
    let p = InterpParams { batch: 1, channels: 1, input: [1, 3], output: [1, 7], mode: InterpMode::Nearest, scales: [None, None] };
    let mut y = [0f32; 7];
    interpolate_forward(&p, &[10., 20., 30.], &mut y, 1).unwrap();
    assert_eq!(y, [10., 10., 10., 20., 20., 30., 30.]);
    assert!(InterpParams { output: [0, 7], ..p }.validate().is_err());
    assert!(InterpParams { input: [0, 7], ..p }.validate().is_err());
}
