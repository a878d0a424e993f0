//! numpy's `.npy` format: a magic string, a version, a header that is a
//! Python dict literal (`descr`, `fortran_order`, `shape`) padded with
//! spaces to a multiple of 64 bytes, then the elements.

use super::{decode, encode_le, fortran_to_c, ByteOrder, DecodeError, ElemFormat, Origin};
use crate::runtime::ledger;
use crate::runtime::memory::try_vec;
use crate::{DType, Device, Result, Shape, Tensor};
use std::io::{BufReader, BufWriter, Read, Write};
use std::panic::Location;
use std::path::Path;

const MAGIC: &[u8; 6] = b"\x93NUMPY";

/// The longest header read. numpy's own reader refuses headers over 10,000
/// bytes unless told otherwise; a plain array's header is under 2 KiB even
/// at numpy's 64 dimensions.
const MAX_HEADER_BYTES: usize = 1 << 16;

/// numpy's limit on dimensions (NPY_MAXDIMS).
const MAX_RANK: usize = 64;

/// Python literals nest no deeper than this in a header kiln accepts.
const MAX_DEPTH: usize = 8;

/// What the header of an `.npy` array says.
#[derive(Debug)]
pub(crate) struct Header {
    pub(crate) format: ElemFormat,
    pub(crate) dims: Vec<usize>,
    pub(crate) fortran: bool,
    /// Where the elements start: the preamble and the header.
    pub(crate) data_start: u64,
}

/// What is known of the bytes of an array's stream before reading it.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Bounds {
    /// The stream holds exactly this many bytes, header included (a file's
    /// length, a slice's, a zip member's declared size).
    pub(crate) total: Option<u64>,
    /// The `total` bytes are really there (a file or a slice, not a
    /// compressed stream's promise), so the output may be allocated whole.
    pub(crate) present: bool,
    /// `total` is what an archive's directory says, not what was measured.
    pub(crate) declared: bool,
    /// The most data bytes the stream can produce (a deflated member: its
    /// compressed size times deflate's largest ratio).
    pub(crate) max_data: Option<u64>,
}

/// The text of a `descr` as kiln writes it.
fn descr(dtype: DType) -> &'static str {
    match dtype {
        DType::F32 => "<f4",
        DType::F64 => "<f8",
        DType::I64 => "<i8",
        DType::I32 => "<i4",
        DType::U8 => "|u1",
        DType::F16 => "<f2",
        // What `np.save` writes for an `ml_dtypes.bfloat16` array.
        DType::BF16 => "<V2",
    }
}

/// The dtype and byte order of a `descr` string, or why kiln cannot read it.
fn parse_descr(text: &str) -> std::result::Result<ElemFormat, String> {
    let (order, code) = match text.as_bytes().first() {
        Some(b'<') => (Some(ByteOrder::Little), &text[1..]),
        Some(b'>') => (Some(ByteOrder::Big), &text[1..]),
        Some(b'|') | Some(b'=') => (None, &text[1..]),
        _ => (None, text),
    };
    let supported = "kiln reads f2, f4, f8, i4, i8, u1, b1 (bool, read as u8) and V2 (bf16, as ml_dtypes writes it)";
    let kind = code.chars().next().unwrap_or(' ');
    let size: Option<usize> = code.get(kind.len_utf8()..).and_then(|s| s.parse().ok());
    let (dtype, is_bool) = match (kind, size) {
        ('f', Some(2)) => (DType::F16, false),
        ('f', Some(4)) => (DType::F32, false),
        ('f', Some(8)) => (DType::F64, false),
        ('i', Some(4)) => (DType::I32, false),
        ('i', Some(8)) => (DType::I64, false),
        ('u', Some(1)) => (DType::U8, false),
        ('b', Some(1)) => (DType::U8, true),
        ('V', Some(2)) => (DType::BF16, false),
        ('O', _) => return Err(format!("dtype `{text}` is Python objects (a pickle); kiln never unpickles: save a numeric array")),
        ('i' | 'u' | 'f' | 'c' | 'b' | 'V' | 'U' | 'S' | 'M' | 'm', _) => {
            return Err(format!(
                "dtype `{text}` is not one kiln has; {supported}; convert it in numpy first, e.g. `np.save(path, a.astype(np.int64))`"
            ));
        }
        _ => return Err(format!("dtype `{text}` is not a numpy type descriptor; {supported}")),
    };
    // A one-byte type has no byte order; '|' or '=' (or nothing) is the
    // order of the machine reading it, as numpy takes it.
    Ok(ElemFormat { dtype, order: order.unwrap_or(ByteOrder::NATIVE), is_bool })
}

// ---- the header: a Python literal -------------------------------------------

/// The Python literals a header is made of.
#[derive(Debug, Clone, PartialEq)]
enum Lit {
    Str(String),
    Int(i128),
    Bool(bool),
    None,
    Tuple(Vec<Lit>),
    List(Vec<Lit>),
    Dict(Vec<(Lit, Lit)>),
}

impl Lit {
    fn kind(&self) -> &'static str {
        match self {
            Lit::Str(_) => "a string",
            Lit::Int(_) => "an integer",
            Lit::Bool(_) => "a bool",
            Lit::None => "None",
            Lit::Tuple(_) => "a tuple",
            Lit::List(_) => "a list",
            Lit::Dict(_) => "a dict",
        }
    }
}

/// A recursive-descent parser of the Python literals numpy writes (what
/// `ast.literal_eval` would accept of them), bounded in depth.
struct Parser<'a> {
    text: &'a [char],
    pos: usize,
}

impl Parser<'_> {
    fn err(&self, what: impl std::fmt::Display) -> String {
        format!("{what} at character {} of the header", self.pos)
    }
    fn skip_space(&mut self) {
        while self.text.get(self.pos).is_some_and(|c| c.is_whitespace()) {
            self.pos += 1;
        }
    }
    fn peek(&mut self) -> Option<char> {
        self.skip_space();
        self.text.get(self.pos).copied()
    }
    fn expect(&mut self, c: char) -> std::result::Result<(), String> {
        if self.peek() == Some(c) {
            self.pos += 1;
            Ok(())
        } else {
            Err(self.err(format!("expected `{c}`")))
        }
    }
    fn value(&mut self, depth: usize) -> std::result::Result<Lit, String> {
        if depth > MAX_DEPTH {
            return Err(self.err("literals nested too deep"));
        }
        match self.peek() {
            None => Err(self.err("the header ends early")),
            Some('{') => {
                self.pos += 1;
                let mut items = Vec::new();
                loop {
                    if self.peek() == Some('}') {
                        self.pos += 1;
                        return Ok(Lit::Dict(items));
                    }
                    let key = self.value(depth + 1)?;
                    self.expect(':')?;
                    let value = self.value(depth + 1)?;
                    items.push((key, value));
                    match self.peek() {
                        Some(',') => self.pos += 1,
                        Some('}') => {}
                        None => return Err(self.err("the header ends early")),
                        _ => return Err(self.err("expected `,` or `}` in the dict")),
                    }
                }
            }
            Some(open @ ('(' | '[')) => {
                self.pos += 1;
                let close = if open == '(' { ')' } else { ']' };
                let (mut items, mut trailing_comma) = (Vec::new(), false);
                loop {
                    if self.peek() == Some(close) {
                        self.pos += 1;
                        break;
                    }
                    items.push(self.value(depth + 1)?);
                    trailing_comma = false;
                    match self.peek() {
                        Some(',') => {
                            self.pos += 1;
                            trailing_comma = true;
                        }
                        Some(c) if c == close => {}
                        None => return Err(self.err("the header ends early")),
                        _ => return Err(self.err(format!("expected `,` or `{close}`"))),
                    }
                }
                Ok(match open {
                    '[' => Lit::List(items),
                    // `(3)` is the number 3; `(3,)` a tuple.
                    _ if items.len() == 1 && !trailing_comma => items.remove(0),
                    _ => Lit::Tuple(items),
                })
            }
            Some(quote @ ('\'' | '"')) => {
                self.pos += 1;
                let mut s = String::new();
                loop {
                    match self.text.get(self.pos).copied() {
                        None => return Err(self.err("a string is not closed")),
                        Some(c) if c == quote => {
                            self.pos += 1;
                            return Ok(Lit::Str(s));
                        }
                        Some('\\') => {
                            // Only the escapes a descr or key could need.
                            let c = self.text.get(self.pos + 1).copied();
                            match c {
                                Some(c @ ('\\' | '\'' | '"')) => s.push(c),
                                _ => return Err(self.err("an escape sequence kiln does not read")),
                            }
                            self.pos += 2;
                        }
                        Some(c) => {
                            s.push(c);
                            self.pos += 1;
                        }
                    }
                }
            }
            Some(c) if c.is_ascii_digit() || c == '-' || c == '+' => {
                let start = self.pos;
                self.pos += 1;
                while self.text.get(self.pos).is_some_and(|c| c.is_ascii_digit() || *c == '_') {
                    self.pos += 1;
                }
                let digits: String = self.text[start..self.pos].iter().filter(|c| **c != '_').collect();
                // Python 2's long suffix, in headers numpy wrote under Python 2.
                if self.text.get(self.pos).is_some_and(|c| *c == 'L' || *c == 'l') {
                    self.pos += 1;
                }
                digits.parse::<i128>().map(Lit::Int).map_err(|_| self.err(format!("`{digits}` is not an integer kiln can hold")))
            }
            Some(c) if c.is_alphabetic() || c == '_' => {
                let start = self.pos;
                while self.text.get(self.pos).is_some_and(|c| c.is_alphanumeric() || *c == '_') {
                    self.pos += 1;
                }
                let word: String = self.text[start..self.pos].iter().collect();
                match word.as_str() {
                    "True" => Ok(Lit::Bool(true)),
                    "False" => Ok(Lit::Bool(false)),
                    "None" => Ok(Lit::None),
                    _ => Err(format!("`{word}` at character {start} of the header is not a Python literal")),
                }
            }
            Some(c) => Err(self.err(format!("unexpected `{}`", c.escape_default()))),
        }
    }
}

/// The dict of a header, checked to hold exactly numpy's three keys.
fn parse_header_text(text: &str) -> std::result::Result<(ElemFormat, Vec<usize>, bool), String> {
    let chars: Vec<char> = text.chars().collect();
    let mut p = Parser { text: &chars, pos: 0 };
    let dict = p.value(0)?;
    if p.peek().is_some() {
        return Err(p.err("text after the header's dict"));
    }
    let Lit::Dict(items) = dict else { return Err(format!("the header is {}, not a dict", dict.kind())) };
    let (mut descr, mut fortran, mut shape) = (None, None, None);
    for (key, value) in items {
        let slot = match &key {
            Lit::Str(k) if k == "descr" => &mut descr,
            Lit::Str(k) if k == "fortran_order" => &mut fortran,
            Lit::Str(k) if k == "shape" => &mut shape,
            Lit::Str(k) => return Err(format!("the header has a key `{k}`; numpy's headers have only descr, fortran_order and shape")),
            other => return Err(format!("the header has a key that is {}, not a string", other.kind())),
        };
        if slot.replace(value).is_some() {
            return Err(format!("the header names `{key:?}` twice"));
        }
    }
    let format = match descr {
        Some(Lit::Str(d)) => parse_descr(&d)?,
        Some(Lit::List(_)) => return Err("the array has named fields (a structured dtype); kiln reads plain numeric arrays".into()),
        Some(other) => return Err(format!("`descr` is {}, not a dtype string", other.kind())),
        None => return Err("the header has no `descr` (the dtype)".into()),
    };
    let fortran = match fortran {
        Some(Lit::Bool(b)) => b,
        Some(other) => return Err(format!("`fortran_order` is {}, not True or False", other.kind())),
        None => return Err("the header has no `fortran_order`".into()),
    };
    let dims = match shape {
        Some(Lit::Tuple(items)) => {
            if items.len() > MAX_RANK {
                return Err(format!("the shape has {} dimensions; numpy allows at most {MAX_RANK}", items.len()));
            }
            let mut dims = Vec::with_capacity(items.len());
            for item in items {
                match item {
                    Lit::Int(d) => {
                        dims.push(usize::try_from(d).map_err(|_| format!("the shape has a dimension {d}, which is not a size"))?)
                    }
                    other => return Err(format!("the shape holds {}, not an integer", other.kind())),
                }
            }
            dims
        }
        Some(other) => return Err(format!("`shape` is {}, not a tuple", other.kind())),
        None => return Err("the header has no `shape`".into()),
    };
    Ok((format, dims, fortran))
}

/// Reads the magic string, version and header.
pub(crate) fn read_header(r: &mut dyn Read, total: Option<u64>, origin: &Origin) -> Result<Header> {
    let mut pre = [0u8; 12];
    let got = super::read_full(r, &mut pre[..8]).map_err(|e| origin.io("cannot read the .npy preamble", e))?;
    if got < MAGIC.len() || &pre[..MAGIC.len()] != MAGIC {
        let found: String = pre[..got.min(6)].iter().map(|b| std::ascii::escape_default(*b).to_string()).collect();
        return Err(origin.format(format!(
            "not a .npy array: it starts with \"{found}\", where a .npy starts with \"\\x93NUMPY\"{}",
            if got < MAGIC.len() { format!(" (the stream holds only {got} bytes)") } else { String::new() }
        )));
    }
    if got < 8 {
        return Err(origin.format(format!("truncated: the stream ends at byte {got}, inside the .npy preamble")));
    }
    let (major, minor) = (pre[6], pre[7]);
    let len_bytes = match (major, minor) {
        (1, 0) => 2,
        (2, 0) | (3, 0) => 4,
        _ => return Err(origin.format(format!("npy format version {major}.{minor}; kiln reads versions 1.0, 2.0 and 3.0"))),
    };
    let got = super::read_full(r, &mut pre[8..8 + len_bytes]).map_err(|e| origin.io("cannot read the .npy header length", e))?;
    if got < len_bytes {
        return Err(origin.format(format!("truncated: the stream ends at byte {}, inside the .npy preamble", 8 + got)));
    }
    let header_len = if len_bytes == 2 {
        u16::from_le_bytes([pre[8], pre[9]]) as usize
    } else {
        u32::from_le_bytes([pre[8], pre[9], pre[10], pre[11]]) as usize
    };
    let preamble = 8 + len_bytes;
    let data_start = (preamble + header_len) as u64;
    if header_len > MAX_HEADER_BYTES {
        return Err(origin.format(format!(
            "the header is {header_len} bytes long (bytes {preamble}..{data_start}); a plain array's header is under 2 KiB and kiln reads at most {MAX_HEADER_BYTES}: the file is corrupt"
        )));
    }
    if let Some(total) = total.filter(|t| *t < data_start) {
        return Err(origin
            .format(format!("truncated: the header should span bytes {preamble}..{data_start}, but the stream holds only {total} bytes")));
    }
    let mut bytes = try_vec::<u8>(header_len)?;
    bytes.resize(header_len, 0);
    let got = super::read_full(r, &mut bytes).map_err(|e| origin.io("cannot read the .npy header", e))?;
    if got < header_len {
        return Err(origin.format(format!(
            "truncated: the header should span bytes {preamble}..{data_start}, but the stream ends at byte {}",
            preamble + got
        )));
    }
    let text = if major == 3 {
        String::from_utf8(bytes)
            .map_err(|e| origin.format(format!("the version 3.0 header is not UTF-8 (byte {})", preamble + e.utf8_error().valid_up_to())))?
    } else {
        // Versions 1.0 and 2.0 are latin-1: every byte is the char of its value.
        bytes.iter().map(|&b| b as char).collect()
    };
    let (format, dims, fortran) =
        parse_header_text(&text).map_err(|msg| origin.format(format!("bad header (bytes {preamble}..{data_start}): {msg}")))?;
    Ok(Header { format, dims, fortran, data_start })
}

/// Reads a whole `.npy` stream onto `device`.
#[track_caller]
pub(crate) fn read_array(r: &mut dyn Read, bounds: Bounds, origin: &Origin, device: &Device) -> Result<Tensor> {
    let header = read_header(r, bounds.total, origin)?;
    let (dtype, dims, start) = (header.format.dtype, header.dims.as_slice(), header.data_start);
    let too_big = || {
        origin.format(format!("the header's shape {dims:?} of {dtype} has more bytes than a 64-bit size can count: the header is corrupt"))
    };
    let len = crate::base::shape::checked_product("read_npy", dims).map_err(|_| too_big())?;
    let data_bytes = (len as u64).checked_mul(dtype.size_in_bytes() as u64).ok_or_else(too_big)?;
    let what = format!("the header (bytes 0..{start}) describes {dtype} of shape {dims:?}, {data_bytes} bytes from byte {start}");
    if let Some(total) = bounds.total {
        let follow = total.saturating_sub(start);
        if bounds.declared && data_bytes != follow {
            return Err(origin.format(format!(
                "the zip directory says the member is {total} bytes, {follow} after the header, but {what}: the member's header or the directory is wrong"
            )));
        }
        if data_bytes > follow {
            return Err(origin.format(format!("truncated or lying header: {what}, but only {follow} bytes follow")));
        }
        if data_bytes < follow {
            return Err(origin.format(format!(
                "{what}, and {} more bytes follow them: the file is corrupt or its header's shape is wrong (numpy would ignore them; kiln refuses)",
                follow - data_bytes
            )));
        }
    }
    if let Some(max) = bounds.max_data.filter(|m| data_bytes > *m) {
        return Err(origin.format(format!("lying header: {what}, but the compressed member can inflate to at most {max} bytes")));
    }
    let exact = bounds.present && bounds.total.is_some();
    let buf = match decode(r, header.format, len, exact) {
        Ok(buf) => buf,
        Err(DecodeError::Truncated(got)) => {
            return Err(origin.format(format!("truncated: {what}, but the data ends after {got} bytes (at byte {})", start + got)));
        }
        Err(DecodeError::Io(e)) => return Err(origin.io("cannot read the array's data", e)),
        Err(DecodeError::Other(e)) => return Err(e),
    };
    if !exact || bounds.declared {
        // A stream of unknown length (an inflating member) must end here;
        // and reading an archive's member to its end makes the archive
        // check its CRC.
        let mut extra = [0u8; 64];
        let more = super::read_full(r, &mut extra).map_err(|e| origin.io("cannot read the end of the member", e))?;
        if more > 0 {
            return Err(origin.format(format!(
                "{what}, and more bytes follow them: the member is corrupt or its header's shape is wrong (numpy would ignore them; kiln refuses)"
            )));
        }
    }
    let buf = if header.fortran { fortran_to_c(buf, dims)? } else { buf };
    Tensor::from_host_buffer(buf, Shape::from(header.dims), device)
}

/// The preamble and header kiln writes for an array of `dtype` and `dims`:
/// version 1.0 (2.0 when the header would not fit its 16-bit length), the
/// whole padded with spaces to a multiple of 64 bytes and ended by a newline.
pub(crate) fn header_bytes(dtype: DType, dims: &[usize]) -> Vec<u8> {
    let shape = match dims {
        [] => "()".to_string(),
        [d] => format!("({d},)"),
        _ => format!("({})", dims.iter().map(|d| d.to_string()).collect::<Vec<_>>().join(", ")),
    };
    let dict = format!("{{'descr': '{}', 'fortran_order': False, 'shape': {shape}, }}", descr(dtype));
    let padded = |preamble: usize| (preamble + dict.len() + 1).div_ceil(64) * 64 - preamble;
    let (major, preamble) = if padded(10) <= u16::MAX as usize { (1u8, 10) } else { (2u8, 12) };
    let header_len = padded(preamble);
    let mut out = Vec::with_capacity(preamble + header_len);
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&[major, 0]);
    if major == 1 {
        out.extend_from_slice(&(header_len as u16).to_le_bytes());
    } else {
        out.extend_from_slice(&(header_len as u32).to_le_bytes());
    }
    out.extend_from_slice(dict.as_bytes());
    out.resize(preamble + header_len - 1, b' ');
    out.push(b'\n');
    out
}

/// Writes a tensor as a `.npy` stream (its elements read to the host first).
pub(crate) fn write_array(out: &mut dyn Write, t: &Tensor, site: &'static Location<'static>, origin: &Origin) -> Result<()> {
    let buf = t.read_host(site)?;
    let header = header_bytes(t.dtype(), t.dims());
    out.write_all(&header).and_then(|_| encode_le(&buf, out)).map_err(|e| origin.write_io(e))
}

/// The number of bytes of a tensor's `.npy` stream.
pub(crate) fn npy_len(t: &Tensor) -> u64 {
    let data = (t.elem_count() as u64).saturating_mul(t.dtype().size_in_bytes() as u64);
    (header_bytes(t.dtype(), t.dims()).len() as u64).saturating_add(data)
}

/// Reads a `.npy` file onto `device` (numpy's `np.load`).
///
/// Every kiln dtype and numpy's bool (as u8 of 0 and 1) are read, in either
/// byte order and in C or Fortran order (the result is always row-major),
/// from header versions 1.0, 2.0 and 3.0; 0-d arrays give a tensor of shape
/// `[]`, empty ones a tensor with a zero dimension. Reading onto a GPU is a
/// host-to-device transfer booked at the caller's line.
///
/// Errors: [`Error::Io`](crate::Error::Io) when the file cannot be read,
/// [`Error::Format`](crate::Error::Format) naming what is wrong and where
/// when it is not a `.npy` kiln can read (a dtype kiln lacks, a truncated
/// file, a header whose shape does not match the bytes, bytes after the
/// data, which numpy ignores), [`Error::NoSuchDevice`](crate::Error::NoSuchDevice),
/// [`Error::TransferDisallowed`](crate::Error::TransferDisallowed) under a
/// transfer guard.
///
/// ```
/// use kiln::{cpu, io, Tensor};
/// let path = std::env::temp_dir().join(format!("kiln-doc-read-npy-{}.npy", std::process::id()));
/// io::write_npy(&path, &Tensor::new(&[1.5f64, -2.0], &cpu())?)?;
/// let x = io::read_npy(&path, &cpu())?;
/// assert_eq!(x.to_vec::<f64>()?, vec![1.5, -2.0]);
/// # std::fs::remove_file(&path).unwrap();
/// # Ok::<(), kiln::Error>(())
/// ```
#[track_caller]
pub fn read_npy(path: impl AsRef<Path>, device: &Device) -> Result<Tensor> {
    let _site = ledger::site_scope(Location::caller());
    let path = path.as_ref();
    let origin = Origin::file(path);
    crate::registry::backend(*device)?;
    let file = std::fs::File::open(path).map_err(|e| origin.io("cannot open the .npy file", e))?;
    let len = file.metadata().map_err(|e| origin.io("cannot read the .npy file's size", e))?.len();
    let bounds = Bounds { total: Some(len), present: true, declared: false, max_data: None };
    read_array(&mut BufReader::new(file), bounds, &origin, device)
}

/// Reads a `.npy` array held in memory onto `device`; errors name the
/// source `<bytes>`. See [`read_npy`].
///
/// ```
/// use kiln::{cpu, io, Tensor};
/// let bytes = io::npy_to_bytes(&Tensor::new(&[[1u8, 2], [3, 4]], &cpu())?)?;
/// let x = io::npy_from_bytes(&bytes, &cpu())?;
/// assert_eq!(x.dims(), &[2, 2]);
/// assert!(matches!(io::npy_from_bytes(&bytes[..bytes.len() - 1], &cpu()), Err(kiln::Error::Format { .. })));
/// # Ok::<(), kiln::Error>(())
/// ```
#[track_caller]
pub fn npy_from_bytes(bytes: &[u8], device: &Device) -> Result<Tensor> {
    let _site = ledger::site_scope(Location::caller());
    crate::registry::backend(*device)?;
    let bounds = Bounds { total: Some(bytes.len() as u64), present: true, declared: false, max_data: None };
    read_array(&mut &bytes[..], bounds, &Origin::bytes(), device)
}

/// Writes a tensor to a `.npy` file (numpy's `np.save`), from any device:
/// reading a GPU tensor is a device-to-host transfer booked at the caller's
/// line. The array is little-endian and in C order; bf16 is written as
/// `<V2`, as `ml_dtypes` does (numpy loads it as `V2`:
/// `np.load(path).view(ml_dtypes.bfloat16)`). An existing file is replaced;
/// a write that fails part-way removes it.
///
/// ```
/// use kiln::{cpu, io, DType, Tensor};
/// let path = std::env::temp_dir().join(format!("kiln-doc-write-npy-{}.npy", std::process::id()));
/// let x = Tensor::ones((2, 3), DType::BF16, &cpu())?;
/// io::write_npy(&path, &x)?;
/// assert_eq!(io::read_npy(&path, &cpu())?.dtype(), DType::BF16);
/// # std::fs::remove_file(&path).unwrap();
/// # Ok::<(), kiln::Error>(())
/// ```
#[track_caller]
pub fn write_npy(path: impl AsRef<Path>, tensor: &Tensor) -> Result<()> {
    let site = Location::caller();
    let _site = ledger::site_scope(site);
    let path = path.as_ref();
    let origin = Origin::file(path);
    // Read first: a tensor that cannot be read leaves any existing file alone.
    let buf = tensor.read_host(site)?;
    let header = header_bytes(tensor.dtype(), tensor.dims());
    let file = std::fs::File::create(path).map_err(|e| origin.io("cannot create the .npy file", e))?;
    let mut w = BufWriter::new(file);
    let written = w.write_all(&header).and_then(|_| encode_le(&buf, &mut w)).and_then(|_| w.flush());
    written.map_err(|e| {
        // No truncated array is left behind (a full disk).
        let _ = std::fs::remove_file(path);
        origin.write_io(e)
    })
}

/// A tensor as the bytes of a `.npy` file. See [`write_npy`].
///
/// ```
/// use kiln::{cpu, io, Tensor};
/// let bytes = io::npy_to_bytes(&Tensor::new(&[7i32], &cpu())?)?;
/// assert!(bytes.starts_with(b"\x93NUMPY"));
/// assert_eq!(bytes.len() % 64, 4);           // a 64-byte header, then one i32
/// # Ok::<(), kiln::Error>(())
/// ```
#[track_caller]
pub fn npy_to_bytes(tensor: &Tensor) -> Result<Vec<u8>> {
    let site = Location::caller();
    let _site = ledger::site_scope(site);
    let total = usize::try_from(npy_len(tensor)).unwrap_or(usize::MAX);
    let mut out = try_vec::<u8>(total)?;
    write_array(&mut out, tensor, site, &Origin::bytes())?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> std::result::Result<(ElemFormat, Vec<usize>, bool), String> {
        parse_header_text(text)
    }

    #[test]
    fn headers_numpy_writes_parse() {
        let (f, dims, fortran) = parse("{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }          \n").unwrap();
        assert_eq!((f.dtype, f.order, f.is_bool, dims, fortran), (DType::F32, ByteOrder::Little, false, vec![2, 3], false));
        let (f, dims, fortran) = parse("{'descr': '>i8', 'fortran_order': True, 'shape': (5,), }").unwrap();
        assert_eq!((f.dtype, f.order, dims, fortran), (DType::I64, ByteOrder::Big, vec![5], true));
        let (f, dims, _) = parse("{'descr': '|b1', 'fortran_order': False, 'shape': (), }").unwrap();
        assert_eq!((f.dtype, f.is_bool, dims), (DType::U8, true, vec![]));
        // Keys in any order, double quotes, Python 2 longs.
        let (f, dims, _) = parse("{\"shape\": (3L, 0L), \"fortran_order\": False, \"descr\": \"<V2\"}").unwrap();
        assert_eq!((f.dtype, dims), (DType::BF16, vec![3, 0]));
    }

    #[test]
    fn bad_headers_say_what_is_wrong() {
        let cases = [
            ("{'descr': '<u2', 'fortran_order': False, 'shape': (2,), }", "`<u2` is not one kiln has"),
            ("{'descr': '|O', 'fortran_order': False, 'shape': (2,), }", "never unpickles"),
            ("{'descr': [('a', '<f4')], 'fortran_order': False, 'shape': (2,), }", "named fields"),
            ("{'descr': '<f4', 'fortran_order': False, 'shape': (-2,), }", "dimension -2"),
            ("{'descr': '<f4', 'fortran_order': False, 'shape': (2), }", "`shape` is an integer"),
            ("{'descr': '<f4', 'fortran_order': False}", "no `shape`"),
            ("{'descr': '<f4', 'fortran_order': False, 'shape': (2,), 'x': 1}", "key `x`"),
            ("{'descr': '<f4', 'descr': '<f4', 'fortran_order': False, 'shape': (2,)}", "twice"),
            ("{'descr': '<f4', 'fortran_order': 0, 'shape': (2,)}", "not True or False"),
            ("{'descr': '<f4', 'fortran_order': False, 'shape': (99999999999999999999999999999999999999999,)}", "not an integer"),
            ("{'descr': '<f4', 'fortran_order': False, 'shape': (2,)} junk", "text after"),
            ("{'descr': '<f4', 'fortran_order': False, 'shape': (2,)", "ends early"),
            ("((((((((((((1))))))))))))", "nested too deep"),
            ("{'descr': __import__('os'), }", "not a Python literal"),
        ];
        for (text, expected) in cases {
            let err = parse(text).unwrap_err();
            assert!(err.contains(expected), "{text}: {err}");
        }
    }

    #[test]
    fn written_headers_are_aligned_and_read_back() {
        for dims in [vec![], vec![0], vec![3], vec![2, 3, 4], vec![usize::MAX, 0]] {
            for dtype in [DType::F32, DType::F64, DType::I64, DType::I32, DType::U8, DType::F16, DType::BF16] {
                let h = header_bytes(dtype, &dims);
                assert_eq!(h.len() % 64, 0);
                assert_eq!(h.last(), Some(&b'\n'));
                let header = read_header(&mut &h[..], Some(h.len() as u64), &Origin::bytes()).unwrap();
                assert_eq!((header.format.dtype, header.dims, header.data_start), (dtype, dims.clone(), h.len() as u64));
            }
        }
    }
}
