//! Batch and layer normalisation.

use super::{close, fd_check, to, tol, Rng};
use crate::host_nn::reference;
use crate::host_nn::*;

fn bn_groups(p: &BatchNormParams) -> Vec<Vec<usize>> {
    (0..p.channels)
        .map(|c| (0..p.batch).flat_map(|n| (0..p.spatial).map(move |s| (n * p.channels + c) * p.spatial + s)).collect())
        .collect()
}

fn check_bn<T: NnFloat>(p: &BatchNormParams, r: &mut Rng, threads: usize) {
    let len = p.validate(true).unwrap();
    let (x, w, b, dy) = (r.vals(len), r.vals(p.channels), r.vals(p.channels), r.vals(len));
    let affine = r.below(3) != 0;
    let ones = vec![1.0; p.channels];
    let zeros = vec![0.0; p.channels];
    let (rw, rb) = if affine { (&w, &b) } else { (&ones, &zeros) };
    let (want_y, want_mean, want_inv, want_dx, want_dw, want_db) =
        reference::normalise(&x, &bn_groups(p), &|i| i / p.spatial % p.channels, rw, rb, p.eps, &dy);
    let (wt, bt) = (to::<T>(&w), to::<T>(&b));
    let (pw, pb) = if affine { (Some(&wt[..]), Some(&bt[..])) } else { (None, None) };
    let (mut y, mut mean, mut inv, mut var) =
        (vec![T::ZERO; len], vec![T::ZERO; p.channels], vec![T::ZERO; p.channels], vec![T::ZERO; p.channels]);
    batch_norm_train_forward(p, &to::<T>(&x), pw, pb, &mut y, &mut mean, &mut inv, Some(&mut var), threads).unwrap();
    let what = format!("{p:?} affine {affine}");
    // Normalised values are O(1) but near-constant channels have a large invstd.
    let t = tol::<T>() * 10.0;
    close(&y, &want_y, t, &format!("batch_norm forward of {what}"));
    close(&mean, &want_mean, tol::<T>(), &format!("batch_norm mean of {what}"));
    close(&inv, &want_inv, t, &format!("batch_norm invstd of {what}"));
    let (mut dx, mut dw, mut db) = (vec![T::ZERO; len], vec![T::ZERO; p.channels], vec![T::ZERO; p.channels]);
    batch_norm_backward(p, &to::<T>(&x), &to::<T>(&dy), pw, &mean, &inv, true, Some(&mut dx), Some(&mut dw), Some(&mut db), threads)
        .unwrap();
    close(&dx, &want_dx, t, &format!("batch_norm grad input of {what}"));
    close(&dw, &want_dw, t, &format!("batch_norm grad weight of {what}"));
    close(&db, &want_db, tol::<T>(), &format!("batch_norm grad bias of {what}"));
    // Running statistics: momentum and the unbiased variance.
    let (rm0, rv0) = (r.vals(p.channels), r.vals(p.channels).iter().map(|v| v.abs() + 0.5).collect::<Vec<_>>());
    let (mut rm, mut rv) = (to::<T>(&rm0), to::<T>(&rv0));
    batch_norm_update_running(p, &mean, &var, 0.1, &mut rm, &mut rv).unwrap();
    let n = p.count() as f64;
    let want_rv: Vec<f64> =
        (0..p.channels).map(|c| 0.9 * rv0[c] + 0.1 * (1.0 / (want_inv[c] * want_inv[c]) - p.eps) * n / (n - 1.0)).collect();
    let want_rm: Vec<f64> = (0..p.channels).map(|c| 0.9 * rm0[c] + 0.1 * want_mean[c]).collect();
    close(&rm, &want_rm, tol::<T>(), &format!("running mean of {what}"));
    close(&rv, &want_rv, t, &format!("running var of {what}"));
    // Evaluation mode with those running statistics.
    let mut ye = vec![T::ZERO; len];
    batch_norm_eval_forward(p, &to::<T>(&x), &rm, &rv, pw, pb, &mut ye, threads).unwrap();
    let want_ye: Vec<f64> = (0..len)
        .map(|i| {
            let c = i / p.spatial % p.channels;
            (x[i] - rm[c].to_f64()) / (rv[c].to_f64() + p.eps).sqrt() * rw[c] + rb[c]
        })
        .collect();
    close(&ye, &want_ye, t, &format!("batch_norm eval of {what}"));
    let mut inv_e = vec![T::ZERO; p.channels];
    batch_norm_invstd(&rv, p.eps, &mut inv_e).unwrap();
    batch_norm_backward(p, &to::<T>(&x), &to::<T>(&dy), pw, &rm, &inv_e, false, Some(&mut dx), Some(&mut dw), Some(&mut db), threads)
        .unwrap();
    let want_dxe: Vec<f64> =
        (0..len).map(|i| dy[i] * inv_e[i / p.spatial % p.channels].to_f64() * rw[i / p.spatial % p.channels]).collect();
    close(&dx, &want_dxe, t, &format!("batch_norm eval grad input of {what}"));
}

#[test]
fn batch_norm_matches_the_definition() {
    let mut r = Rng(8);
    for case in 0..200 {
        let p = BatchNormParams {
            batch: r.range(1, 4),
            channels: r.range(1, 5),
            spatial: r.pick(&[1, 2, 7, 30]),
            eps: r.pick(&[1e-5, 1e-3, 0.1]),
        };
        if p.validate(true).is_err() {
            continue;
        }
        check_bn::<f64>(&p, &mut r, 1 + case % 3);
        check_bn::<f32>(&p, &mut r, 1 + case % 3);
    }
    // Large enough for several threads.
    let p = BatchNormParams { batch: 4, channels: 6, spatial: 3000, eps: 1e-5 };
    check_bn::<f32>(&p, &mut r, 4);
    check_bn::<f64>(&p, &mut r, 4);
}

#[test]
fn batch_norm_gradients_match_finite_differences() {
    let mut r = Rng(9);
    for _ in 0..20 {
        let p = BatchNormParams { batch: r.range(1, 3), channels: r.range(1, 3), spatial: r.pick(&[2, 5]), eps: 1e-3 };
        let len = p.validate(true).unwrap();
        let (x, w, b, m) = (r.vals(len), r.vals(p.channels), r.vals(p.channels), r.vals(len));
        let loss = |x: &[f64], w: &[f64], b: &[f64]| -> f64 {
            let (mut y, mut mean, mut inv) = (vec![0.0; len], vec![0.0; p.channels], vec![0.0; p.channels]);
            batch_norm_train_forward(&p, x, Some(w), Some(b), &mut y, &mut mean, &mut inv, None, 1).unwrap();
            y.iter().zip(&m).map(|(a, b)| a * b).sum()
        };
        let (mut y, mut mean, mut inv) = (vec![0.0; len], vec![0.0; p.channels], vec![0.0; p.channels]);
        batch_norm_train_forward(&p, &x, Some(&w), Some(&b), &mut y, &mut mean, &mut inv, None, 1).unwrap();
        let (mut dx, mut dw, mut db) = (vec![0.0; len], vec![0.0; p.channels], vec![0.0; p.channels]);
        batch_norm_backward(&p, &x, &m, Some(&w), &mean, &inv, true, Some(&mut dx), Some(&mut dw), Some(&mut db), 1).unwrap();
        fd_check(&x, &dx, |x| loss(x, &w, &b), "batch_norm dx");
        fd_check(&w, &dw, |w| loss(&x, w, &b), "batch_norm dw");
        fd_check(&b, &db, |b| loss(&x, &w, b), "batch_norm db");
    }
}

#[test]
fn layer_norm_matches_the_definition_and_finite_differences() {
    let mut r = Rng(10);
    for case in 0..200 {
        let p = LayerNormParams { rows: r.range(0, 5), features: r.range(1, 40), eps: 1e-5 };
        let len = p.validate().unwrap();
        let (x, w, b, dy) = (r.vals(len), r.vals(p.features), r.vals(p.features), r.vals(len));
        let groups: Vec<Vec<usize>> = (0..p.rows).map(|i| (i * p.features..(i + 1) * p.features).collect()).collect();
        let (want_y, want_mean, want_rstd, want_dx, want_dw, want_db) =
            reference::normalise(&x, &groups, &|i| i % p.features, &w, &b, p.eps, &dy);
        let (mut y, mut mean, mut rstd) = (vec![0.0; len], vec![0.0; p.rows], vec![0.0; p.rows]);
        let threads = 1 + case % 3;
        layer_norm_forward(&p, &x, Some(&w), Some(&b), &mut y, &mut mean, &mut rstd, threads).unwrap();
        close(&y, &want_y, 1e-12, "layer_norm forward");
        close(&mean, &want_mean, 1e-12, "layer_norm mean");
        close(&rstd, &want_rstd, 1e-12, "layer_norm rstd");
        let (mut dx, mut dw, mut db) = (vec![0.0; len], vec![0.0; p.features], vec![0.0; p.features]);
        layer_norm_backward(&p, &x, &dy, Some(&w), Some(&mut dx), Some(&mut dw), Some(&mut db), threads).unwrap();
        close(&dx, &want_dx, 1e-11, "layer_norm dx");
        close(&dw, &want_dw, 1e-12, "layer_norm dw");
        close(&db, &want_db, 1e-12, "layer_norm db");
        // f32
        let (mut y32, mut m32, mut r32) = (vec![0f32; len], vec![0f32; p.rows], vec![0f32; p.rows]);
        layer_norm_forward(&p, &to::<f32>(&x), None, None, &mut y32, &mut m32, &mut r32, threads).unwrap();
        let (want_y, ..) =
            reference::normalise(&x, &groups, &|i| i % p.features, &vec![1.0; p.features], &vec![0.0; p.features], p.eps, &dy);
        close(&y32, &want_y, 1e-5, "layer_norm f32 forward");
        if case % 10 == 0 && p.rows > 0 {
            let loss = |x: &[f64], w: &[f64], b: &[f64]| -> f64 {
                let (mut y, mut mean, mut rstd) = (vec![0.0; len], vec![0.0; p.rows], vec![0.0; p.rows]);
                layer_norm_forward(&p, x, Some(w), Some(b), &mut y, &mut mean, &mut rstd, 1).unwrap();
                y.iter().zip(&dy).map(|(a, b)| a * b).sum()
            };
            fd_check(&x, &dx, |x| loss(x, &w, &b), "layer_norm dx");
            fd_check(&w, &dw, |w| loss(&x, w, &b), "layer_norm dw");
            fd_check(&b, &db, |b| loss(&x, &w, b), "layer_norm db");
        }
    }
}

#[test]
fn normalisation_edge_cases() {
    let p = BatchNormParams { batch: 1, channels: 3, spatial: 1, eps: 1e-5 };
    assert!(p.validate(true).unwrap_err().to_string().contains("more than one value per channel"));
    assert_eq!(p.validate(false).unwrap(), 3);
    assert!(BatchNormParams { eps: -1.0, ..p }.validate(false).is_err());
    // An empty batch: nothing to write, the running statistics stay.
    let p = BatchNormParams { batch: 0, channels: 2, spatial: 4, eps: 1e-5 };
    let (mut mean, mut inv, mut var) = ([0f32; 2], [0f32; 2], [0f32; 2]);
    batch_norm_train_forward(&p, &[], None, None, &mut [], &mut mean, &mut inv, Some(&mut var), 2).unwrap();
    assert!(mean[0].is_nan() && inv[0].is_nan());
    let (mut rm, mut rv) = ([1f32, 2.], [3f32, 4.]);
    batch_norm_update_running(&p, &mean, &var, 0.1, &mut rm, &mut rv).unwrap();
    assert_eq!((rm, rv), ([1., 2.], [3., 4.]));
    // Layer norm of no features: mean 0, rstd NaN (PyTorch's).
    let q = LayerNormParams { rows: 2, features: 0, eps: 1e-5 };
    let (mut m, mut r) = ([1f32; 2], [1f32; 2]);
    layer_norm_forward(&q, &[], None, None, &mut [], &mut m, &mut r, 1).unwrap();
    assert!(m == [0., 0.] && r[0].is_nan());
    assert!(LayerNormParams { rows: usize::MAX, features: 3, eps: 0.0 }.validate().is_err());
    // Wrong lengths are errors.
    let p = BatchNormParams { batch: 2, channels: 2, spatial: 2, eps: 1e-5 };
    assert!(batch_norm_train_forward(&p, &[0f32; 8], Some(&[1.0]), None, &mut [0.0; 8], &mut [0.0; 2], &mut [0.0; 2], None, 1).is_err());
}

#[test]
fn normalisation_results_do_not_depend_on_the_thread_count() {
    let mut r = Rng(12);
    let p = BatchNormParams { batch: 8, channels: 5, spatial: 1500, eps: 1e-5 };
    let len = p.validate(true).unwrap();
    let (x, dy) = (to::<f32>(&r.vals(len)), to::<f32>(&r.vals(len)));
    let run = |threads| {
        let (mut y, mut mean, mut inv) = (vec![0f32; len], vec![0f32; 5], vec![0f32; 5]);
        batch_norm_train_forward(&p, &x, None, None, &mut y, &mut mean, &mut inv, None, threads).unwrap();
        let (mut dx, mut dw) = (vec![0f32; len], vec![0f32; 5]);
        batch_norm_backward(&p, &x, &dy, None, &mean, &inv, true, Some(&mut dx), Some(&mut dw), None, threads).unwrap();
        let q = LayerNormParams { rows: 40, features: 1500, eps: 1e-5 };
        let (mut ly, mut lm, mut lr) = (vec![0f32; 60000], vec![0f32; 40], vec![0f32; 40]);
        layer_norm_forward(&q, &x[..60000], None, None, &mut ly, &mut lm, &mut lr, threads).unwrap();
        let (mut lw, mut lb) = (vec![0f32; 1500], vec![0f32; 1500]);
        let w = vec![1f32; 1500];
        layer_norm_backward(&q, &x[..60000], &dy[..60000], Some(&w), None, Some(&mut lw), Some(&mut lb), threads).unwrap();
        (y, mean, inv, dx, dw, ly, lw, lb)
    };
    let one = run(1);
    assert!(run(3) == one && run(8) == one);
}
