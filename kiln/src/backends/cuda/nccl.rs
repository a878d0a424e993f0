//! Collectives across CUDA devices through NCCL, found at run time like the
//! driver and NVRTC, so one binary runs with and without it.
//!
//! kiln opens NCCL itself: `KILN_NCCL_LIB` when set (and no other library
//! when that fails), else `libnccl.so.2` (the name NCCL's packages install:
//! pip's `nvidia-nccl-cu12`, apt's `libnccl2`), else cudarc's candidate
//! names. cudarc's `nccl` feature gives NCCL's types; its own loader is not
//! used because its candidates lack `libnccl.so.2`. Without NCCL, or with
//! `KILN_DISABLE_NCCL=1`, CUDA devices have no communicator and the front
//! end (`comm/`) runs collectives through peer copies and kernels; `kiln
//! devices` says which, and why.
//!
//! How a collective runs:
//! - **Communicators**: one per ordered list of devices (rank i is the i-th
//!   part's device), made with `ncclCommInitAll` on first use and kept for
//!   the life of the process. All CUDA devices in order is the usual list; a
//!   subset, or another order, gets a communicator of its own (the ranks of
//!   an all-gather or a reduce-scatter follow the order).
//! - **Streams**: each device gets an NCCL stream beside its compute stream,
//!   so communication overlaps compute. Before a collective each NCCL stream
//!   waits (on the device, through an event) for the work queued so far on
//!   its compute stream, which produced the inputs; [`Communicator::join`]
//!   makes each compute stream wait the same way for its NCCL stream.
//! - **Calls**: every rank's call between one `ncclGroupStart` and
//!   `ncclGroupEnd` (one thread drives every device), issued under one lock,
//!   so that each communicator sees its collectives in the same order on
//!   every rank, and concurrent callers cannot interleave a group.
//! - **Memory**: the storages a collective uses are kept alive until the next
//!   join of their device. kiln's caching allocator reuses a freed block in
//!   compute-stream order, and the compute stream is ordered after the NCCL
//!   stream only by a join.
//! - **Max and min of floats** are not offered ([`Communicator::reduces`]):
//!   NCCL's `fmax`/`fmin` let a NaN lose where kiln lets it win, so those
//!   take the peer-copy path and give kiln's answer on every device kind.
//! - **Errors**: whatever can fail before the group (communicator, streams,
//!   events, pointers) is done first, so a refusal there queues nothing; a
//!   call NCCL refuses is an [`Error::Backend`] naming the collective, the
//!   device, NCCL's message and the way out (`KILN_DISABLE_NCCL=1`).

use super::nvrtc::{dl, fn_ptr, open_library};
use super::{ck, dev_ptr, CudaBackend, Raw};
use crate::base::dtype::DType;
use crate::base::error::{Error, Result};
use crate::kernel::comm::{Combine, Communicator, Part, ProcessComms, RankCall, RankComm};
use crate::kernel::storage::Storage;
use crate::kernel::Backend;
use cudarc::driver::sys as cu;
use cudarc::nccl::sys as nc;
use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_uint, c_void, CStr, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

/// An `ncclResult_t` as a plain number: a newer NCCL may return a code
/// cudarc's enum does not list.
type Res = c_uint;
type Comm = nc::ncclComm_t;
type NcclStream = nc::cudaStream_t;
const OK: Res = nc::ncclResult_t::ncclSuccess as Res;
/// `ncclInProgress`: a call on a non-blocking communicator is still going.
const IN_PROGRESS: Res = 7;

/// The oldest NCCL kiln uses: 2.10 added bfloat16.
const MIN_VERSION: (i32, i32, i32) = (2, 10, 0);

/// The NCCL functions kiln calls, looked up in kiln's own handle.
struct Api {
    get_version: unsafe extern "C" fn(*mut c_int) -> Res,
    comm_init_all: unsafe extern "C" fn(*mut Comm, c_int, *const c_int) -> Res,
    group_start: unsafe extern "C" fn() -> Res,
    group_end: unsafe extern "C" fn() -> Res,
    all_reduce: unsafe extern "C" fn(*const c_void, *mut c_void, usize, nc::ncclDataType_t, nc::ncclRedOp_t, Comm, NcclStream) -> Res,
    broadcast: unsafe extern "C" fn(*const c_void, *mut c_void, usize, nc::ncclDataType_t, c_int, Comm, NcclStream) -> Res,
    reduce: unsafe extern "C" fn(*const c_void, *mut c_void, usize, nc::ncclDataType_t, nc::ncclRedOp_t, c_int, Comm, NcclStream) -> Res,
    all_gather: unsafe extern "C" fn(*const c_void, *mut c_void, usize, nc::ncclDataType_t, Comm, NcclStream) -> Res,
    reduce_scatter: unsafe extern "C" fn(*const c_void, *mut c_void, usize, nc::ncclDataType_t, nc::ncclRedOp_t, Comm, NcclStream) -> Res,
    error_string: unsafe extern "C" fn(Res) -> *const c_char,
    /// `ncclGetLastError` (NCCL 2.13 and later).
    last_error: Option<unsafe extern "C" fn(Comm) -> *const c_char>,
    /// Communicators across processes, where the library has them.
    ranks: Option<RankApi>,
}

/// `ncclUniqueId`: 128 opaque bytes, passed by value.
#[repr(C)]
#[derive(Clone, Copy)]
struct UniqueId {
    internal: [u8; 128],
}

/// `ncclConfig_t` as NCCL 2.14 introduced it, with the field after
/// `blocking` that 2.17 added (left undefined). NCCL reads a config by its
/// own `size` and `version` and keeps its defaults for the fields a config
/// does not have, so later libraries take this one.
#[repr(C)]
struct Config {
    size: usize,
    magic: c_uint,
    version: c_uint,
    blocking: c_int,
    cga_cluster_size: c_int,
}

impl Config {
    /// A config of a non-blocking communicator.
    fn non_blocking() -> Config {
        Config {
            size: std::mem::size_of::<Config>(),
            magic: 0xcafe_beef,
            // NCCL_VERSION(2, 14, 0): the fields past `blocking` are then NCCL's defaults.
            version: 21400,
            blocking: 0,
            // NCCL_CONFIG_UNDEF_INT
            cga_cluster_size: c_int::MIN,
        }
    }
}

/// The NCCL functions of communicators across processes.
struct RankApi {
    get_unique_id: unsafe extern "C" fn(*mut UniqueId) -> Res,
    comm_init_rank: unsafe extern "C" fn(*mut Comm, c_int, UniqueId, c_int) -> Res,
    /// `ncclCommInitRankConfig` (NCCL 2.14 and later): a communicator made
    /// without blocking, so that kiln's timeout bounds the wait for the
    /// other ranks.
    comm_init_rank_config: Option<unsafe extern "C" fn(*mut Comm, c_int, UniqueId, c_int, *mut Config) -> Res>,
    comm_get_async_error: unsafe extern "C" fn(Comm, *mut Res) -> Res,
    comm_abort: unsafe extern "C" fn(Comm) -> Res,
}

impl Api {
    /// Looks the functions up in `handle` (from dlopen of `lib`).
    ///
    /// # Safety
    /// `handle` must be a live dlopen handle of an NCCL library.
    unsafe fn from_handle(handle: *mut c_void, lib: &str) -> std::result::Result<Api, String> {
        unsafe {
            let sym = |name: &str| -> Option<*mut c_void> {
                let c = CString::new(name).ok()?;
                let p = dl::sym(handle, &c);
                (!p.is_null()).then_some(p)
            };
            let need = |name: &str| sym(name).ok_or_else(|| format!("the NCCL library {lib} lacks {name} (too old?)"));
            // SAFETY (every fn_ptr): each symbol is the NCCL function of that
            // name, whose C signature the pointer type spells (enums are C ints).
            Ok(Api {
                get_version: fn_ptr(need("ncclGetVersion")?),
                comm_init_all: fn_ptr(need("ncclCommInitAll")?),
                group_start: fn_ptr(need("ncclGroupStart")?),
                group_end: fn_ptr(need("ncclGroupEnd")?),
                all_reduce: fn_ptr(need("ncclAllReduce")?),
                broadcast: fn_ptr(need("ncclBroadcast")?),
                reduce: fn_ptr(need("ncclReduce")?),
                all_gather: fn_ptr(need("ncclAllGather")?),
                reduce_scatter: fn_ptr(need("ncclReduceScatter")?),
                error_string: fn_ptr(need("ncclGetErrorString")?),
                last_error: sym("ncclGetLastError").map(|p| fn_ptr(p)),
                ranks: match (sym("ncclGetUniqueId"), sym("ncclCommInitRank"), sym("ncclCommGetAsyncError"), sym("ncclCommAbort")) {
                    (Some(a), Some(b), Some(c), Some(d)) => Some(RankApi {
                        get_unique_id: fn_ptr(a),
                        comm_init_rank: fn_ptr(b),
                        comm_init_rank_config: sym("ncclCommInitRankConfig").map(|p| fn_ptr(p)),
                        comm_get_async_error: fn_ptr(c),
                        comm_abort: fn_ptr(d),
                    }),
                    _ => None,
                },
            })
        }
    }

    /// NCCL's text for a result code, and its last error for `comm`.
    fn describe(&self, r: Res, comm: Comm) -> String {
        // SAFETY: both return null or a C string owned by NCCL, copied at once.
        unsafe {
            let text = (self.error_string)(r);
            let mut s = if text.is_null() { format!("error {r}") } else { CStr::from_ptr(text).to_string_lossy().into_owned() };
            if let Some(last) = self.last_error {
                let detail = last(comm);
                if !detail.is_null() {
                    let detail = CStr::from_ptr(detail).to_string_lossy();
                    if !detail.trim().is_empty() {
                        s.push_str(&format!(": {}", detail.trim()));
                    }
                }
            }
            s
        }
    }
}

/// How a missing NCCL is described.
const MISSING: &str = "libnccl.so.2 not found; `pip install nvidia-nccl-cu12` and add its lib folder \
(site-packages/nvidia/nccl/lib) to LD_LIBRARY_PATH, or set KILN_NCCL_LIB to the library's path";

/// Opens NCCL: exactly `KILN_NCCL_LIB` when set, else the first name the
/// loader finds. The handle is kept for the life of the process.
fn open() -> std::result::Result<(Api, String), String> {
    let mut names = vec!["libnccl.so.2".to_string()];
    names.extend(cudarc::get_lib_name_candidates("nccl").into_iter().filter(|n| n != "libnccl.so.2"));
    let opened = open_library("KILN_NCCL_LIB", "NCCL", names, false)?.ok_or_else(|| MISSING.to_string())?;
    // SAFETY: a live handle of the library named as NCCL (by the user, or by
    // its file name).
    opened.load(|handle, name| unsafe { Api::from_handle(handle, name) })
}

/// NCCL's version code as (major, minor, patch): 22105 for 2.21.5 (2.9 and
/// later), 2708 for 2.7.8 (before).
fn split_version(code: c_int) -> (i32, i32, i32) {
    if code >= 10000 {
        (code / 10000, (code % 10000) / 100, code % 100)
    } else {
        (code / 1000, (code % 1000) / 100, code % 100)
    }
}

fn load() -> std::result::Result<Nccl, String> {
    if crate::base::env::env_flag("KILN_DISABLE_NCCL").unwrap_or(false) {
        return Err("NCCL disabled by KILN_DISABLE_NCCL=1".into());
    }
    let (api, lib) = open()?;
    let mut code: c_int = 0;
    // SAFETY: out-pointer to a local.
    let r = unsafe { (api.get_version)(&mut code) };
    if r != OK {
        return Err(format!("{lib}: ncclGetVersion failed: {}", api.describe(r, std::ptr::null_mut())));
    }
    let version = split_version(code);
    if version < MIN_VERSION {
        return Err(format!(
            "{lib} is NCCL {}.{}.{}, older than {}.{} (the first with bfloat16), which kiln needs; upgrade it (`pip install -U nvidia-nccl-cu12`)",
            version.0, version.1, version.2, MIN_VERSION.0, MIN_VERSION.1
        ));
    }
    Ok(Nccl { api, version, state: Mutex::new(State::default()) })
}

/// The loaded NCCL, or why there is none (loaded on first ask). Never panics.
pub(super) fn get() -> std::result::Result<&'static Nccl, &'static str> {
    static NCCL: OnceLock<std::result::Result<Nccl, String>> = OnceLock::new();
    NCCL.get_or_init(|| catch_unwind(load).unwrap_or_else(|_| Err("loading NCCL panicked".into()))).as_ref().map_err(|e| e.as_str())
}

/// NCCL over the CUDA devices of this process (every CUDA device returns it).
pub(crate) struct Nccl {
    api: Api,
    version: (i32, i32, i32),
    state: Mutex<State>,
}

/// What collectives share, behind one lock that is also held while a group
/// is issued.
#[derive(Default)]
struct State {
    /// Communicators by ordered list of device ordinals (rank order).
    comms: HashMap<Vec<usize>, Vec<Raw<Comm>>>,
    /// Each device's NCCL stream, by ordinal.
    streams: HashMap<usize, Raw<cu::CUstream>>,
    /// The storages of the collectives queued on a device since its last
    /// join, by ordinal.
    in_use: HashMap<usize, Vec<Arc<Storage>>>,
}

/// A part's device as a CUDA backend.
fn cuda_of(backend: &'static dyn Backend) -> Result<&'static CudaBackend> {
    backend.as_any().downcast_ref::<CudaBackend>().ok_or_else(|| Error::Backend {
        device: backend.device(),
        msg: "NCCL was given a device of another backend (a kiln bug: please report it)".into(),
    })
}

/// NCCL's name for a kiln dtype.
fn datatype(dtype: DType) -> nc::ncclDataType_t {
    use nc::ncclDataType_t as T;
    match dtype {
        DType::F32 => T::ncclFloat32,
        DType::F64 => T::ncclFloat64,
        DType::F16 => T::ncclFloat16,
        DType::BF16 => T::ncclBfloat16,
        DType::I64 => T::ncclInt64,
        DType::I32 => T::ncclInt32,
        DType::U8 => T::ncclUint8,
    }
}

fn red_op(op: Combine) -> nc::ncclRedOp_t {
    match op {
        Combine::Sum => nc::ncclRedOp_t::ncclSum,
        Combine::Max => nc::ncclRedOp_t::ncclMax,
        Combine::Min => nc::ncclRedOp_t::ncclMin,
    }
}

/// Makes `waiter` wait, on the device and without blocking the host, for
/// the work queued so far on `signaller` (two streams of `dev`).
fn order_after(dev: &CudaBackend, waiter: cu::CUstream, signaller: cu::CUstream) -> Result<()> {
    dev.bind()?;
    let mut ev: cu::CUevent = std::ptr::null_mut();
    // SAFETY: both streams are alive for the life of the process; the event
    // is destroyed once the wait on it is queued (the driver defers that).
    unsafe {
        ck(cu::cuEventCreate(&mut ev, 2), "cuEventCreate").map_err(|e| dev.err(e))?;
        let queued = ck(cu::cuEventRecord(ev, signaller), "cuEventRecord")
            .and_then(|()| ck(cu::cuStreamWaitEvent(waiter, ev, 0), "cuStreamWaitEvent"))
            .map_err(|e| dev.err(e));
        let _ = cu::cuEventDestroy_v2(ev);
        queued
    }
}

/// One rank's call: its device and the device addresses it reads and writes.
struct Rank {
    dev: &'static CudaBackend,
    send: *const c_void,
    recv: *mut c_void,
}

impl Nccl {
    /// The communicators of `devs` in this order, made on first use.
    fn comms(&self, state: &mut State, devs: &[&'static CudaBackend], what: &str) -> Result<Vec<Raw<Comm>>> {
        let key: Vec<usize> = devs.iter().map(|d| d.ordinal).collect();
        if let Some(c) = state.comms.get(&key) {
            return Ok(c.clone());
        }
        let list: Vec<c_int> = key.iter().map(|&o| o as c_int).collect();
        let mut comms: Vec<Comm> = vec![std::ptr::null_mut(); list.len()];
        // SAFETY: room for one communicator per listed device.
        let r = unsafe { (self.api.comm_init_all)(comms.as_mut_ptr(), list.len() as c_int, list.as_ptr()) };
        if r != OK {
            return Err(devs[0].err(format!(
                "{what} through NCCL: ncclCommInitAll over CUDA devices {key:?} failed: {}; nothing was queued \
                 (set KILN_DISABLE_NCCL=1 to use peer copies instead, NCCL_DEBUG=WARN for NCCL's report)",
                self.api.describe(r, std::ptr::null_mut())
            )));
        }
        let comms: Vec<Raw<Comm>> = comms.into_iter().map(Raw).collect();
        state.comms.insert(key, comms.clone());
        Ok(comms)
    }

    /// The NCCL stream of `dev`, made on first use.
    fn stream(&self, state: &mut State, dev: &CudaBackend) -> Result<Raw<cu::CUstream>> {
        if let Some(s) = state.streams.get(&dev.ordinal) {
            return Ok(*s);
        }
        dev.bind()?;
        let mut s: cu::CUstream = std::ptr::null_mut();
        // SAFETY: out-pointer to a local; 1 = CU_STREAM_NON_BLOCKING. The
        // stream lives as long as the process.
        ck(unsafe { cu::cuStreamCreate(&mut s, 1) }, "cuStreamCreate (the NCCL stream)").map_err(|e| dev.err(e))?;
        state.streams.insert(dev.ordinal, Raw(s));
        Ok(Raw(s))
    }

    /// Runs one collective: `inputs[i]` and `outputs[i]` are rank i's, `call`
    /// issues rank i's NCCL call inside the group.
    fn collective(
        &self,
        what: &str,
        call_name: &str,
        inputs: &[Part],
        outputs: &[Part],
        call: impl Fn(&Api, &Rank, Comm, NcclStream) -> Res,
    ) -> Result<()> {
        catch_unwind(AssertUnwindSafe(|| self.collective_inner(what, call_name, inputs, outputs, call))).unwrap_or_else(|_| {
            Err(Error::Backend {
                device: inputs[0].storage.device,
                msg: format!("{what} through NCCL: a CUDA library call panicked (missing library or symbol)"),
            })
        })
    }

    fn collective_inner(
        &self,
        what: &str,
        call_name: &str,
        inputs: &[Part],
        outputs: &[Part],
        call: impl Fn(&Api, &Rank, Comm, NcclStream) -> Res,
    ) -> Result<()> {
        let devs = inputs.iter().map(|p| cuda_of(p.storage.backend)).collect::<Result<Vec<_>>>()?;
        // A poisoned input (see `Storage::poison`) poisons every rank's
        // output, as the collective would spread its values: nothing runs.
        if let Some(fault) = inputs.iter().find_map(|p| p.storage.fault()) {
            for o in outputs {
                o.storage.poison(&fault);
            }
            return Ok(());
        }
        let size = inputs[0].storage.dtype.size_in_bytes();
        let mut ranks = Vec::with_capacity(devs.len());
        for ((dev, i), o) in devs.iter().zip(inputs).zip(outputs) {
            let send = dev_ptr(dev, &i.storage)? + (i.offset * size) as u64;
            let recv = dev_ptr(dev, &o.storage)? + (o.offset * size) as u64;
            ranks.push(Rank { dev, send: send as *const c_void, recv: recv as *mut c_void });
        }
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let comms = self.comms(&mut state, &devs, what)?;
        let streams = devs.iter().map(|d| self.stream(&mut state, d)).collect::<Result<Vec<_>>>()?;
        // The inputs are produced by the work queued on the compute streams.
        for (d, s) in devs.iter().zip(&streams) {
            order_after(d, s.0, d.stream.0)?;
        }
        for ((d, i), o) in devs.iter().zip(inputs).zip(outputs) {
            state.in_use.entry(d.ordinal).or_default().extend([i.storage.clone(), o.storage.clone()]);
        }
        let api = &self.api;
        // SAFETY: NCCL calls with live communicators and streams of the
        // ranks' devices, and device addresses of storages kept alive (in
        // `in_use`) until the work is ordered before any reuse.
        unsafe {
            let r = (api.group_start)();
            if r != OK {
                return Err(devs[0].err(format!("{what} through NCCL: ncclGroupStart failed: {}", api.describe(r, std::ptr::null_mut()))));
            }
            let mut refused = None;
            for (r, rank) in ranks.iter().enumerate() {
                let res = call(api, rank, comms[r].0, streams[r].0 as NcclStream);
                if res != OK {
                    refused = Some((r, res));
                    break;
                }
            }
            let end = (api.group_end)();
            if let Some((r, res)) = refused {
                return Err(ranks[r].dev.err(format!(
                    "{what} through NCCL: {call_name} for rank {r} refused: {}; the group was abandoned, so nothing was queued \
                     (set KILN_DISABLE_NCCL=1 to use peer copies instead, NCCL_DEBUG=WARN for NCCL's report)",
                    api.describe(res, comms[r].0)
                )));
            }
            if end != OK {
                let err = devs[0].err(format!(
                    "{what} through NCCL: ncclGroupEnd failed: {}; part of the collective may have been queued, so its \
                     outputs are poisoned: reading them returns this error (set KILN_DISABLE_NCCL=1 to use peer copies instead)",
                    api.describe(end, comms[0].0)
                ));
                for o in outputs {
                    o.storage.poison(&err);
                }
                return Err(err);
            }
        }
        // Written by the devices' streams: a fault found at the next
        // synchronising call poisons them too.
        for (d, o) in devs.iter().zip(outputs) {
            d.written.push(&o.storage);
            for peer in devs.iter().filter(|p| p.ordinal != d.ordinal) {
                d.written.fed(super::written::bit(peer.ordinal));
                d.written.fed_by(super::written::bit(peer.ordinal));
            }
        }
        Ok(())
    }
}

/// Whether NCCL combines `dtype` with `op` as kiln does: not a max or min
/// of floats, which NCCL computes with fmax and fmin (a NaN loses).
fn reduces_like_kiln(dtype: DType, op: Combine) -> bool {
    !(dtype.is_float() && matches!(op, Combine::Max | Combine::Min))
}

/// `parts` as the inputs of a collective and its dtype and length.
fn shape_of(parts: &[Part]) -> (nc::ncclDataType_t, usize) {
    (datatype(parts[0].storage.dtype), parts[0].len)
}

impl Communicator for Nccl {
    fn name(&self) -> String {
        format!("NCCL {}.{}.{}", self.version.0, self.version.1, self.version.2)
    }

    fn reduces(&self, dtype: DType, op: Combine) -> bool {
        reduces_like_kiln(dtype, op)
    }

    fn all_reduce(&self, parts: &[Part], op: Combine) -> Result<()> {
        let ((dt, len), op) = (shape_of(parts), red_op(op));
        // SAFETY (every call): the ranks' buffers hold `len` elements.
        self.collective("all_reduce", "ncclAllReduce", parts, parts, |api, r, comm, s| unsafe {
            (api.all_reduce)(r.send, r.recv, len, dt, op, comm, s)
        })
    }

    fn broadcast(&self, parts: &[Part], root: usize) -> Result<()> {
        let (dt, len) = shape_of(parts);
        self.collective("broadcast", "ncclBroadcast", parts, parts, |api, r, comm, s| unsafe {
            (api.broadcast)(r.send, r.recv, len, dt, root as c_int, comm, s)
        })
    }

    fn reduce(&self, parts: &[Part], root: usize, op: Combine) -> Result<()> {
        let ((dt, len), op) = (shape_of(parts), red_op(op));
        self.collective("reduce", "ncclReduce", parts, parts, |api, r, comm, s| unsafe {
            (api.reduce)(r.send, r.recv, len, dt, op, root as c_int, comm, s)
        })
    }

    fn all_gather(&self, inputs: &[Part], outputs: &[Part]) -> Result<()> {
        let (dt, len) = shape_of(inputs);
        // SAFETY: each output holds n·len elements.
        self.collective("all_gather", "ncclAllGather", inputs, outputs, |api, r, comm, s| unsafe {
            (api.all_gather)(r.send, r.recv, len, dt, comm, s)
        })
    }

    fn reduce_scatter(&self, inputs: &[Part], outputs: &[Part], op: Combine) -> Result<()> {
        let ((dt, len), op) = (shape_of(outputs), red_op(op));
        // SAFETY: each input holds n·len elements.
        self.collective("reduce_scatter", "ncclReduceScatter", inputs, outputs, |api, r, comm, s| unsafe {
            (api.reduce_scatter)(r.send, r.recv, len, dt, op, comm, s)
        })
    }

    fn join(&self, backends: &[&'static dyn Backend]) -> Result<()> {
        for b in backends {
            let dev = cuda_of(*b)?;
            let released = {
                // Under the lock: every storage taken here belongs to a
                // collective queued before the event the compute stream waits on.
                let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
                let Some(stream) = state.streams.get(&dev.ordinal).copied() else { continue };
                catch_unwind(AssertUnwindSafe(|| order_after(dev, dev.stream.0, stream.0)))
                    .unwrap_or_else(|_| Err(dev.err("joining NCCL's stream: a CUDA library call panicked (missing library or symbol)")))?;
                state.in_use.remove(&dev.ordinal)
            };
            drop(released);
        }
        Ok(())
    }
}

impl ProcessComms for Nccl {
    fn name(&self) -> String {
        Communicator::name(self)
    }

    fn reduces(&self, dtype: DType, op: Combine) -> bool {
        reduces_like_kiln(dtype, op)
    }

    fn unique_id(&self) -> Result<Vec<u8>> {
        let api = self.rank_api()?;
        let mut id = UniqueId { internal: [0; 128] };
        // SAFETY: out-pointer to a local of ncclUniqueId's layout.
        let r =
            catch_unwind(AssertUnwindSafe(|| unsafe { (api.get_unique_id)(&mut id) })).unwrap_or(nc::ncclResult_t::ncclSystemError as Res);
        if r != OK {
            return Err(Error::Backend {
                device: crate::Device::Cpu,
                msg: format!("ncclGetUniqueId failed: {} (NCCL_DEBUG=WARN for NCCL's report)", self.api.describe(r, std::ptr::null_mut())),
            });
        }
        Ok(id.internal.to_vec())
    }

    fn join(&self, device: &'static dyn Backend, id: &[u8], size: usize, rank: usize, timeout: Duration) -> Result<Box<dyn RankComm>> {
        let api = self.rank_api()?;
        let dev = cuda_of(device)?;
        let mut unique = UniqueId { internal: [0; 128] };
        if id.len() != unique.internal.len() {
            return Err(dev.err(format!("an NCCL unique id is 128 bytes, not {}", id.len())));
        }
        unique.internal.copy_from_slice(id);
        dev.bind()?;
        let mut comm: Comm = std::ptr::null_mut();
        let mut config = Config::non_blocking();
        let (what, r) = match api.comm_init_rank_config {
            // SAFETY: out-pointers to locals (the config lives through the
            // call; NCCL copies it); the id is passed by value; the device's
            // context is current (NCCL takes the current device).
            Some(init) => (
                "ncclCommInitRankConfig",
                catch_unwind(AssertUnwindSafe(|| unsafe { init(&mut comm, size as c_int, unique, rank as c_int, &mut config) })),
            ),
            // SAFETY: as above, without a config.
            None => (
                "ncclCommInitRank",
                catch_unwind(AssertUnwindSafe(|| unsafe { (api.comm_init_rank)(&mut comm, size as c_int, unique, rank as c_int) })),
            ),
        };
        let r = r.unwrap_or(nc::ncclResult_t::ncclSystemError as Res);
        let refused = |r: Res, comm: Comm| {
            dev.err(format!(
                "{what} (rank {rank} of {size}) failed: {}; check that every rank started and that NCCL can reach \
                 the others (NCCL_SOCKET_IFNAME, NCCL_DEBUG=WARN for NCCL's report)",
                self.api.describe(r, comm)
            ))
        };
        if r != OK && r != IN_PROGRESS {
            let err = refused(r, comm);
            if !comm.is_null() {
                // SAFETY: a communicator NCCL returned with its error, never used after.
                let _ = catch_unwind(AssertUnwindSafe(|| unsafe { (api.comm_abort)(comm) }));
            }
            return Err(err);
        }
        if r == IN_PROGRESS || api.comm_init_rank_config.is_some() {
            // Non-blocking: joined when the communicator's state leaves
            // ncclInProgress; past the timeout it is aborted, so no rank
            // waits forever for one that never starts.
            let deadline = std::time::Instant::now() + timeout;
            let mut pause = Duration::from_micros(50);
            loop {
                let mut state: Res = OK;
                // SAFETY: out-pointer to a local; the communicator NCCL returned.
                let q = unsafe { (api.comm_get_async_error)(comm, &mut state) };
                let state = if q != OK { q } else { state };
                if state == OK {
                    break;
                }
                let failed = if state != IN_PROGRESS {
                    Some(refused(state, comm))
                } else if std::time::Instant::now() >= deadline {
                    Some(dev.err(format!(
                        "{what} (rank {rank} of {size}): the other ranks did not join within {} s (KILN_DIST_INIT_TIMEOUT): \
                         a rank did not start, or cannot reach rank 0 (NCCL_SOCKET_IFNAME, NCCL_DEBUG=WARN for NCCL's report)",
                        timeout.as_secs_f64()
                    )))
                } else {
                    None
                };
                if let Some(e) = failed {
                    // SAFETY: the communicator NCCL returned, never used after.
                    let _ = catch_unwind(AssertUnwindSafe(|| unsafe { (api.comm_abort)(comm) }));
                    return Err(e);
                }
                std::thread::sleep(pause);
                pause = (pause * 2).min(Duration::from_millis(5));
            }
        }
        // The process's NCCL (`self` is it): kept for the life of the process.
        let nccl = get().map_err(|e| dev.err(e))?;
        Ok(Box::new(NcclRank {
            nccl,
            dev,
            comm: Raw(comm),
            rank,
            size,
            non_blocking: api.comm_init_rank_config.is_some(),
            timeout,
            lock: Mutex::new(Vec::new()),
            broken: Mutex::new(None),
        }))
    }
}

impl Nccl {
    fn rank_api(&self) -> Result<&RankApi> {
        self.api.ranks.as_ref().ok_or_else(|| Error::Backend {
            device: crate::Device::Cpu,
            msg: "this NCCL library lacks ncclGetUniqueId, ncclCommInitRank, ncclCommGetAsyncError or ncclCommAbort \
                  (too old?): upgrade NCCL for collectives across processes"
                .into(),
        })
    }
}

/// This process's rank of an NCCL communicator across processes. Its calls
/// run on the device's compute stream, in the order they are queued.
struct NcclRank {
    nccl: &'static Nccl,
    dev: &'static CudaBackend,
    comm: Raw<Comm>,
    rank: usize,
    size: usize,
    /// Made without blocking: a call may return ncclInProgress, and the
    /// next one waits until the communicator leaves that state.
    non_blocking: bool,
    /// How long a call may stay in progress (the group's timeout).
    timeout: Duration,
    /// Held while a call is issued (every rank must issue its calls in the
    /// same order): the (input, output) storages of the calls queued since
    /// the last wait.
    lock: Mutex<Vec<(Arc<Storage>, Arc<Storage>)>>,
    /// Why the communicator was aborted: it is freed, so every later call
    /// is this error.
    broken: Mutex<Option<Error>>,
}

impl NcclRank {
    fn fail(&self, msg: String) -> Error {
        self.dev.err(format!("rank {} of {} through NCCL: {msg}", self.rank, self.size))
    }

    fn check_open(&self) -> Result<()> {
        match &*self.broken.lock().unwrap_or_else(|e| e.into_inner()) {
            Some(e) => Err(self.fail(format!("the communicator was aborted after an earlier failure ({e}); start a new job"))),
            None => Ok(()),
        }
    }

    /// Aborts the communicator once (the other ranks' calls then fail or
    /// time out instead of waiting for this one) and records why.
    fn break_with(&self, err: &Error) {
        let mut broken = self.broken.lock().unwrap_or_else(|e| e.into_inner());
        if broken.is_none() {
            if let Ok(ranks) = self.nccl.rank_api() {
                // SAFETY: a live communicator, aborted once (`broken` guards it).
                let _ = catch_unwind(AssertUnwindSafe(|| unsafe { (ranks.comm_abort)(self.comm.0) }));
            }
            *broken = Some(err.clone());
        }
    }
}

impl RankComm for NcclRank {
    fn queue(&self, call: RankCall, input: &Part, output: &Part) -> Result<()> {
        self.check_open()?;
        // The other ranks make this call whatever happens here: a rank that
        // cannot take part breaks the communicator (they then fail too)
        // rather than skip it and pair its next call with their current one.
        if let Some(fault) = input.storage.fault() {
            let err = self.fail(format!("the input of this rank's collective was not computed ({fault}); the group is broken"));
            output.storage.poison(&err);
            self.break_with(&err);
            return Err(err);
        }
        let api = &self.nccl.api;
        let size = input.storage.dtype.size_in_bytes();
        let dt = datatype(input.storage.dtype);
        let send = (dev_ptr(self.dev, &input.storage)? + (input.offset * size) as u64) as *const c_void;
        let recv = (dev_ptr(self.dev, &output.storage)? + (output.offset * size) as u64) as *mut c_void;
        let mut held = self.lock.lock().unwrap_or_else(|e| e.into_inner());
        self.dev.bind()?;
        let (stream, comm) = (self.dev.stream.0 as NcclStream, self.comm.0);
        let (name, r) = catch_unwind(AssertUnwindSafe(|| unsafe {
            // SAFETY: device addresses of live storages (kept in `held` until
            // the next wait) on this rank's device, `len` elements each as
            // the call needs (checked by the front end); the stream and the
            // communicator are this rank's.
            match call {
                RankCall::AllReduce(op) => ("ncclAllReduce", (api.all_reduce)(send, recv, input.len, dt, red_op(op), comm, stream)),
                RankCall::Broadcast { root } => ("ncclBroadcast", (api.broadcast)(send, recv, input.len, dt, root as c_int, comm, stream)),
                RankCall::AllGather => ("ncclAllGather", (api.all_gather)(send, recv, input.len, dt, comm, stream)),
                RankCall::ReduceScatter(op) => {
                    ("ncclReduceScatter", (api.reduce_scatter)(send, recv, output.len, dt, red_op(op), comm, stream))
                }
            }
        }))
        .unwrap_or(("an NCCL call", nc::ncclResult_t::ncclSystemError as Res));
        // A non-blocking communicator may still be enqueuing the call: the
        // next call waits until it has (NCCL's rule for such communicators).
        if r == IN_PROGRESS && self.non_blocking {
            let settled = self.settle(comm);
            if settled != OK {
                // NCCL may have enqueued part of it: the output is not trustworthy.
                let err = if settled == IN_PROGRESS {
                    self.fail(format!(
                        "{name} did not finish enqueuing within {} s (KILN_DIST_TIMEOUT); the group is broken",
                        self.timeout.as_secs_f64()
                    ))
                } else {
                    self.fail(format!("{name} failed while enqueuing: {}; the group is broken", api.describe(settled, comm)))
                };
                output.storage.poison(&err);
                drop(held);
                self.break_with(&err);
                return Err(err);
            }
        }
        if r != OK && !(r == IN_PROGRESS && self.non_blocking) {
            let err = self.fail(format!("{name} refused: {}; nothing was queued, and the group is broken", api.describe(r, comm)));
            drop(held);
            self.break_with(&err);
            return Err(err);
        }
        held.push((input.storage.clone(), output.storage.clone()));
        self.dev.written.push(&output.storage);
        Ok(())
    }

    fn abort(&self, err: &Error) {
        self.break_with(err);
    }

    fn wait(&self, timeout: std::time::Duration) -> Result<()> {
        self.check_open()?;
        let ranks = self.nccl.rank_api()?;
        let held = std::mem::take(&mut *self.lock.lock().unwrap_or_else(|e| e.into_inner()));
        let outcome = self.wait_for_stream(ranks, timeout);
        if let Err(e) = &outcome {
            // Written part-way, or not at all: reading an output is the error.
            for (_, out) in &held {
                out.poison(e);
            }
            self.break_with(e);
        }
        drop(held);
        outcome
    }
}

impl NcclRank {
    /// Waits until a non-blocking communicator's state leaves
    /// ncclInProgress (at most the timeout): that state, or the error.
    fn settle(&self, comm: Comm) -> Res {
        let Ok(ranks) = self.nccl.rank_api() else { return nc::ncclResult_t::ncclInternalError as Res };
        let deadline = std::time::Instant::now() + self.timeout;
        let mut pause = Duration::from_micros(10);
        loop {
            let mut state: Res = OK;
            // SAFETY: out-pointer to a local; a live communicator.
            let q = unsafe { (ranks.comm_get_async_error)(comm, &mut state) };
            let state = if q != OK { q } else { state };
            if state != IN_PROGRESS || std::time::Instant::now() >= deadline {
                return state;
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_millis(1));
        }
    }

    /// Waits for the work queued on the device's stream so far, watching the
    /// communicator's asynchronous error and the timeout.
    fn wait_for_stream(&self, ranks: &RankApi, timeout: std::time::Duration) -> Result<()> {
        self.dev.bind()?;
        let mut ev: cu::CUevent = std::ptr::null_mut();
        // SAFETY: an event of this device's context, recorded on its stream,
        // queried, then destroyed.
        unsafe {
            ck(cu::cuEventCreate(&mut ev, 2), "cuEventCreate").map_err(|e| self.dev.err(e))?;
            if let Err(e) = ck(cu::cuEventRecord(ev, self.dev.stream.0), "cuEventRecord") {
                let _ = cu::cuEventDestroy_v2(ev);
                return Err(self.dev.err(e));
            }
        }
        let deadline = std::time::Instant::now() + timeout;
        let mut pause = std::time::Duration::from_micros(10);
        let outcome = loop {
            // SAFETY: the event above; the communicator is live.
            let q = unsafe { cu::cuEventQuery(ev) };
            if q == cu::CUresult::CUDA_SUCCESS {
                break Ok(());
            }
            let mut async_err: Res = OK;
            // SAFETY: out-pointer to a local; a live communicator.
            let r = unsafe { (ranks.comm_get_async_error)(self.comm.0, &mut async_err) };
            // In progress: a non-blocking communicator still enqueuing.
            if r != OK || (async_err != OK && async_err != IN_PROGRESS) {
                let code = if r != OK { r } else { async_err };
                // NCCL's words before the abort (in `wait`) frees the communicator.
                let words = self.nccl.api.describe(code, self.comm.0);
                break Err(self.fail(format!(
                    "a collective failed: {words}; the communicator was aborted, so this group is broken \
                     (NCCL_DEBUG=WARN for NCCL's report)"
                )));
            }
            if q != cu::CUresult::CUDA_ERROR_NOT_READY {
                break Err(self.fail(format!("waiting for its collectives: {q:?}")));
            }
            if std::time::Instant::now() >= deadline {
                break Err(self.fail(format!(
                    "its collectives did not finish within {:.0} s (KILN_DIST_TIMEOUT): another rank is dead or hung, or \
                     called other collectives; the communicator was aborted",
                    timeout.as_secs_f64()
                )));
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(std::time::Duration::from_millis(1));
        };
        // SAFETY: the event is no longer used.
        unsafe {
            let _ = cu::cuEventDestroy_v2(ev);
        }
        outcome
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn version_codes_split_in_both_formats() {
        assert_eq!(split_version(22105), (2, 21, 5));
        assert_eq!(split_version(21003), (2, 10, 3));
        assert_eq!(split_version(2708), (2, 7, 8));
        assert!(split_version(2708) < MIN_VERSION && split_version(21000) >= MIN_VERSION);
    }

    #[test]
    fn every_dtype_has_an_nccl_type_and_float_extrema_are_declined() {
        use nc::ncclDataType_t as T;
        let all = [DType::F32, DType::F64, DType::F16, DType::BF16, DType::I64, DType::I32, DType::U8];
        let types: Vec<T> = all.iter().map(|&d| datatype(d)).collect();
        assert_eq!(types, [T::ncclFloat32, T::ncclFloat64, T::ncclFloat16, T::ncclBfloat16, T::ncclInt64, T::ncclInt32, T::ncclUint8]);
        for d in all {
            assert!(reduces_like_kiln(d, Combine::Sum));
            for op in [Combine::Max, Combine::Min] {
                assert_eq!(reduces_like_kiln(d, op), !d.is_float(), "{d} {op:?}");
            }
        }
    }
}
