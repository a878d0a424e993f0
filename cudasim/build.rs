//! Compiles kiln's `kernels.cu` for the host with the shim header, and a
//! table of every `extern "C" __global__` kernel in it (names found by
//! preprocessing the source, argument lists deduced by the C++ compiler from
//! each kernel's signature).

use std::path::PathBuf;
use std::process::Command;

fn main() {
    let manifest = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").expect("CARGO_MANIFEST_DIR"));
    let kernels = manifest.join("../kiln/src/backend/cuda/kernels.cu");
    let kernels = kernels.canonicalize().unwrap_or(kernels);
    let shim = manifest.join("shim/cuda_shim.h");
    let launch = manifest.join("shim/launch.hpp");
    for p in [&kernels, &shim, &launch] {
        println!("cargo:rerun-if-changed={}", p.display());
    }
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "g++".to_string());
    let pre = Command::new(&cxx)
        .args(["-E", "-P", "-x", "c++", "-std=c++17", "-D__global__=KILN_SIM_GLOBAL", "-include"])
        .arg(&shim)
        .arg(&kernels)
        .output()
        .unwrap_or_else(|e| panic!("cudasim: cannot run `{cxx}` to preprocess kernels.cu ({e}); install g++ (apt-get install g++)"));
    if !pre.status.success() {
        panic!("cudasim: `{cxx} -E` failed on {}:\n{}", kernels.display(), String::from_utf8_lossy(&pre.stderr));
    }
    let text = String::from_utf8_lossy(&pre.stdout);
    let mut names = Vec::new();
    let marker = "KILN_SIM_GLOBAL void ";
    let mut rest = &text[..];
    while let Some(at) = rest.find(marker) {
        rest = &rest[at + marker.len()..];
        let name: String = rest.trim_start().chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_').collect();
        if !name.is_empty() && !names.contains(&name) {
            names.push(name);
        }
    }
    if names.is_empty() {
        panic!("cudasim: found no __global__ kernel in {}", kernels.display());
    }
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("OUT_DIR"));
    let mut gen = String::new();
    gen.push_str(&format!("#include \"{}\"\n#include \"{}\"\n#include \"{}\"\n", shim.display(), kernels.display(), launch.display()));
    gen.push_str("static const KilnSimKernel* kiln_sim_table() {\n    static const KilnSimKernel t[] = {\n");
    for n in &names {
        gen.push_str(&format!("        kiln_sim_entry(\"{n}\", &{n}),\n"));
    }
    gen.push_str("    };\n    return t;\n}\n");
    gen.push_str(&format!("extern \"C\" int kiln_sim_kernel_count(void) {{ return {}; }}\n", names.len()));
    gen.push_str("extern \"C\" const KilnSimKernel* kiln_sim_kernel(int i) { return &kiln_sim_table()[i]; }\n");
    gen.push_str(
        "extern \"C\" void kiln_sim_run_thread(int i, void* const* params) {\n    const KilnSimKernel& k = kiln_sim_table()[i];\n    k.invoke(k.fn, params);\n}\n",
    );
    let gen_path = out.join("kiln_sim_kernels.cpp");
    std::fs::write(&gen_path, gen).expect("write the generated kernel table");
    cc::Build::new()
        .cpp(true)
        .compiler(&cxx)
        .file(&gen_path)
        .flag("-std=c++17")
        // kernels.cu is compiled with --fmad=false: no contraction here either.
        .flag("-ffp-contract=off")
        .flag("-fno-exceptions")
        .flag("-fwrapv")
        .flag("-fno-strict-aliasing")
        .flag("-w")
        .opt_level(2)
        .compile("kiln_cudasim_kernels");
    println!("cargo:rustc-env=KILN_CUDASIM_KERNELS={}", names.len());
}
