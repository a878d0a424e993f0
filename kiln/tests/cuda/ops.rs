//! On a CUDA device: operations agree with the CPU, memory is booked and
//! returned, transfers are ledgered.

use super::*;

pub(crate) fn cuda_device_reports_itself() -> Ran {
    on_cuda("cuda_device_reports_itself", |d| {
        let info = kiln::devices().into_iter().find(|i| i.device == d).expect("listed");
        assert_eq!(info.kind, DeviceKind::Cuda);
        assert!(info.memory_total.unwrap_or(0) > 0);
        assert!(info.memory_free.unwrap_or(0) > 0);
        assert!(info.details.iter().any(|(k, _)| k == "compute capability"), "{:?}", info.details);
        println!("{d}: {} {:?}", info.name, info.details);
        Ok(())
    })
}

pub(crate) fn cuda_creation_and_random_match_the_cpu() -> Ran {
    on_cuda("creation", |d| {
        for dtype in [DType::F32, DType::F64, DType::I64, DType::U8, DType::F16, DType::BF16] {
            same(&Tensor::full(3.75, (3, 5), dtype, &d)?, &Tensor::full(3.75, (3, 5), dtype, &cpu())?, "full")?;
            same(&Tensor::arange_dtype(-3.0, 40.0, 0.7, dtype, &d)?, &Tensor::arange_dtype(-3.0, 40.0, 0.7, dtype, &cpu())?, "arange")?;
            same(&Tensor::eye(4, dtype, &d)?, &Tensor::eye(4, dtype, &cpu())?, "eye")?;
        }
        for dtype in [DType::F32, DType::F64, DType::F16, DType::BF16] {
            kiln::manual_seed(11);
            let g = Tensor::rand_uniform(-2.0, 3.0, (1000,), dtype, &d)?;
            kiln::manual_seed(11);
            let h = Tensor::rand_uniform(-2.0, 3.0, (1000,), dtype, &cpu())?;
            same(&g, &h, "uniform")?;
            kiln::manual_seed(12);
            let g = Tensor::randn_with(1.0, 2.0, (1000,), dtype, &d)?;
            kiln::manual_seed(12);
            let h = Tensor::randn_with(1.0, 2.0, (1000,), dtype, &cpu())?;
            // log/cos differ between CUDA's and the host's libm by an ulp.
            close(&g, &h, 1e-6, "normal")?;
        }
        Ok(())
    })
}

pub(crate) fn cuda_elementwise_ops_match_the_cpu() -> Ran {
    on_cuda("elementwise", |d| {
        let a = sample(&[4, 6], 1)?;
        let b = sample(&[6], 2)?;
        let (ga, gb) = (a.to(&d)?, b.to(&d)?);
        use kiln::{BinaryOp as B, UnaryOp as U};
        for op in [B::Add, B::Sub, B::Mul, B::Div, B::Maximum, B::Minimum, B::Lt, B::Ge, B::Eq] {
            let bb = b.broadcast_to((4, 6))?;
            same(&ga.binary(&gb.broadcast_to((4, 6))?, op)?, &a.binary(&bb, op)?, &format!("{op:?}"))?;
            // Transposed operands take the strided path.
            same(&ga.t()?.binary(&ga.t()?, op)?, &a.t()?.binary(&a.t()?, op)?, &format!("{op:?} transposed"))?;
        }
        for op in [
            U::Neg,
            U::Abs,
            U::Sqr,
            U::Relu,
            U::Powi(3),
            U::Powi(-2),
            U::AddScalar(0.5),
            U::RSubScalar(2.0),
            U::Affine(1.5, -0.25),
            U::MaxScalar(0.1),
        ] {
            same(&ga.t()?.unary(op)?, &a.t()?.unary(op)?, &format!("{op:?}"))?;
        }
        for op in [U::Exp, U::Tanh, U::Sigmoid, U::Sin, U::Cos, U::Powf(1.5), U::Recip] {
            close(&ga.unary(op)?, &a.unary(op)?, 1e-5, &format!("{op:?}"))?;
        }
        let pos = a.abs()?.add_scalar(0.1)?;
        close(&pos.to(&d)?.unary(U::Log)?, &pos.unary(U::Log)?, 1e-6, "log")?;
        close(&pos.to(&d)?.unary(U::Sqrt)?, &pos.unary(U::Sqrt)?, 1e-6, "sqrt")?;
        // Integers wrap and divide by zero to 0, as on the CPU.
        let i = Tensor::new(&[i64::MAX, -7, 9, 0], &cpu())?;
        let j = Tensor::new(&[1i64, 2, 0, -3], &cpu())?;
        for op in [B::Add, B::Mul, B::Div, B::Sub] {
            same(&i.to(&d)?.binary(&j.to(&d)?, op)?, &i.binary(&j, op)?, &format!("i64 {op:?}"))?;
        }
        let u = Tensor::new(&[250u8, 3, 7], &cpu())?;
        same(&u.to(&d)?.add_scalar(10.0)?, &u.add_scalar(10.0)?, "u8 wraps")?;
        Ok(())
    })
}

pub(crate) fn cuda_reductions_match_the_cpu() -> Ran {
    on_cuda("reductions", |d| {
        let a = sample(&[3, 50, 7], 3)?;
        let g = a.to(&d)?;
        for dims in [&[0usize][..], &[1], &[2], &[0, 2], &[0, 1, 2]] {
            close(&g.sum_dims(dims, true)?, &a.sum_dims(dims, true)?, 1e-5, &format!("sum {dims:?}"))?;
            same(&g.reduce(kiln::Reduction::Max, dims, false)?, &a.reduce(kiln::Reduction::Max, dims, false)?, "max")?;
            same(&g.reduce(kiln::Reduction::Min, dims, false)?, &a.reduce(kiln::Reduction::Min, dims, false)?, "min")?;
        }
        for dim in 0..3 {
            same(&g.argmax(dim)?, &a.argmax(dim)?, &format!("argmax {dim}"))?;
            same(&g.argmin(dim)?, &a.argmin(dim)?, &format!("argmin {dim}"))?;
            same(&g.transpose(0, 2)?.argmax(dim)?, &a.transpose(0, 2)?.argmax(dim)?, "argmax transposed")?;
        }
        // Ties pick the first index.
        let t = Tensor::new(&[[1f32, 5., 5.], [2., 2., 0.]], &cpu())?;
        same(&t.to(&d)?.argmax(1)?, &t.argmax(1)?, "ties")?;
        let big = Tensor::ones(3_000_000, DType::F32, &d)?;
        assert_eq!(big.sum_all()?.to_scalar::<f32>()?, 3_000_000.0);
        let i = Tensor::arange_dtype(0.0, 1000.0, 1.0, DType::I64, &d)?;
        assert_eq!(i.sum_all()?.to_scalar::<i64>()?, 499_500);
        Ok(())
    })
}

pub(crate) fn cuda_matmul_matches_the_cpu() -> Ran {
    on_cuda("matmul", |d| {
        let a = sample(&[2, 3, 33, 17], 5)?;
        let b = sample(&[3, 17, 9], 6)?;
        let (ga, gb) = (a.to(&d)?, b.to(&d)?);
        close(&ga.matmul(&gb)?, &a.matmul(&b)?, 1e-4, "batched, broadcast batch")?;
        close(&ga.transpose(2, 3)?.matmul(&ga)?, &a.transpose(2, 3)?.matmul(&a)?, 1e-4, "transposed lhs")?;
        let every_other = ga.narrow(3, 0, 16)?.reshape((2, 3, 33, 16))?;
        let cpu_eo = a.narrow(3, 0, 16)?.reshape((2, 3, 33, 16))?;
        close(&every_other.matmul(&every_other.transpose(2, 3)?)?, &cpu_eo.matmul(&cpu_eo.transpose(2, 3)?)?, 1e-4, "narrowed")?;
        let v = sample(&[17], 7)?;
        close(&ga.matmul(&v.to(&d)?)?, &a.matmul(&v)?, 1e-4, "matrix @ vector")?;
        let a64 = a.to_dtype(DType::F64)?;
        let b64 = b.to_dtype(DType::F64)?;
        close(&a64.to(&d)?.matmul(&b64.to(&d)?)?, &a64.matmul(&b64)?, 1e-10, "f64")?;
        let ai = Tensor::arange_dtype(0.0, 12.0, 1.0, DType::I64, &cpu())?.reshape((3, 4))?;
        same(&ai.to(&d)?.matmul(&ai.t()?.to(&d)?)?, &ai.matmul(&ai.t()?)?, "i64")?;
        let ah = a.to_dtype(DType::F16)?;
        let bh = b.to_dtype(DType::F16)?;
        close(&ah.to(&d)?.matmul(&bh.to(&d)?)?, &ah.matmul(&bh)?, 2e-2, "f16")?;
        let empty = Tensor::zeros((4, 0), DType::F32, &d)?.matmul(&Tensor::zeros((0, 3), DType::F32, &d)?)?;
        assert_eq!(empty.to_vec::<f32>()?, vec![0.0; 12]);
        Ok(())
    })
}

pub(crate) fn cuda_copies_casts_and_indexing_match_the_cpu() -> Ran {
    on_cuda("copies", |d| {
        let a = sample(&[5, 4], 8)?.mul_scalar(100.0)?;
        let all = [DType::F32, DType::F64, DType::I64, DType::U8, DType::F16, DType::BF16];
        for from in all {
            let x = a.to_dtype(from)?;
            let gx = x.to(&d)?;
            for to in all {
                same(&gx.t()?.to_dtype(to)?, &x.t()?.to_dtype(to)?, &format!("{from} -> {to}"))?;
            }
            same(&gx.t()?.contiguous()?, &x.t()?.contiguous()?, "contiguous")?;
            let ids = Tensor::new(&[3i64, 0, 3], &cpu())?;
            same(&gx.index_select(&ids.to(&d)?, 0)?, &x.index_select(&ids, 0)?, "index_select")?;
            let ids8 = Tensor::new(&[1u8, 1], &cpu())?;
            same(&gx.index_select(&ids8.to(&d)?, 1)?, &x.index_select(&ids8, 1)?, "index_select u8 ids")?;
        }
        let src = sample(&[3, 4], 9)?;
        let ids = Tensor::new(&[4i64, 0, 4], &cpu())?;
        let z = Tensor::zeros((5, 4), DType::F32, &cpu())?;
        same(&z.to(&d)?.index_add(&ids.to(&d)?, &src.to(&d)?, 0)?, &z.index_add(&ids, &src, 0)?, "index_add repeats")?;
        let c = Tensor::new(&[1u8, 0, 1, 0], &cpu())?;
        let (t, f) = (sample(&[4], 10)?, Tensor::new(&[-1f32], &cpu())?);
        same(&c.to(&d)?.where_cond(&t.to(&d)?, &f.to(&d)?.broadcast_to(4)?)?, &c.where_cond(&t, &f.broadcast_to(4)?)?, "where")?;
        // In-place assignment through a view.
        let w = Tensor::zeros((3, 3), DType::F32, &d)?;
        w.narrow(1, 1, 2)?.assign(&Tensor::ones((3, 2), DType::F32, &d)?)?;
        assert_eq!(w.to_vec::<f32>()?, vec![0., 1., 1., 0., 1., 1., 0., 1., 1.]);
        Ok(())
    })
}

pub(crate) fn cuda_memory_is_booked_returned_and_bounded() -> Ran {
    // Exact `in_use` figures: no other test may allocate meanwhile.
    on_cuda_alone("memory", |d| {
        kiln::synchronize(&d)?;
        let before = kiln::memory_stats(&d)?;
        {
            let t = Tensor::zeros((1024, 1024), DType::F32, &d)?;
            let during = kiln::memory_stats(&d)?;
            assert!(during.in_use >= before.in_use + (4 << 20));
            drop(t);
        }
        assert_eq!(kiln::memory_stats(&d)?.in_use, before.in_use, "memory back after drop");
        let capacity = before.capacity.expect("a CUDA device has a capacity");
        match Tensor::zeros(capacity / 4 + 1, DType::F64, &d) {
            Err(Error::OutOfMemory { device, .. }) => assert_eq!(device, d),
            Err(e) => panic!("expected OutOfMemory, got {e}"),
            Ok(_) => panic!("allocated more than the device has"),
        }
        // The device still works after the refusal.
        assert_eq!(Tensor::ones(3, DType::F32, &d)?.sum_all()?.to_scalar::<f32>()?, 3.0);
        Ok(())
    })
}

pub(crate) fn cuda_transfers_are_ledgered_and_round_trip() -> Ran {
    on_cuda("transfers", |d| {
        let before = kiln::thread_transfer_stats();
        let host: Vec<f32> = (0..3_000_000).map(|i| i as f32).collect();
        let x = Tensor::from_vec(host.clone(), (3_000_000,), &d)?;
        assert_eq!(x.to_vec::<f32>()?, host, "20 MB through the staging buffers and back");
        let s = kiln::thread_transfer_stats().since(&before);
        assert_eq!(s.direction(kiln::Direction::HostToDevice).count, 1);
        assert_eq!(s.direction(kiln::Direction::DeviceToHost).count, 1);
        assert_eq!(s.direction(kiln::Direction::HostToDevice).bytes, 12_000_000);
        let back = x.copy_to(&cpu())?;
        assert_eq!(back.device(), cpu());
        kiln::synchronize(&d)?;
        Ok(())
    })
}
