//! Kernel modules: each op family and each op with kernels of its own is one
//! NVRTC module, compiled on first use for the device's architecture from
//! the shared prelude (`prelude.cu`, after the generated `struct Lay`) and
//! the module's own source, and cached per device; kernels are looked up by
//! name.

use super::{ck, nvrtc, CudaBackend, Raw};
use crate::base::error::Result;
use crate::kernel::cuda::{CudaModule, Lay};
use cudarc::driver::sys as cu;
use std::ffi::c_void;

/// The shared prelude of every module.
const PRELUDE: &str = include_str!("prelude.cu");

/// A module's full source: the typedefs and helpers of the prelude, the
/// generated `Lay`, then the module's own source.
pub(crate) fn full_source(module: &CudaModule) -> String {
    let prelude = PRELUDE.replacen("// @LAY@", &Lay::c_decl(), 1);
    format!("{prelude}\n// ---- module `{}` ----\n{}", module.name, module.source())
}

impl CudaBackend {
    /// Kernel `name` of `module`, compiling the module on first use. A
    /// kernel the module does not define is an error naming both.
    pub(super) fn function(&self, module: &'static CudaModule, name: &str) -> Result<cu::CUfunction> {
        let key = (module.name, name.to_string());
        if let Some(f) = self.functions.lock().unwrap_or_else(|e| e.into_inner()).get(&key) {
            return Ok(f.0);
        }
        let loaded = {
            let mut modules = self.modules.lock().unwrap_or_else(|e| e.into_inner());
            if !modules.contains_key(module.name) {
                let built = self.build_module(module.name, &full_source(module));
                modules.insert(module.name, built);
            }
            match &modules[module.name] {
                Ok(m) => m.0,
                Err(e) => return Err(self.err(e.clone())),
            }
        };
        let cname = std::ffi::CString::new(name).map_err(|_| self.err(format!("bad kernel name {name:?}")))?;
        let mut f: cu::CUfunction = std::ptr::null_mut();
        // SAFETY: the module is loaded and stays loaded; out-pointer to a local.
        ck(unsafe { cu::cuModuleGetFunction(&mut f, loaded, cname.as_ptr()) }, &format!("module `{}` has no kernel `{name}`", module.name))
            .map_err(|e| self.err(e))?;
        self.functions.lock().unwrap_or_else(|e| e.into_inner()).insert(key, Raw(f));
        Ok(f)
    }

    /// Compiles one module for this device and loads it: machine code
    /// when NVRTC knows the device's `sm_XY`, else PTX for the newest
    /// architecture it knows that the device can run (the driver JITs it).
    fn build_module(&self, family: &'static str, source: &str) -> std::result::Result<Raw<cu::CUmodule>, String> {
        let sm = self.cc.0 * 10 + self.cc.1;
        let archs = nvrtc::supported_archs()?;
        let base: Vec<String> = nvrtc::COMMON_OPTIONS.iter().map(|s| s.to_string()).collect();
        let with = |arch: String| -> Vec<String> {
            let mut o = base.clone();
            o.push(format!("--gpu-architecture={arch}"));
            o
        };
        let mut errors = Vec::new();
        // Machine code first when NVRTC knows the exact architecture.
        if archs.contains(&sm) {
            match nvrtc::compile_cached(family, source, &with(format!("sm_{sm}")), true).and_then(|img| load_module(family, img.bytes())) {
                Ok(m) => return Ok(m),
                Err(e) => errors.push(e),
            }
        }
        // Else (or if the driver refused it) PTX for the newest architecture
        // NVRTC knows that the device can run; the driver JIT-compiles it.
        match archs.iter().copied().filter(|&a| a <= sm).max() {
            Some(best) => {
                let image = nvrtc::compile_cached(family, source, &with(format!("compute_{best}")), false);
                match image.and_then(|img| {
                    let mut bytes = img.bytes().to_vec();
                    if bytes.last() != Some(&0) {
                        bytes.push(0);
                    }
                    load_module(family, &bytes)
                }) {
                    Ok(m) => return Ok(m),
                    Err(e) => errors.push(e),
                }
            }
            None => {
                errors.push(format!("this NVRTC knows sm {archs:?}, none of which compute capability {}.{} can run", self.cc.0, self.cc.1))
            }
        }
        let nv = nvrtc::version().map(|(a, b)| format!("{a}.{b}")).unwrap_or_default();
        Err(format!(
            "{}; NVRTC is {nv} and the driver supports CUDA {}.{}: an NVRTC newer than the driver produces code the driver \
             cannot load, so put an NVRTC no newer than the driver first on LD_LIBRARY_PATH (or set KILN_NVRTC_LIB)",
            errors.join("; "),
            self.driver_version / 1000,
            (self.driver_version % 1000) / 10
        ))
    }
}

/// Loads a cubin or NUL-terminated PTX image into the bound context.
fn load_module(family: &str, image: &[u8]) -> std::result::Result<Raw<cu::CUmodule>, String> {
    let mut module: cu::CUmodule = std::ptr::null_mut();
    // SAFETY: a complete image that outlives the call; the context is bound.
    ck(unsafe { cu::cuModuleLoadData(&mut module, image.as_ptr() as *const c_void) }, &format!("loading kernel family `{family}`"))?;
    Ok(Raw(module))
}

/// Kernel sources and NVRTC access for the compile check (`tests/cuda.rs`
/// and `.ci/cuda-check.sh`), so that it compiles exactly what the backend runs.
pub mod check {
    /// The full CUDA C++ source of `module`, as the backend compiles it.
    pub(crate) fn module_source(module: &crate::kernel::cuda::CudaModule) -> String {
        super::full_source(module)
    }

    /// The options the backend passes to NVRTC besides the architecture.
    pub fn nvrtc_options() -> Vec<String> {
        super::super::nvrtc::COMMON_OPTIONS.iter().map(|s| s.to_string()).collect()
    }

    /// Whether a CUDA driver library (libcuda.so) can be loaded here.
    pub fn driver_present() -> bool {
        // SAFETY: only tries to dlopen candidate library names.
        std::panic::catch_unwind(|| unsafe { cudarc::driver::sys::is_culib_present() }).unwrap_or(false)
    }

    /// NVRTC's version, or why no NVRTC library could be loaded.
    pub fn nvrtc_version() -> Result<(i32, i32), String> {
        super::super::nvrtc::version()
    }

    /// Compiles one source to PTX for `arch` (e.g. `compute_90`), with the
    /// backend's options; returns the PTX text or NVRTC's log.
    pub fn compile_ptx(family: &str, source: &str, arch: &str) -> Result<String, String> {
        let mut options = nvrtc_options();
        options.push(format!("--gpu-architecture={arch}"));
        match super::super::nvrtc::compile(family, source, &options, false)? {
            super::super::nvrtc::Image::Ptx(b) | super::super::nvrtc::Image::Cubin(b) => {
                Ok(String::from_utf8_lossy(&b).trim_end_matches('\0').to_string())
            }
        }
    }
}
