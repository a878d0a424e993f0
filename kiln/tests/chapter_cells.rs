//! Every code cell of the chapter's five versions (../shared/seeds), as the
//! machine running the test has them: with no GPU (`cargo test`), one
//! (`KILN_SIM_GPUS=1`) or two (`KILN_SIM_GPUS=2`). Nothing here adds GPUs:
//! each cell asserts what the chapter states for the GPUs that exist.

use kiln::data::synthetic_regression;
use kiln::nn::{LazyLinear, Loss, Module, ParamVisitor, Sequential};
use kiln::optim::OptimizerConfig;
use kiln::trainer::{Learner, Progress, Trainer};
use kiln::{cpu, gpu, num_gpus, try_all_gpus, try_gpu, DType, Device, Error, Result, Tensor};

#[test]
fn devices_and_try_gpu() {
    // cpu(), gpu(0), gpu(1) name devices; naming never fails.
    assert_eq!((cpu().to_string(), gpu(0).to_string(), gpu(1).to_string()), ("cpu".into(), "gpu(0)".into(), "gpu(1)".into()));
    let n = num_gpus();
    // try_gpu(i) is gpu(i) if it exists, else the CPU; try_all_gpus() is every GPU or [cpu].
    assert_eq!(try_gpu(0), if n >= 1 { gpu(0) } else { cpu() });
    assert_eq!(try_gpu(10), cpu());
    let all = try_all_gpus();
    assert_eq!(all, if n == 0 { vec![cpu()] } else { (0..n).map(Device::Gpu).collect() });
}

#[test]
fn tensors_live_where_created_and_mixing_devices_is_an_error() -> Result<()> {
    // x = torch.tensor([1, 2, 3]); x.device -> cpu
    let x = Tensor::new(&[1, 2, 3], &cpu())?;
    assert_eq!((x.device(), x.dtype()), (cpu(), DType::I32));
    // X = torch.ones(2, 3, device=try_gpu()); Y = torch.rand(2, 3, device=try_gpu(1))
    let big_x = Tensor::ones((2, 3), DType::F32, &try_gpu(0))?;
    let y = Tensor::rand((2, 3), &try_gpu(1))?;
    assert_eq!((big_x.device(), y.device()), (try_gpu(0), try_gpu(1)));
    // X + Y: with one GPU or two, the devices differ (gpu(0) and cpu, or
    // gpu(0) and gpu(1)): an error, never a silent copy. With none, it computes.
    match (&big_x + &y, try_gpu(0) != try_gpu(1)) {
        (Err(Error::DeviceMismatch { lhs, rhs, .. }), true) => assert_eq!((lhs, rhs), (try_gpu(0), try_gpu(1))),
        (Ok(sum), false) => assert_eq!(sum.device(), cpu()),
        (other, differ) => panic!("devices differ = {differ}: {other:?}"),
    }
    // Z = X.cuda(1); Y + Z; Z.cuda(1) is Z
    let z = big_x.to(&try_gpu(1))?;
    assert_eq!((&y + &z)?.device(), try_gpu(1));
    assert!(z.to(&try_gpu(1))?.same_storage(&z));
    Ok(())
}

#[test]
fn mxnet_copyto_always_copies_and_as_in_context_does_not() -> Result<()> {
    // y = x.copyto(mx.gpu()); z = x.as_in_context(mx.gpu()); z.as_in_context(mx.gpu()) is z
    let x = Tensor::ones((2, 3), DType::F32, &try_gpu(0))?;
    let copied = x.copy_to(&try_gpu(0))?;
    assert!(!copied.same_storage(&x));
    assert!(x.to(&try_gpu(0))?.same_storage(&x));
    assert_eq!(copied.to_vec::<f32>()?, vec![1.0; 6]);
    Ok(())
}

#[test]
fn tensorflow_device_scope_and_jax_device_put() -> Result<()> {
    // with tf.device('/GPU:0'): X = tf.ones((2, 3))
    {
        let _scope = kiln::default_device_scope(try_gpu(0))?;
        assert_eq!(Tensor::new_default(&[1f32, 2.])?.device(), try_gpu(0));
    }
    assert_eq!(kiln::default_device(), cpu());
    // jax.device_put(x, try_gpu(1)); lazy execution: the result is returned at
    // once and block_until_ready waits for it.
    let x = Tensor::rand((64, 64), &cpu())?;
    let on = x.to(&try_gpu(num_gpus().saturating_sub(1)))?;
    let y = on.matmul(&on)?;
    y.block_until_ready()?;
    kiln::synchronize(&y.device())?;
    assert_eq!(y.dims(), &[64, 64]);
    Ok(())
}

/// The chapter's set_scratch_params_device: plain tensors as parameters.
struct Scratch {
    w: Tensor,
    b: Tensor,
}

impl Module for Scratch {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        x.matmul(&self.w)?.add(&self.b)
    }
    fn named_parameters(&self) -> Vec<(String, Tensor)> {
        vec![("w".into(), self.w.clone()), ("b".into(), self.b.clone())]
    }
    fn visit_parameters_mut(&mut self, f: &mut ParamVisitor<'_>) -> Result<()> {
        f("w", &mut self.w)?;
        f("b", &mut self.b)
    }
}

#[test]
fn neural_networks_on_the_gpu_and_scratch_params() -> Result<()> {
    // net = nn.Sequential(nn.LazyLinear(1)); net = net.to(device=try_gpu()); net(X)
    let mut net = Sequential::new().add(LazyLinear::new(1));
    net.to(&try_gpu(0))?;
    let x = Tensor::ones((2, 3), DType::F32, &try_gpu(0))?;
    assert_eq!(net.forward(&x)?.device(), try_gpu(0));
    // net[0].weight.data.device
    assert_eq!(net[0].parameter("weight")?.device(), try_gpu(0));
    // set_scratch_params_device
    let mut m = Scratch { w: Tensor::randn((2, 1), &cpu())?.requires_grad_(), b: Tensor::zeros(1, DType::F32, &cpu())?.requires_grad_() };
    m.to(&try_gpu(0))?;
    assert!(m.w.device() == try_gpu(0) && m.b.device() == try_gpu(0) && m.w.requires_grad());
    Ok(())
}

#[test]
fn trainer_with_num_gpus_trains_the_lazy_linear_regression() -> Result<()> {
    // model = d2l.LinearRegression(lr=0.03); trainer = d2l.Trainer(max_epochs=3, num_gpus=1)
    kiln::manual_seed(0);
    let data = synthetic_regression(1000, 1000, 32)?;
    let mut model = Learner::new(LazyLinear::new(1), Loss::Mse, OptimizerConfig::sgd(0.03));
    let mut trainer = Trainer::builder().max_epochs(3).num_gpus(1).progress(Progress::Off).build()?;
    let history = trainer.fit(&mut model, &data)?;
    assert_eq!(history.device, try_gpu(0));
    assert_eq!(model.net.parameter("weight")?.device(), try_gpu(0));
    assert!(history.last().unwrap().val_loss.unwrap() < 0.01, "{history:?}");
    Ok(())
}

// ---- every other cell of the five versions, on the GPUs the environment has ----

/// How many simulated GPUs `KILN_SIM_GPUS` asks for (0 when unset).
fn env_sim_gpus() -> usize {
    std::env::var("KILN_SIM_GPUS").ok().and_then(|v| v.trim().parse().ok()).unwrap_or(0)
}

/// Device-to-host, host-to-device and device-to-device transfers since `mark`.
fn moved_since(mark: &kiln::TransferStats) -> (usize, usize, usize) {
    let d = kiln::thread_transfer_stats().since(mark);
    let c = |dir| d.direction(dir).count as usize;
    (c(kiln::Direction::DeviceToHost), c(kiln::Direction::HostToDevice), c(kiln::Direction::DeviceToDevice))
}

/// The transfers (d2h, h2d, d2d) that moving a tensor from `src` to `dst` makes.
fn one_move(src: Device, dst: Device) -> (usize, usize, usize) {
    match (src.is_gpu(), dst.is_gpu()) {
        _ if src == dst => (0, 0, 0),
        (true, false) => (1, 0, 0),
        (false, true) => (0, 1, 0),
        _ => (0, 0, 1),
    }
}

/// What printing a tensor on `d` appends: `, device=gpu(i)` on a GPU, nothing on the CPU.
fn suffix(d: Device) -> String {
    if d.is_gpu() {
        format!(", device={d}")
    } else {
        String::new()
    }
}

/// 000 (tabs pytorch, mxnet/tensorflow/jax) `def num_gpus(): return torch.cuda.device_count()`;
/// 001 `npx.num_gpus()`, `torch.cuda.device_count()`,
/// `len(tf.config.experimental.list_physical_devices('GPU'))`; 003 In[3] `def num_gpus():` and
/// In[22] `torch.cuda.device_count()`; 001/004 `!nvidia-smi`; 003 In[20]
/// `tf.config.get_visible_devices()`.
#[test]
fn num_gpus_counts_the_gpus_the_environment_has() {
    let n = num_gpus();
    let list = kiln::devices();
    let cuda = list.iter().filter(|i| i.kind == kiln::DeviceKind::Cuda).count();
    let sims = list.iter().filter(|i| i.kind == kiln::DeviceKind::Simulated).count();
    // Real GPUs first, then the simulated ones KILN_SIM_GPUS asked for.
    assert_eq!(sims, env_sim_gpus(), "KILN_SIM_GPUS={:?}", std::env::var("KILN_SIM_GPUS"));
    assert_eq!(n, cuda + sims);
    // nvidia-smi / get_visible_devices: the CPU, then one record per GPU.
    assert_eq!(list.len(), n + 1);
    assert_eq!(list[0].device, cpu());
    assert!(list[1..].iter().enumerate().all(|(i, info)| info.device == gpu(i)));
    // 003 In[3]: on a machine without a GPU the answer is 0, not an error.
    if n == 0 {
        assert!(kiln::why_not_gpu(0).is_some());
    }
}

/// 000 (tabs mxnet, tensorflow, jax) `def gpu(i=0): ... return jax.devices('gpu')[i]`, and
/// 003 In[2] `def gpu(i=0):`: naming a GPU never fails; using one that is not there is
/// `NoSuchDevice`, naming it and the devices that exist.
#[test]
fn naming_a_missing_gpu_is_fine_using_it_is_no_such_device() {
    let n = num_gpus();
    let missing = gpu(n);
    assert!(!missing.exists());
    match Tensor::zeros((2, 3), DType::F32, &missing) {
        Err(Error::NoSuchDevice { device, available }) => {
            assert_eq!(device, missing);
            assert_eq!(available, kiln::devices().iter().map(|i| i.device).collect::<Vec<_>>());
        }
        other => panic!("a tensor on {missing} with {n} GPUs: {other:?}"),
    }
    let err = Tensor::ones(3, DType::F32, &cpu()).unwrap().to(&missing).unwrap_err();
    assert!(err.to_string().contains(&missing.to_string()), "{err}");
}

/// 001 (tab pytorch) `torch.device('cpu'), torch.cuda.device('cuda'), torch.cuda.device('cuda:1')`
/// and (tab tensorflow) `tf.device('/CPU:0'), tf.device('/GPU:0'), tf.device('/GPU:1')`;
/// 003 In[23] `x = torch.linspace(0., 10, 100).to('cpu')`.
#[test]
fn device_strings_of_every_tab() -> Result<()> {
    for (text, dev) in [("cpu", cpu()), ("cuda", gpu(0)), ("cuda:1", gpu(1)), ("/CPU:0", cpu()), ("/GPU:0", gpu(0)), ("/GPU:1", gpu(1))] {
        assert_eq!(text.parse::<Device>()?, dev, "{text}");
    }
    // x = torch.linspace(0., 10, 100).to('cpu'); x.device -> cpu, and no copy.
    let x = Tensor::linspace(0.0, 10.0, 100, &cpu())?;
    let y = x.to(&"cpu".parse()?)?;
    assert!(y.same_storage(&x) && y.device() == cpu());
    Ok(())
}

/// 000 `x = torch.tensor([1, 2, 3])` / `x = np.array([1, 2, 3])` / `x = tf.constant([1, 2, 3])` /
/// `x = jnp.array([1, 2, 3])` then `x.device`; 001 the same three tabs; 002 `x = torch.tensor([1, 2, 3])`;
/// 003 In[6] `x = jnp.array([1, 2, 3])`; 004 `x = nd.array([1, 2, 3])` (printed) and `x.context`.
/// kiln follows PyTorch and MXNet: tensors are created on the CPU, whatever GPUs exist (TF and
/// JAX would pick the first GPU).
#[test]
fn tensors_are_created_on_the_cpu_by_default() -> Result<()> {
    let mark = kiln::thread_transfer_stats();
    let x = Tensor::new_default(&[1, 2, 3])?;
    assert_eq!((x.device(), x.dtype(), x.dims()), (cpu(), DType::I32, &[3usize][..]));
    // Printing a CPU tensor shows no device (MXNet's `@cpu(0)`) and transfers nothing.
    assert_eq!(format!("{x}"), "tensor([1, 2, 3], dtype=i32)");
    assert_eq!(moved_since(&mark), (0, 0, 0));
    Ok(())
}

/// 000 `X = np.ones((2, 3), ctx=try_gpu())` (mxnet), `X = torch.ones(2, 3, device=try_gpu())`,
/// `with try_gpu(): X = tf.ones((2, 3))`, `X = jax.device_put(jnp.ones((2, 3)), try_gpu())`,
/// each followed by `X`; 001 the first three; 002 `X = torch.ones(2, 3, device=try_gpu())`;
/// 003 In[7] `X = jax.device_put(jnp.ones((2, 3)), try_tpu_gpu())`; 004 `x = nd.ones((2, 3), ctx=mx.gpu())`.
#[test]
fn storing_x_on_the_first_gpu_every_tab() -> Result<()> {
    let g0 = try_gpu(0);
    let mark = kiln::thread_transfer_stats();
    // mxnet, pytorch, 004: created there; nothing crosses a bus.
    let x = Tensor::ones((2, 3), DType::F32, &g0)?;
    // tensorflow: created in a device scope.
    let x_tf = {
        let _scope = kiln::default_device_scope(g0)?;
        Tensor::ones((2, 3), DType::F32, &kiln::default_device())?
    };
    assert_eq!(moved_since(&mark), (0, 0, 0));
    // jax: created on the host, then put on the device: one host-to-device copy of 24 bytes.
    let host = Tensor::ones((2, 3), DType::F32, &cpu())?;
    let mark = kiln::thread_transfer_stats();
    let x_jax = host.to(&g0)?;
    assert_eq!(moved_since(&mark), one_move(cpu(), g0));
    assert_eq!(x_jax.same_storage(&host), g0 == cpu());
    for t in [&x, &x_tf, &x_jax] {
        assert_eq!((t.device(), t.dims()), (g0, &[2usize, 3][..]));
        // `X`: printing reads it back, one device-to-host transfer on a GPU.
        let mark = kiln::thread_transfer_stats();
        assert_eq!(format!("{t}"), format!("tensor([[1., 1., 1.],\n        [1., 1., 1.]]{})", suffix(g0)));
        assert_eq!(moved_since(&mark), one_move(g0, cpu()));
    }
    Ok(())
}

/// 000 `Y = np.random.uniform(size=(2, 3), ctx=try_gpu(1))`, `Y = torch.rand(2, 3, device=try_gpu(1))`,
/// `with try_gpu(1): Y = tf.random.uniform((2, 3))`, `Y = jax.device_put(jax.random.uniform(...), try_gpu(1))`;
/// 001 the first three; 003 In[8] `Y = jax.device_put(jax.random.uniform(jax.random.PRNGKey(0), (2, 3)),`;
/// 004 `y = nd.random.uniform(shape=(2, 3), ctx=mx.gpu(1))`. A seeded draw gives the same
/// values on every device, so drawing on the GPU and drawing on the host then moving agree.
#[test]
fn random_y_on_the_second_gpu_every_tab() -> Result<()> {
    let g1 = try_gpu(1);
    kiln::manual_seed(0);
    let y = Tensor::rand((2, 3), &g1)?;
    kiln::manual_seed(0);
    let y_tf = {
        let _scope = kiln::default_device_scope(g1)?;
        Tensor::rand((2, 3), &kiln::default_device())?
    };
    kiln::manual_seed(0);
    let y_jax = Tensor::rand((2, 3), &cpu())?.to(&g1)?;
    let v = y.to_vec::<f32>()?;
    assert!(v.iter().all(|x| (0.0..1.0).contains(x)), "{v:?}");
    for t in [&y_tf, &y_jax] {
        assert_eq!(t.device(), g1);
        assert_eq!(t.to_vec::<f32>()?, v);
    }
    Ok(())
}

/// 000 `Z = X.copyto(try_gpu(1))` (mxnet), `Z = X.cuda(1)`, `with try_gpu(1): Z = X`,
/// `Z = jax.device_put(X, try_gpu(1))`, each with `print(X)` and `print(Z)`; 001 the first three;
/// 002 `Z = X.cuda(1) # Copy X to the second GPU`; 003 In[10] `Z = jax.device_put(X, try_tpu_gpu(1))`;
/// 004 `z = x.copyto(mx.gpu(1))` with `y + z`, `print(x)`, `print(z)`.
#[test]
fn copying_x_to_the_second_gpu_every_tab() -> Result<()> {
    let (g0, g1) = (try_gpu(0), try_gpu(1));
    let x = Tensor::ones((2, 3), DType::F32, &g0)?;
    // pytorch X.cuda(1), jax device_put: a copy only when the devices differ.
    let mark = kiln::thread_transfer_stats();
    let z = x.to(&g1)?;
    assert_eq!(moved_since(&mark), one_move(g0, g1));
    assert_eq!((z.device(), z.same_storage(&x)), (g1, g0 == g1));
    // mxnet copyto: new memory always, even when both are the CPU.
    let z_mx = x.copy_to(&g1)?;
    assert!(!z_mx.same_storage(&x) && z_mx.device() == g1);
    // tensorflow `with try_gpu(1): Z = X`: a scope moves nothing: Z is X, where X is, and
    // an op on X inside the scope runs where X is.
    {
        let _scope = kiln::default_device_scope(g1)?;
        let z_tf = x.clone();
        assert!(z_tf.same_storage(&x) && z_tf.device() == g0);
        assert_eq!((&z_tf * 2.0)?.device(), g0);
    }
    // print(X); print(Z)
    let mark = kiln::thread_transfer_stats();
    let (px, pz) = (format!("{x}"), format!("{z}"));
    let ones = "tensor([[1., 1., 1.],\n        [1., 1., 1.]]";
    assert_eq!((px, pz), (format!("{ones}{})", suffix(g0)), format!("{ones}{})", suffix(g1))));
    let reads = [g0, g1].iter().filter(|d| d.is_gpu()).count();
    assert_eq!(moved_since(&mark), (reads, 0, 0));
    // 004: y + z, with y on gpu(1).
    let y = Tensor::rand((2, 3), &g1)?;
    let s = (&y + &z_mx)?;
    assert_eq!(s.device(), g1);
    assert_eq!(s.to_vec::<f32>()?, y.to_vec::<f32>()?.iter().map(|v| v + 1.0).collect::<Vec<_>>());
    Ok(())
}

/// 000 (tab all) `Y + Z`; 001 `Y + Z`; 002 `Y + Z # Addition on the second GPU`; 003 In[9] `X + Y`
/// (on its CPU-only machine it computes) and In[11] `Y + Z`.
#[test]
fn y_plus_z_and_x_plus_y_values() -> Result<()> {
    let (g0, g1) = (try_gpu(0), try_gpu(1));
    kiln::manual_seed(0);
    let x = Tensor::ones((2, 3), DType::F32, &cpu())?.to(&g0)?;
    let y = Tensor::rand((2, 3), &cpu())?.to(&g1)?;
    let expected: Vec<f32> = y.to_vec::<f32>()?.iter().map(|v| v + 1.0).collect();
    match &x + &y {
        Ok(s) if g0 == g1 => assert_eq!((s.device(), s.to_vec::<f32>()?), (g1, expected.clone())),
        Err(Error::DeviceMismatch { op, lhs, rhs }) if g0 != g1 => assert_eq!((op.as_str(), lhs, rhs), ("add", g0, g1)),
        other => panic!("X + Y with X on {g0}, Y on {g1}: {other:?}"),
    }
    let z = x.to(&g1)?;
    let s = (&y + &z)?;
    assert_eq!((s.device(), s.to_vec::<f32>()?), (g1, expected));
    Ok(())
}

/// 000 `Z.as_in_ctx(try_gpu(1)) is Z` (mxnet), `Z.cuda(1) is Z`, `with try_gpu(1): Z2 = Z` /
/// `Z2 is Z` (tensorflow), `Z2 = jax.device_put(Z, try_gpu(1))` / `Z2 is Z`; 001 the first three;
/// 003 In[12] `Z2 = jax.device_put(Z, try_tpu_gpu(1))` (its JAX printed False; the chapter
/// states Z); 004 `z = x.as_in_context(mx.gpu())`, `y.as_in_context(mx.gpu()) is y` and
/// `y.copyto(mx.gpu()) is y`.
#[test]
fn moving_to_where_a_tensor_already_is_is_a_no_op() -> Result<()> {
    let (g0, g1) = (try_gpu(0), try_gpu(1));
    let z = Tensor::ones((2, 3), DType::F32, &g1)?;
    let mark = kiln::thread_transfer_stats();
    assert!(z.to(&g1)?.same_storage(&z));
    {
        let _scope = kiln::default_device_scope(g1)?;
        assert!(z.to(&kiln::default_device())?.same_storage(&z));
    }
    assert_eq!(moved_since(&mark), (0, 0, 0));
    // 004: x lives on gpu(): as_in_context(gpu()) is x.
    let x = Tensor::ones((2, 3), DType::F32, &g0)?;
    assert!(x.to(&g0)?.same_storage(&x));
    // 004: y lives on gpu(1): as_in_context(gpu()) is y only where gpu(1) is gpu() (no GPU);
    // with two GPUs it is a copy on gpu(0).
    let y = Tensor::rand((2, 3), &g1)?;
    let y0 = y.to(&g0)?;
    assert_eq!((y0.same_storage(&y), y0.device()), (g0 == g1, g0));
    // copyto is never the same.
    assert!(!y.copy_to(&g0)?.same_storage(&y));
    Ok(())
}

/// 004 `(z + 2).exp() * y`: z is on gpu(0) (`x.as_in_context(mx.gpu())`) and y on gpu(1), so with
/// one or two GPUs the cell as written is a device mismatch; moved first, the result lands on
/// y's device.
#[test]
fn mxnet_computing_on_the_gpu() -> Result<()> {
    let (g0, g1) = (try_gpu(0), try_gpu(1));
    let z = Tensor::ones((2, 3), DType::F32, &g0)?;
    let y = Tensor::rand((2, 3), &g1)?;
    let e = z.add_scalar(2.0)?.exp()?;
    assert_eq!(e.device(), g0, "results stay on the operands' device");
    match &e * &y {
        Ok(r) if g0 == g1 => assert_eq!(r.device(), g1),
        Err(Error::DeviceMismatch { lhs, rhs, .. }) if g0 != g1 => assert_eq!((lhs, rhs), (g0, g1)),
        other => panic!("(z + 2).exp() * y with z on {g0}, y on {g1}: {other:?}"),
    }
    let r = z.to(&g1)?.add_scalar(2.0)?.exp()?.mul(&y)?;
    assert_eq!(r.device(), g1);
    let e3 = 3f32.exp();
    for (got, yv) in r.to_vec::<f32>()?.into_iter().zip(y.to_vec::<f32>()?) {
        assert!((got - e3 * yv).abs() <= 1e-5 * e3, "{got} vs {}", e3 * yv);
    }
    Ok(())
}

/// 000 `net = nn.Sequential()` / `net.add(nn.Dense(1))` / `net.initialize(ctx=try_gpu())` (mxnet),
/// `net = nn.Sequential(nn.LazyLinear(1))` / `net = net.to(device=try_gpu())`,
/// `strategy = tf.distribute.MirroredStrategy()` (tensorflow), then `net(X)`,
/// `net[0].weight.data().ctx`, `net[0].weight.data.device`,
/// `net.layers[0].weights[0].device, net.layers[0].weights[1].device`; 001 (tab pytorch)
/// `net = nn.Sequential(nn.Linear(3, 1))`; 002 `net = nn.Sequential(nn.LazyLinear(1))`.
#[test]
fn networks_on_the_gpu_every_tab() -> Result<()> {
    let g0 = try_gpu(0);
    let x = Tensor::ones((2, 3), DType::F32, &g0)?;
    // mxnet Dense(1) initialized on try_gpu(): a lazy layer placed before it has parameters.
    let mut mx = Sequential::new().add(LazyLinear::new(1));
    mx.to(&g0)?;
    let out = mx.forward(&x)?;
    assert_eq!((out.device(), out.dims()), (g0, &[2usize, 1][..]));
    assert!(mx.parameters().iter().all(|p| p.device() == g0) && mx.parameters().len() == 2);
    // 001 pytorch: nn.Linear(3, 1) made on the CPU, then moved: one upload per parameter.
    let mut pt = Sequential::new().add(kiln::nn::Linear::new(3, 1, &cpu())?);
    let mark = kiln::thread_transfer_stats();
    pt.to(&g0)?;
    let up = if g0.is_gpu() { 2 } else { 0 };
    assert_eq!(moved_since(&mark), (0, up, 0));
    assert_eq!(pt.forward(&x)?.device(), g0);
    assert_eq!(pt[0].parameter("weight")?.device(), g0);
    // tensorflow: a layer built in a device scope has its weights[0] and weights[1] there.
    let tf = {
        let _scope = kiln::default_device_scope(g0)?;
        kiln::nn::Linear::new(3, 1, &kiln::default_device())?
    };
    assert_eq!((tf.weight().device(), tf.bias().map(|b| b.device())), (g0, Some(g0)));
    assert_eq!(tf.forward(&x)?.device(), g0);
    Ok(())
}

/// 000 (tab jax) `net = nn.Sequential([nn.Dense(1)])`, `x = jax.random.normal(key1, (10,))`,
/// `params = net.init(key2, x)`, `net.apply(params, x)` and
/// `print(jax.tree_util.tree_map(lambda x: x.device(), params))`: a lazy layer's parameters
/// appear at the first input, on its device, and a 1-D input gives a 1-D output.
#[test]
fn jax_init_and_apply_on_a_dummy_input() -> Result<()> {
    kiln::manual_seed(0);
    let net = Sequential::new().add(LazyLinear::new(1));
    assert!(net.parameters().is_empty());
    for d in [cpu(), try_gpu(0)] {
        let net = Sequential::new().add(LazyLinear::new(1));
        let x = Tensor::randn(10, &d)?;
        let y = net.forward(&x)?;
        assert_eq!((y.device(), y.dims()), (d, &[1usize][..]));
        let devices: Vec<(String, Device)> = net.named_parameters().into_iter().map(|(n, p)| (n, p.device())).collect();
        assert_eq!(devices, vec![("0.weight".to_string(), d), ("0.bias".to_string(), d)]);
        assert_eq!(net[0].parameter("weight")?.dims(), &[1, 10]);
    }
    Ok(())
}

/// 004 `net.initialize(ctx=mx.gpu())`, `net(y)` and `net[0].weight.data()`: the cell feeds y,
/// which lives on gpu(1), to a net on gpu(0); with one or two GPUs that is a mismatch naming
/// the input's device first.
#[test]
fn gluon_net_on_gpu0_fed_y_from_gpu1() -> Result<()> {
    let (g0, g1) = (try_gpu(0), try_gpu(1));
    let mut net = Sequential::new().add(LazyLinear::new(1));
    net.to(&g0)?;
    let y = Tensor::rand((2, 3), &g1)?;
    match net.forward(&y) {
        Ok(out) if g0 == g1 => assert_eq!(out.device(), g0),
        Err(e @ Error::DeviceMismatch { .. }) if g0 != g1 => {
            let Error::DeviceMismatch { lhs, rhs, .. } = &e else { unreachable!() };
            assert_eq!((*lhs, *rhs), (g1, g0), "{e}");
            let msg = e.to_string();
            assert!(msg.contains(&format!("input is on {g1}")) && msg.contains(&g0.to_string()), "{msg}");
            assert!(net.has_lazy_parameters());
            net.forward(&y.to(&g0)?)?;
        }
        other => panic!("net on {g0} fed y on {g1}: {other:?}"),
    }
    // net[0].weight.data(): printed with its device, one read on a GPU.
    let w = net[0].parameter("weight")?;
    let mark = kiln::thread_transfer_stats();
    let text = format!("{w}");
    assert!(text.ends_with(&format!("{}, requires_grad=true)", suffix(g0))), "{text}");
    assert_eq!(moved_since(&mark), one_move(g0, cpu()));
    Ok(())
}

/// A d2l.Module holding scratch parameters and a list of sub-modules.
struct ScratchTree {
    top: Scratch,
    children: Vec<Scratch>,
}

impl Module for ScratchTree {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let mut y = self.top.forward(x)?;
        for c in &self.children {
            y = c.forward(&y)?;
        }
        Ok(y)
    }
    fn named_parameters(&self) -> Vec<(String, Tensor)> {
        let mut out = self.top.named_parameters();
        for (i, c) in self.children.iter().enumerate() {
            out.extend(c.named_parameters().into_iter().map(|(n, p)| (format!("{i}.{n}"), p)));
        }
        out
    }
    fn visit_parameters_mut(&mut self, f: &mut ParamVisitor<'_>) -> Result<()> {
        self.top.visit_parameters_mut(f)?;
        for c in &mut self.children {
            c.visit_parameters_mut(f)?;
        }
        Ok(())
    }
}

fn scratch(n: usize) -> Result<Scratch> {
    Ok(Scratch { w: Tensor::randn((n, n), &cpu())?.requires_grad_(), b: Tensor::zeros(n, DType::F32, &cpu())?.requires_grad_() })
}

/// 000 (tab mxnet) `def set_scratch_params_device(self, device):`: every ndarray attribute, of
/// this module, of sub-modules and of lists of them, moved with `as_in_ctx` and given a
/// gradient (`attach_grad`), so that training on the device updates them.
#[test]
fn set_scratch_params_device_reaches_sub_modules_and_lists() -> Result<()> {
    let g0 = try_gpu(0);
    let mut m = ScratchTree { top: scratch(3)?, children: vec![scratch(3)?, scratch(3)?] };
    m.to(&g0)?;
    let params = m.parameters();
    assert_eq!(params.len(), 6);
    assert!(params.iter().all(|p| p.device() == g0 && p.requires_grad()));
    // attach_grad: a backward on the device gives every parameter a gradient there.
    m.forward(&Tensor::ones((2, 3), DType::F32, &g0)?)?.sum_all()?.backward()?;
    for p in m.parameters() {
        let g = p.grad().expect("every scratch parameter gets a gradient");
        assert_eq!(g.device(), g0);
    }
    Ok(())
}

/// 000 (tabs mxnet, pytorch, jax) `def __init__(self, max_epochs, num_gpus=0, gradient_clip_val=0):`,
/// `def prepare_batch(self, batch):` and `def prepare_model(self, model):`; 002 the same three.
#[test]
fn trainer_init_prepare_batch_and_prepare_model() -> Result<()> {
    let n = num_gpus();
    for asked in 0..4 {
        let t = Trainer::builder().max_epochs(1).num_gpus(asked).build()?;
        assert_eq!(t.gpus(), (0..asked.min(n)).map(gpu).collect::<Vec<_>>(), "num_gpus={asked}");
        assert_eq!(t.device(), if asked.min(n) > 0 { gpu(0) } else { cpu() });
    }
    let t = Trainer::builder().max_epochs(1).num_gpus(1).build()?;
    let d = t.device();
    let batch = vec![Tensor::ones((4, 2), DType::F32, &cpu())?, Tensor::zeros((4, 1), DType::F32, &cpu())?];
    let mark = kiln::thread_transfer_stats();
    let moved = t.prepare_batch(batch.clone())?;
    assert_eq!(moved_since(&mark), (0, if d.is_gpu() { 2 } else { 0 }, 0));
    for (a, b) in moved.iter().zip(&batch) {
        assert_eq!((a.device(), a.same_storage(b)), (d, d == cpu()));
    }
    let mut model = kiln::nn::Linear::new(2, 1, &cpu())?;
    t.prepare_model(&mut model)?;
    assert_eq!(model.devices(), vec![d]);
    Ok(())
}

/// 000 Ringkasan (summary): "better to allocate memory for logging inside the GPU and only move
/// larger logs": the chapter's Trainer, fitted on `try_gpu()`, reads its losses back once per
/// epoch.
#[test]
fn trainer_reads_the_losses_once_per_epoch() -> Result<()> {
    kiln::manual_seed(0);
    let data = synthetic_regression(256, 64, 32)?;
    let mut model = Learner::new(kiln::nn::Linear::new(2, 1, &cpu())?, Loss::Mse, OptimizerConfig::sgd(0.03));
    let mut trainer = Trainer::builder().max_epochs(3).num_gpus(1).progress(Progress::Off).build()?;
    let mark = kiln::thread_transfer_stats();
    trainer.fit(&mut model, &data)?;
    let (d2h, _, d2d) = moved_since(&mark);
    assert_eq!((d2h, d2d), (if try_gpu(0).is_gpu() { 3 } else { 0 }, 0));
    Ok(())
}

/// 003 In[14] `with jax.default_device(cpu()):` / `x = jnp.linspace(0, 100, num=10_000_000 + rand)` /
/// `y = x ** 0.5 - jnp.log(jnp.abs(x));`, and In[21] `with tf.device('cpu'):` /
/// `x = tnp.linspace(0, 10, num=100)` / `x.device`.
#[test]
fn jax_linspace_in_a_cpu_scope() -> Result<()> {
    let _scope = kiln::default_device_scope(cpu())?;
    let n = 10_001;
    let x = Tensor::linspace(0.0, 100.0, n, &kiln::default_device())?;
    let y = x.powf(0.5)?.sub(&x.abs()?.log()?)?;
    y.block_until_ready()?;
    assert_eq!(y.device(), cpu());
    let v = y.to_vec::<f32>()?;
    assert_eq!(v[0], f32::INFINITY, "0 ** 0.5 - log|0| = +inf");
    for i in [1, 100, 5000, n - 1] {
        let xi = 100.0 * i as f64 / (n - 1) as f64;
        let want = xi.sqrt() - xi.ln();
        assert!((v[i] as f64 - want).abs() <= 1e-5 * want.abs().max(1.0), "y[{i}] = {} vs {want}", v[i]);
    }
    let t = Tensor::linspace(0.0, 10.0, 100, &kiln::default_device())?;
    assert_eq!((t.device(), t.dims()), (cpu(), &[100usize][..]));
    Ok(())
}

/// 003 In[16] `x = jax.random.uniform(...)  # on GPU/TPU` / `xcpu = jax.device_put(x, cpu())` /
/// `ycpu = xcpu ** 2 - 0.5` / `yacc = jax.device_put(ycpu, try_tpu_gpu())` / `zacc = yacc ** 3 - 0.2` /
/// `zacc.block_until_ready()`, against In[17] (all on the CPU) and In[18] (all on the
/// accelerator): the same values; the round trip is one transfer each way.
#[test]
fn jax_round_trip_through_the_cpu_and_block_until_ready() -> Result<()> {
    let acc = try_gpu(0);
    let n = 100_000;
    let pipeline = |x: &Tensor| -> Result<Tensor> { x.sqr()?.sub_scalar(0.5)?.powi(3)?.sub_scalar(0.2) };
    // In[16]
    kiln::manual_seed(7);
    let x = Tensor::rand(n, &acc)?;
    let mark = kiln::thread_transfer_stats();
    let xcpu = x.to(&cpu())?;
    let ycpu = xcpu.sqr()?.sub_scalar(0.5)?;
    let yacc = ycpu.to(&acc)?;
    let zacc = yacc.powi(3)?.sub_scalar(0.2)?;
    zacc.block_until_ready()?;
    let expected = if acc.is_gpu() { (1, 1, 0) } else { (0, 0, 0) };
    assert_eq!(moved_since(&mark), expected);
    assert_eq!((ycpu.device(), zacc.device()), (cpu(), acc));
    // In[17] and In[18]
    let mut results = Vec::new();
    for d in [cpu(), acc] {
        let _scope = kiln::default_device_scope(d)?;
        kiln::manual_seed(7);
        let z = pipeline(&Tensor::rand(n, &kiln::default_device())?)?;
        z.block_until_ready()?;
        assert_eq!(z.device(), d);
        results.push(z.to_vec::<f32>()?);
    }
    let got = zacc.to_vec::<f32>()?;
    for r in &results {
        let worst = got.iter().zip(r).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        assert!(worst <= 1e-6, "the three pipelines differ by {worst}");
    }
    Ok(())
}

/// 003 "Lazy execution": `y = jax.something(x)` returns a placeholder at once, and
/// `block_until_ready()` (or reading the value) waits for it. On a simulated GPU whose queue
/// is held, the operations return although none can run yet; the values arrive once it runs.
#[test]
fn lazy_execution_returns_before_the_work_runs() -> Result<()> {
    let acc = try_gpu(0);
    // On a CUDA device the first use of a kernel loads it, which waits for
    // the device to be idle: the cell's ops run once before the hold.
    Tensor::linspace(0.0, 1.0, 4, &acc)?.powf(0.5)?.mul_scalar(2.0)?.block_until_ready()?;
    let Some(hold) = kiln::hold_queue(&acc)? else {
        // The CPU just computes.
        let y = Tensor::ones(4, DType::F32, &acc)?.mul_scalar(3.0)?;
        y.block_until_ready()?;
        assert_eq!(y.to_vec::<f32>()?, vec![3.0; 4]);
        return Ok(());
    };
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let x = Tensor::linspace(0.0, 100.0, 1000, &acc).unwrap();
        let y = x.powf(0.5).unwrap().mul_scalar(2.0).unwrap();
        tx.send(y).unwrap();
    });
    let y = rx.recv_timeout(std::time::Duration::from_secs(60)).expect("operations on a held queue must return at once");
    drop(hold);
    y.block_until_ready()?;
    let v = y.to_vec::<f32>()?;
    assert_eq!((v[0], v[999]), (0.0, 20.0));
    Ok(())
}
