//! `kiln devices`: every device kiln can use, with its memory, like `nvidia-smi`.

use crate::util::{table, Align, Result};
use kiln::{human_bytes, Device, DeviceInfo, DeviceKind};
use serde_json::{json, Value};

/// The free memory to show: the driver's figure, or the OS's for the CPU.
fn free_memory(info: &DeviceInfo) -> Option<usize> {
    match info.kind {
        DeviceKind::Cpu => info.memory_free,
        _ => info.memory_free,
    }
}

fn index(device: Device) -> Option<usize> {
    match device {
        Device::Cpu => None,
        Device::Gpu(i) => Some(i),
    }
}

/// One device as a JSON object.
pub fn to_json(info: &DeviceInfo) -> Value {
    let details: serde_json::Map<String, Value> = info.details.iter().map(|(k, v)| (k.clone(), Value::String(v.clone()))).collect();
    json!({
        "device": info.device.to_string(),
        "index": index(info.device),
        "name": info.name,
        "kind": info.kind.to_string(),
        "memory_total": info.memory_total,
        "memory_in_use": info.memory_in_use,
        "memory_free": free_memory(info),
        "details": details,
    })
}

/// The devices as a table.
pub fn render(list: &[DeviceInfo]) -> String {
    let opt = |b: Option<usize>| b.map(human_bytes).unwrap_or_else(|| "-".into());
    let rows: Vec<Vec<String>> = list
        .iter()
        .map(|d| {
            let details = d.details.iter().map(|(k, v)| format!("{k} {v}")).collect::<Vec<_>>().join(", ");
            vec![
                index(d.device).map(|i| i.to_string()).unwrap_or_else(|| "-".into()),
                d.device.to_string(),
                d.kind.to_string(),
                d.name.clone(),
                opt(d.memory_total),
                human_bytes(d.memory_in_use),
                opt(free_memory(d)),
                if details.is_empty() { "-".into() } else { details },
            ]
        })
        .collect();
    table(
        &[
            ("IDX", Align::Right),
            ("DEVICE", Align::Left),
            ("KIND", Align::Left),
            ("NAME", Align::Left),
            ("TOTAL", Align::Right),
            ("KILN IN USE", Align::Right),
            ("FREE", Align::Right),
            ("DETAILS", Align::Left),
        ],
        &rows,
    )
}

/// Runs `kiln devices`.
pub fn run(json: bool) -> Result<()> {
    let list = kiln::devices();
    if json {
        let all: Vec<Value> = list.iter().map(to_json).collect();
        println!("{}", Value::Array(all));
        return Ok(());
    }
    println!("{}", render(&list));
    let gpus = kiln::num_gpus();
    if gpus == 0 {
        if let Some(why) = kiln::why_not_gpu(0) {
            println!("No GPU: {why}.");
        }
        println!("Try `kiln --sim-gpus 2 devices` (or KILN_SIM_GPUS=2) to add two simulated GPUs.");
    } else {
        println!("{gpus} GPU(s).");
    }
    println!("Across processes: {}.", kiln::dist::describe());
    Ok(())
}
