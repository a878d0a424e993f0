//! `index_add` latency beside a thread doing 1500² matmuls (issue 16: with
//! read epochs every `index_add` waited for the other thread's kernel, 17–53
//! ms a call). Prints the median and worst of 200 calls, and the same alone.
//!
//! ```sh
//! cargo run --release -p kiln --example bench_index_add
//! ```

use kiln::{cpu, DType, Tensor};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

fn calls(n: usize) -> kiln::Result<Vec<f64>> {
    let dst = Tensor::zeros((64, 32), DType::F32, &cpu())?;
    let src = Tensor::ones((8, 32), DType::F32, &cpu())?;
    let ids = Tensor::new(&[0i64, 3, 5, 7, 11, 13, 17, 63], &cpu())?;
    let mut ms = Vec::with_capacity(n);
    for _ in 0..n {
        let t = Instant::now();
        let y = dst.index_add(&ids, &src, 0)?;
        ms.push(t.elapsed().as_secs_f64() * 1e3);
        assert_eq!(y.dims(), &[64, 32]);
    }
    ms.sort_by(f64::total_cmp);
    Ok(ms)
}

fn main() -> kiln::Result<()> {
    let alone = calls(200)?;
    let stop = Arc::new(AtomicBool::new(false));
    let busy = {
        let stop = stop.clone();
        std::thread::spawn(move || -> kiln::Result<usize> {
            let a = Tensor::rand((1500, 1500), &cpu())?;
            let mut n = 0;
            while !stop.load(Ordering::Relaxed) {
                a.matmul(&a)?.block_until_ready()?;
                n += 1;
            }
            Ok(n)
        })
    };
    // Let the matmuls start.
    std::thread::sleep(std::time::Duration::from_millis(200));
    let beside = calls(200)?;
    stop.store(true, Ordering::Relaxed);
    let matmuls = busy.join().expect("matmul thread")?;
    let show =
        |what: &str, v: &[f64]| println!("{what}: median {:.4} ms, worst {:.4} ms over {} calls", v[v.len() / 2], v[v.len() - 1], v.len());
    show("index_add alone", &alone);
    show(&format!("index_add beside 1500x1500 matmuls ({matmuls} ran)"), &beside);
    Ok(())
}
