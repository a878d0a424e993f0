//! Convolutions through cuDNN, checked on the CUDA simulator's stand-in
//! (cudasim/src/dnn.rs): which path ran (its counters), the CPU's values,
//! what `kiln devices` says, and the ways cuDNN can be missing, decline or
//! fail.

use super::*;
use kiln::Conv2dArgs;

/// The cuDNN settings every child here starts from (the caller's own are
/// replaced), then the test's.
const DEFAULTS: &[(&str, &str)] =
    &[("KILN_CUDA_CONV", "auto"), ("KILN_DISABLE_CUDNN", "0"), ("KILN_CUDNN_BENCHMARK", "0"), ("KILN_CUDNN_LIB", "")];

/// [`in_simulator_child`] with [`DEFAULTS`] under `env`.
fn child(env: &[(&str, &str)], f: impl Fn(Device) -> Result<()>) -> Ran {
    let all: Vec<(&str, &str)> = DEFAULTS.iter().chain(env).copied().collect();
    in_simulator_child(&all, f)
}

fn detail(d: Device, key: &str) -> String {
    let info = kiln::devices().into_iter().find(|i| i.device == d).expect("listed");
    info.details.into_iter().find(|(k, _)| k == key).map(|(_, v)| v).unwrap_or_default()
}

/// Sets an environment variable in a child process that runs one test.
fn set_env(key: &str, value: Option<&str>) {
    // SAFETY: the child process runs this one test on this thread; nothing
    // else in it reads or writes the environment meanwhile (kiln reads these
    // settings at each convolution, on this thread).
    unsafe {
        match value {
            Some(v) => std::env::set_var(key, v),
            None => std::env::remove_var(key),
        }
    }
}

/// A forward and backward pass of `x ⋆ w (+ b)` on `d` against the CPU's:
/// output, and gradients of x, w and b, within `tol`.
fn conv_round_trip(d: Device, x: &Tensor, w: &Tensor, b: Option<&Tensor>, args: Conv2dArgs, transpose: bool, tol: f64) -> Result<()> {
    let run = |dev: &Device| -> Result<Vec<Tensor>> {
        let x = x.to(dev)?.detach().requires_grad_();
        let w = w.to(dev)?.detach().requires_grad_();
        let b = b.map(|b| b.to(dev).map(|b| b.detach().requires_grad_())).transpose()?;
        let y = if transpose { x.conv_transpose2d(&w, b.as_ref(), args)? } else { x.conv2d(&w, b.as_ref(), args)? };
        let weights = Tensor::arange(0.0, y.elem_count() as f64, 1.0, dev)?.reshape(y.dims())?.to_dtype(y.dtype())?.sin()?;
        y.mul(&weights)?.sum_all()?.backward()?;
        let mut out = vec![y.detach(), x.grad().expect("x grad"), w.grad().expect("w grad")];
        if let Some(b) = b {
            out.push(b.grad().expect("b grad"));
        }
        Ok(out)
    };
    let (got, want) = (run(&d)?, run(&kiln::cpu())?);
    for (what, (g, h)) in ["output", "input gradient", "weight gradient", "bias gradient"].iter().zip(got.iter().zip(&want)) {
        close(g, h, tol, what)?;
    }
    Ok(())
}

type Dims4 = (usize, usize, usize, usize);

fn input(shape: Dims4, dtype: DType) -> Result<Tensor> {
    let n = shape.0 * shape.1 * shape.2 * shape.3;
    Tensor::arange(0.0, n as f64, 1.0, &cpu())?.mul_scalar(0.37)?.sin()?.reshape(shape)?.to_dtype(dtype)
}

/// With cuDNN there, every convolution direction runs in it (no gemm, no
/// direct kernel): strides, padding, dilation, groups, bias and the
/// transposed convolution, f32 and f64, with the CPU's values; `kiln
/// devices` names cuDNN's version and the path; the workspace is back in the
/// cache afterwards.
pub(crate) fn cuda_convolutions_run_in_cudnn_when_it_loads() -> Ran {
    child(&[], |d| {
        assert_eq!(detail(d, "cudnn"), "9.1.0 (libcudnn.so.9)");
        assert!(detail(d, "convolution").starts_with("cuDNN, algorithms by its heuristics"), "{}", detail(d, "convolution"));
        kiln::synchronize(&d)?;
        let base = kiln::memory_stats(&d)?.in_use;
        for dtype in [DType::F32, DType::F64] {
            let tol = if dtype == DType::F64 { 1e-12 } else { 1e-4 };
            let cases: Vec<(Dims4, Dims4, Conv2dArgs, bool, bool)> = vec![
                ((2, 3, 9, 8), (4, 3, 3, 3), Conv2dArgs::default().padding(1), true, false),
                (
                    (2, 4, 11, 10),
                    (6, 2, 3, 2),
                    Conv2dArgs::default().stride((2, 1)).padding((1, 0)).dilation((2, 1)).groups(2),
                    true,
                    false,
                ),
                ((1, 6, 5, 5), (6, 1, 3, 3), Conv2dArgs::default().padding(1).groups(6), false, false),
                ((3, 2, 4, 4), (2, 3, 3, 3), Conv2dArgs::default().stride(2).padding(1).output_padding(1), true, true),
            ];
            for (xs, ws, args, bias, transpose) in cases {
                let (x, w) = (input(xs, dtype)?, input(ws, dtype)?.mul_scalar(0.5)?);
                let b = if bias {
                    Some(Tensor::arange(0.0, if transpose { ws.1 } else { ws.0 } as f64, 1.0, &cpu())?.to_dtype(dtype)?)
                } else {
                    None
                };
                let (convs, gemms) = (stat("cudnn_convs"), stat("gemms"));
                // Launches of the direct convolution kernels of this dtype.
                let direct_launches = || {
                    let tag = if dtype == DType::F64 { "f64" } else { "f32" };
                    ["conv2d_fwd", "conv2d_bwd_input", "conv2d_bwd_weight"]
                        .iter()
                        .map(|k| stat(&format!("launches:{k}_{tag}")))
                        .sum::<i64>()
                };
                let direct = direct_launches();
                conv_round_trip(d, &x, &w, b.as_ref(), args, transpose, tol)?;
                assert_eq!(
                    (stat("cudnn_convs") - convs, stat("gemms") - gemms, direct_launches() - direct),
                    (3, 0, 0),
                    "{dtype} {xs:?} ⋆ {ws:?} ({args:?}, transposed: {transpose}): three cuDNN calls (forward, data, filter), no gemm, no direct kernel"
                );
            }
        }
        kiln::synchronize(&d)?;
        assert_eq!(kiln::memory_stats(&d)?.in_use, base, "the workspaces are not held after the convolutions");
        Ok(())
    })
}

/// Four threads convolving on one device at once share its cuDNN handle
/// (one call at a time): every result is the CPU's.
pub(crate) fn cuda_cudnn_convolutions_from_many_threads_match_the_cpu() -> Ran {
    child(&[], |d| {
        let convs = stat("cudnn_convs");
        let results = std::thread::scope(|s| {
            let handles: Vec<_> = (0..4usize)
                .map(|t| {
                    s.spawn(move || -> Result<()> {
                        for round in 0..3usize {
                            let (x, w) = (input((2, 3, 6 + t, 7), DType::F32)?, input((4, 3, 3, 1 + round), DType::F32)?);
                            let args = Conv2dArgs::default().padding((1, 0));
                            let got = x.to(&d)?.conv2d(&w.to(&d)?, None, args)?;
                            close(&got, &x.conv2d(&w, None, args)?, 1e-4, &format!("thread {t}, round {round}"))?;
                        }
                        Ok(())
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().expect("a convolution thread panicked")).collect::<Vec<_>>()
        });
        for r in results {
            r?;
        }
        assert_eq!(stat("cudnn_convs") - convs, 12, "each of the 12 convolutions ran in cuDNN");
        Ok(())
    })
}

/// `padding="same"` with an even kernel pads one side more than the other,
/// which cuDNN's descriptors cannot say: kiln declines it to im2col +
/// cuBLAS (the CPU's values), and under KILN_CUDA_CONV=cudnn reports why.
pub(crate) fn cuda_convolutions_cudnn_cannot_express_go_through_cublas() -> Ran {
    child(&[], |d| {
        let (x, w) = (input((2, 3, 8, 8), DType::F32)?, input((4, 3, 4, 4), DType::F32)?);
        let args = Conv2dArgs::default().same();
        let want = x.conv2d(&w, None, args)?;
        let (convs, gemms) = (stat("cudnn_convs"), stat("gemms"));
        let got = x.to(&d)?.conv2d(&w.to(&d)?, None, args)?;
        close(&got, &want, 1e-4, "same padding, 4×4 kernel")?;
        assert_eq!((stat("cudnn_convs") - convs, stat("gemms") - gemms), (0, 1), "declined by cuDNN, run by cuBLAS");
        set_env("KILN_CUDA_CONV", Some("cudnn"));
        match x.to(&d)?.conv2d(&w.to(&d)?, None, args).and_then(|y| y.to_vec::<f32>()) {
            Err(Error::Backend { device, msg }) => {
                assert_eq!(device, d);
                assert!(msg.contains("KILN_CUDA_CONV=cudnn") && msg.contains("pads both sides alike"), "{msg}");
            }
            other => panic!("KILN_CUDA_CONV=cudnn with asymmetric padding: {other:?}"),
        }
        // Symmetric padding under the same setting runs in cuDNN.
        let sym = Conv2dArgs::default().padding(1);
        let got = x.to(&d)?.conv2d(&w.to(&d)?, None, sym)?;
        close(&got, &x.conv2d(&w, None, sym)?, 1e-4, "padding 1 under KILN_CUDA_CONV=cudnn")?;
        assert_eq!(stat("cudnn_convs") - convs, 1, "one cuDNN forward");
        set_env("KILN_CUDA_CONV", None);
        Ok(())
    })
}

/// A cuDNN call that fails is an error naming it, cuDNN's status and the
/// way out (KILN_DISABLE_CUDNN=1); the next convolution runs again.
pub(crate) fn cuda_a_failing_cudnn_call_is_an_error_naming_it() -> Ran {
    child(&[("KILN_CUDASIM_FAIL", "cudnnConvolutionForward:1")], |d| {
        let (x, w) = (input((1, 2, 5, 5), DType::F32)?, input((3, 2, 3, 3), DType::F32)?);
        let (xd, wd) = (x.to(&d)?, w.to(&d)?);
        match xd.conv2d(&wd, None, Conv2dArgs::default()) {
            Err(Error::Backend { device, msg }) => {
                assert_eq!(device, d);
                assert!(
                    msg.contains("cudnnConvolutionForward")
                        && msg.contains("CUDNN_STATUS_EXECUTION_FAILED")
                        && msg.contains("KILN_DISABLE_CUDNN=1"),
                    "{msg}"
                );
            }
            other => panic!("expected the failed cuDNN call as an error, got {other:?}"),
        }
        let convs = stat("cudnn_convs");
        let got = xd.conv2d(&wd, None, Conv2dArgs::default())?;
        close(&got, &x.conv2d(&w, None, Conv2dArgs::default())?, 1e-4, "after the failure")?;
        assert_eq!(stat("cudnn_convs") - convs, 1, "the next convolution ran in cuDNN");
        Ok(())
    })
}

/// An algorithm that refuses its operands (CUDNN_STATUS_NOT_SUPPORTED from
/// the run) is passed over for the next; when every one refuses, cuDNN
/// declines the call and im2col + cuBLAS runs it, or, under
/// KILN_CUDA_CONV=cudnn, the error names the refusal.
pub(crate) fn cuda_an_algorithm_cudnn_refuses_is_passed_over() -> Ran {
    child(&[("KILN_CUDASIM_FAIL", "cudnnConvolutionForward.unsupported:3")], |d| {
        let (x, w) = (input((2, 2, 6, 6), DType::F32)?, input((3, 2, 3, 3), DType::F32)?);
        let want = x.conv2d(&w, None, Conv2dArgs::default())?;
        let (xd, wd) = (x.to(&d)?, w.to(&d)?);
        let (convs, gemms) = (stat("cudnn_convs"), stat("gemms"));
        // The first two runs refuse: both algorithms, so cuBLAS runs it.
        close(&xd.conv2d(&wd, None, Conv2dArgs::default())?, &want, 1e-4, "declined to cuBLAS")?;
        assert_eq!((stat("cudnn_convs") - convs, stat("gemms") - gemms), (0, 1), "declined: one gemm, no cuDNN forward");
        // The third refuses: the second algorithm runs.
        close(&xd.conv2d(&wd, None, Conv2dArgs::default())?, &want, 1e-4, "the second algorithm")?;
        assert_eq!((stat("cudnn_convs") - convs, stat("gemms") - gemms), (1, 1), "one cuDNN forward, no more gemms");
        Ok(())
    })
}

/// Under KILN_CUDA_CONV=cudnn, a call every algorithm refuses is an error
/// naming cuDNN's status, with the way out.
pub(crate) fn cuda_a_forced_cudnn_path_reports_a_refusal() -> Ran {
    child(&[("KILN_CUDASIM_FAIL", "cudnnConvolutionForward.unsupported:2"), ("KILN_CUDA_CONV", "cudnn")], |d| {
        let (x, w) = (input((1, 2, 5, 5), DType::F32)?, input((3, 2, 3, 3), DType::F32)?);
        match x.to(&d)?.conv2d(&w.to(&d)?, None, Conv2dArgs::default()).and_then(|y| y.to_vec::<f32>()) {
            Err(Error::Backend { msg, .. }) => {
                assert!(msg.contains("CUDNN_STATUS_NOT_SUPPORTED") && msg.contains("KILN_CUDA_CONV=cudnn"), "{msg}")
            }
            other => panic!("expected the refusal as an error, got {other:?}"),
        }
        Ok(())
    })
}

/// Convolutions in a child whose cuDNN is set up by `env` run through
/// im2col and cuBLAS with the CPU's values, and `kiln devices` says `why`
/// (empty: cudnnCreate fails once, and the next convolution makes the handle).
fn without_cudnn(env: &[(&str, &str)], why: &'static str) -> Ran {
    child(env, move |d| {
        let (x, w) = (input((2, 2, 6, 6), DType::F32)?, input((3, 2, 3, 3), DType::F32)?);
        let (convs, gemms) = (stat("cudnn_convs"), stat("gemms"));
        let got = x.to(&d)?.conv2d(&w.to(&d)?, None, Conv2dArgs::default())?;
        close(&got, &x.conv2d(&w, None, Conv2dArgs::default())?, 1e-4, "without cuDNN")?;
        assert_eq!((stat("cudnn_convs") - convs, stat("gemms") - gemms), (0, 1), "im2col + cuBLAS ran");
        if why.is_empty() {
            x.to(&d)?.conv2d(&w.to(&d)?, None, Conv2dArgs::default())?.to_vec::<f32>()?;
            assert_eq!(stat("cudnn_convs") - convs, 1, "cuDNN's handle made at the next convolution");
        } else {
            assert!(detail(d, "cudnn").starts_with(&format!("no: {why}")), "{}", detail(d, "cudnn"));
            assert!(detail(d, "convolution").starts_with(&format!("im2col + cuBLAS (cuDNN: {why}")), "{}", detail(d, "convolution"));
        }
        Ok(())
    })
}

/// A KILN_CUDNN_LIB that cannot be loaded: named in `kiln devices`, and
/// convolutions run through cuBLAS.
pub(crate) fn cuda_an_unloadable_kiln_cudnn_lib_is_named_and_convolutions_use_cublas() -> Ran {
    without_cudnn(&[("KILN_CUDNN_LIB", "/nonexistent/libcudnn.so.9")], "KILN_CUDNN_LIB=/nonexistent/libcudnn.so.9 could not be loaded")
}

/// KILN_DISABLE_CUDNN=1: said in `kiln devices`; convolutions use cuBLAS.
pub(crate) fn cuda_kiln_disable_cudnn_is_named_and_convolutions_use_cublas() -> Ran {
    without_cudnn(&[("KILN_DISABLE_CUDNN", "1")], "cuDNN disabled by KILN_DISABLE_CUDNN=1")
}

/// A failing cudnnCreate: that convolution uses cuBLAS; the next makes the
/// handle and runs in cuDNN.
pub(crate) fn cuda_a_failed_cudnn_create_falls_back_and_is_tried_again() -> Ran {
    without_cudnn(&[("KILN_CUDASIM_FAIL", "cudnnCreate:1")], "")
}

/// KILN_CUDNN_BENCHMARK=1: cuDNN times its algorithms the first time a
/// shape is seen (its search runs each one that fits), not again, and the
/// fastest runs: the stand-in times the heuristics' last (algorithm 0) as
/// fastest, so the timed choice differs from the heuristics' (1). `kiln
/// devices` says so; the values are the CPU's.
pub(crate) fn cuda_cudnn_benchmark_times_each_shape_once() -> Ran {
    child(&[("KILN_CUDNN_BENCHMARK", "1")], |d| {
        assert!(detail(d, "convolution").contains("timed once per shape (KILN_CUDNN_BENCHMARK=1)"), "{}", detail(d, "convolution"));
        let (x, w) = (input((2, 3, 7, 7), DType::F32)?, input((4, 3, 3, 3), DType::F32)?);
        let (xd, wd) = (x.to(&d)?, w.to(&d)?);
        let want = x.conv2d(&w, None, Conv2dArgs::default())?;
        let convs = stat("cudnn_convs");
        close(&xd.conv2d(&wd, None, Conv2dArgs::default())?, &want, 1e-4, "first, timed")?;
        assert_eq!(stat("cudnn_convs") - convs, 3, "the search ran both algorithms, then the chosen one ran");
        assert_eq!(stat("cudnn_last_algo"), 0, "the timed fastest ran, not the heuristics' first");
        close(&xd.conv2d(&wd, None, Conv2dArgs::default())?, &want, 1e-4, "second")?;
        assert_eq!((stat("cudnn_convs") - convs, stat("cudnn_last_algo")), (4, 0), "the second time: no search, the same choice");
        set_env("KILN_CUDNN_BENCHMARK", Some("0"));
        close(&xd.conv2d(&wd, None, Conv2dArgs::default())?, &want, 1e-4, "by the heuristics")?;
        assert_eq!((stat("cudnn_convs") - convs, stat("cudnn_last_algo")), (5, 1), "without the benchmark: the heuristics' first");
        Ok(())
    })
}

/// A cudnnCreate that keeps failing is tried three times per device, then
/// not again: under KILN_CUDA_CONV=cudnn each convolution is an error that
/// says which.
pub(crate) fn cuda_a_cudnn_create_that_keeps_failing_is_given_up() -> Ran {
    child(&[("KILN_CUDASIM_FAIL", "cudnnCreate:10"), ("KILN_CUDA_CONV", "cudnn")], |d| {
        let (x, w) = (input((1, 2, 5, 5), DType::F32)?, input((3, 2, 3, 3), DType::F32)?);
        let (xd, wd) = (x.to(&d)?, w.to(&d)?);
        for attempt in 1..=4 {
            match xd.conv2d(&wd, None, Conv2dArgs::default()).and_then(|y| y.to_vec::<f32>()) {
                Err(Error::Backend { msg, .. }) => {
                    let want =
                        if attempt <= 3 { "cudnnCreate failed:" } else { "cudnnCreate failed 3 times on this device; not tried again" };
                    assert!(msg.contains(want), "attempt {attempt}: {msg}");
                }
                other => panic!("attempt {attempt}: expected an error, got {other:?}"),
            }
        }
        Ok(())
    })
}

/// On a device of 8 MiB, where no algorithm's workspace (one image
/// unfolded: 12.25 MiB) fits: the forward takes cuDNN's algorithm without
/// workspace; backward, the only one without workspace is
/// non-deterministic, so cuDNN declines and the gradients run on the next
/// path (im2col has no room either: the direct kernels). The CPU's values,
/// and nothing held afterwards.
pub(crate) fn cuda_cudnn_without_room_for_a_workspace_takes_another_algorithm_or_path() -> Ran {
    child(&[("KILN_CUDASIM_MEMORY", "8MiB")], |d| {
        let (x, w) = (input((1, 16, 64, 64), DType::F32)?, input((16, 16, 7, 7), DType::F32)?.mul_scalar(0.1)?);
        kiln::synchronize(&d)?;
        let base = kiln::memory_stats(&d)?.in_use;
        let convs = stat("cudnn_convs");
        let direct = |k: &str| stat(&format!("launches:{k}_f32"));
        let (bwd_in, bwd_w) = (direct("conv2d_bwd_input"), direct("conv2d_bwd_weight"));
        conv_round_trip(d, &x, &w, None, Conv2dArgs::default().padding(3), false, 1e-3)?;
        assert_eq!(
            (stat("cudnn_convs") - convs, direct("conv2d_bwd_input") - bwd_in, direct("conv2d_bwd_weight") - bwd_w),
            (1, 1, 1),
            "the forward in cuDNN, the gradients in the direct kernels"
        );
        kiln::synchronize(&d)?;
        assert_eq!(kiln::memory_stats(&d)?.in_use, base, "nothing held afterwards");
        Ok(())
    })
}
