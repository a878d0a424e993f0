//! The layer check: kiln's modules form layers in which control only goes
//! down, and this test fails when the source says otherwise.
//!
//! ```text
//!   lib.rs (re-exports, cuda_check)                       top
//!   trainer
//!   optim   checkpoint   io
//!   nn   data   host_nn
//!   ops          the front end's operations (one op, one file)
//!   autograd     the tape and backward
//!   tensor       the Tensor handle
//!   registry     which devices exist; builds the backends
//!   backends     cpu, host, sim, cuda: one folder each
//!   kernel       the Backend trait, Storage, the kernel contract
//!   runtime      memory pools, ledger, rng, threads
//!   base         device vocabulary, dtype, shape, errors, CpuBuffer  bottom
//! ```
//!
//! The graph is read from the source text of `kiln/src`: every `crate::`
//! (and `$crate::`) path outside comments and strings, and every `super::`
//! path that climbs to the crate root, gives an edge from the file's
//! top-level module (a folder is one module; `lib.rs` is `lib`) to the
//! first segment of the path. Names the crate root re-exports
//! (`crate::Tensor`, `crate::Device`, `crate::Result`, `crate::no_grad`, …)
//! are resolved, through `lib.rs`'s `pub use` lines, to the module that
//! defines them; `#[macro_export]` macros (`crate::kernel_args!`) to the
//! module whose file defines them.
//!
//! The rules:
//! 1. no import cycle among top-level modules;
//! 2. every edge goes down or sideways within a layer of [`LAYERS`] (a
//!    module not placed in a layer fails the test: place it);
//! 3. no file under `base/`, `runtime/`, `kernel/` or `backends/` imports the
//!    front end (`tensor`, `autograd`, `ops`, `nn`, `optim`, `data`,
//!    `trainer`, `checkpoint`, `io`), nor the registry (a backend does not
//!    register itself: the registry builds backends);
//! 4. `base/` (the device vocabulary lives in `base/device.rs`) names no
//!    backend.
//!
//! What the rules allow, stated precisely: an op's CUDA kernel is declared
//! in its own file under `ops/` and *registered* with `inventory::submit!`
//! into a list that `kernel/cuda.rs` defines; `backends/cuda` then finds it
//! by name through `kernel::cuda::declared_modules()`. That is an edge
//! ops → kernel (down); the backend never names the op. Doc comments and
//! doc links (`[`crate::Tensor`]`) are not imports and are not read, nor
//! are `#[cfg(test)]` items and test-only module files: a unit test of a
//! lower layer may drive it through the front end.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The layers, bottom first. A module may import modules of its own layer
/// or of a lower one.
const LAYERS: &[&[&str]] = &[
    &["base"],
    &["runtime"],
    &["kernel"],
    &["backends"],
    &["registry"],
    // host_nn: kernels over host slices; it names the registry only to
    // report memory in an out-of-memory error.
    &["tensor", "host_nn"],
    &["autograd"],
    &["ops"],
    &["nn", "data", "comm"],
    &["optim", "checkpoint", "io", "models", "dist"],
    &["trainer"],
    &["lib"],
];

/// Modules below the front end: they must not import it.
const BELOW_FRONT_END: &[&str] = &["base", "runtime", "kernel", "backends"];
/// The front end (and the registry above the backends).
const FRONT_END: &[&str] = &["registry", "tensor", "autograd", "ops", "nn", "optim", "data", "comm", "dist", "trainer", "checkpoint", "io"];

/// One import: where it is written and which top-level module it names.
#[derive(Clone, Debug)]
struct Import {
    file: String,
    line: usize,
    path: String,
    target: String,
}

// ---------------------------------------------------------------- lexing --

/// The source with comments, string and char literals blanked out (lines
/// kept, so that line numbers stay right).
fn strip(src: &str) -> String {
    let b: Vec<char> = src.chars().collect();
    let mut out = String::with_capacity(src.len());
    let blank = |c: char, out: &mut String| out.push(if c == '\n' { '\n' } else { ' ' });
    let mut i = 0;
    while i < b.len() {
        let c = b[i];
        let next = b.get(i + 1).copied();
        if c == '/' && next == Some('/') {
            while i < b.len() && b[i] != '\n' {
                blank(b[i], &mut out);
                i += 1;
            }
        } else if c == '/' && next == Some('*') {
            let mut depth = 0;
            while i < b.len() {
                if b[i] == '/' && b.get(i + 1) == Some(&'*') {
                    depth += 1;
                    out.push_str("  ");
                    i += 2;
                } else if b[i] == '*' && b.get(i + 1) == Some(&'/') {
                    depth -= 1;
                    out.push_str("  ");
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    blank(b[i], &mut out);
                    i += 1;
                }
            }
        } else if c == 'r' && (next == Some('"') || next == Some('#')) && !prev_is_ident(&b, i) {
            // Raw string r"…" or r#"…"#.
            let mut j = i + 1;
            let mut hashes = 0;
            while b.get(j) == Some(&'#') {
                hashes += 1;
                j += 1;
            }
            if b.get(j) != Some(&'"') {
                out.push(c);
                i += 1;
                continue;
            }
            j += 1;
            loop {
                if j >= b.len() {
                    break;
                }
                if b[j] == '"' && (0..hashes).all(|k| b.get(j + 1 + k) == Some(&'#')) {
                    j += 1 + hashes;
                    break;
                }
                j += 1;
            }
            for &ch in &b[i..j.min(b.len())] {
                blank(ch, &mut out);
            }
            i = j;
        } else if c == '"' {
            blank(c, &mut out);
            i += 1;
            while i < b.len() && b[i] != '"' {
                if b[i] == '\\' {
                    blank(b[i], &mut out);
                    i += 1;
                }
                if i < b.len() {
                    blank(b[i], &mut out);
                    i += 1;
                }
            }
            if i < b.len() {
                blank(b[i], &mut out);
                i += 1;
            }
        } else if c == '\'' {
            // A char literal ('x', '\n', '\u{..}') or a lifetime ('a).
            let end = if next == Some('\\') {
                (i + 3..b.len()).find(|&j| b[j] == '\'')
            } else if b.get(i + 2) == Some(&'\'') {
                Some(i + 2)
            } else {
                None
            };
            match end {
                Some(e) => {
                    for &ch in &b[i..=e] {
                        blank(ch, &mut out);
                    }
                    i = e + 1;
                }
                None => {
                    out.push(c);
                    i += 1;
                }
            }
        } else {
            out.push(c);
            i += 1;
        }
    }
    out
}

fn prev_is_ident(b: &[char], i: usize) -> bool {
    i > 0 && (b[i - 1].is_alphanumeric() || b[i - 1] == '_')
}

#[derive(Clone, Debug, PartialEq)]
enum Tok {
    Ident(String),
    Path, // ::
    Punct(char),
}

fn tokens(src: &str) -> Vec<(Tok, usize)> {
    let b: Vec<char> = src.chars().collect();
    let mut out = Vec::new();
    let (mut i, mut line) = (0, 1);
    while i < b.len() {
        let c = b[i];
        if c == '\n' {
            line += 1;
            i += 1;
        } else if c.is_whitespace() {
            i += 1;
        } else if c.is_alphanumeric() || c == '_' {
            let s = i;
            while i < b.len() && (b[i].is_alphanumeric() || b[i] == '_') {
                i += 1;
            }
            out.push((Tok::Ident(b[s..i].iter().collect()), line));
        } else if c == ':' && b.get(i + 1) == Some(&':') {
            out.push((Tok::Path, line));
            i += 2;
        } else {
            out.push((Tok::Punct(c), line));
            i += 1;
        }
    }
    out
}

fn ident(t: Option<&(Tok, usize)>) -> Option<&str> {
    match t {
        Some((Tok::Ident(s), _)) => Some(s),
        _ => None,
    }
}

fn is(t: Option<&(Tok, usize)>, c: char) -> bool {
    matches!(t, Some((Tok::Punct(p), _)) if *p == c)
}

/// Index just past the item that starts at `i`: up to a `;` at depth 0 or
/// the end of the first balanced `{…}` block.
fn skip_item(toks: &[(Tok, usize)], mut i: usize) -> usize {
    let mut depth = 0i32;
    while i < toks.len() {
        match &toks[i].0 {
            Tok::Punct('{') | Tok::Punct('(') | Tok::Punct('[') => depth += 1,
            Tok::Punct('}') | Tok::Punct(')') | Tok::Punct(']') => {
                depth -= 1;
                if depth == 0 && toks[i].0 == Tok::Punct('}') {
                    return i + 1;
                }
            }
            Tok::Punct(';') if depth == 0 => return i + 1,
            _ => {}
        }
        i += 1;
    }
    i
}

/// Whether `toks[i..]` is `#[cfg(test)]`; returns the index past it.
fn cfg_test(toks: &[(Tok, usize)], i: usize) -> Option<usize> {
    let want = ["#", "[", "cfg", "(", "test", ")", "]"];
    for (k, w) in want.iter().enumerate() {
        let ok = match toks.get(i + k).map(|t| &t.0) {
            Some(Tok::Ident(s)) => s == w,
            Some(Tok::Punct(p)) => p.to_string() == *w,
            _ => false,
        };
        if !ok {
            return None;
        }
    }
    Some(i + want.len())
}

// -------------------------------------------------------------- parsing --

/// The first segments a `crate::` path names, starting at `toks[i]` (just
/// after `crate ::`): one for `crate::a::…`, several for `crate::{a, b::c}`.
fn first_segments(toks: &[(Tok, usize)], i: usize) -> Vec<String> {
    if let Some(s) = ident(toks.get(i)) {
        return vec![s.to_string()];
    }
    if !is(toks.get(i), '{') {
        return vec![];
    }
    let mut out = Vec::new();
    let mut depth = 0;
    let mut at_item_start = true;
    let mut j = i;
    while j < toks.len() {
        match &toks[j].0 {
            Tok::Punct('{') => {
                depth += 1;
                at_item_start = depth == 1;
            }
            Tok::Punct('}') => {
                depth -= 1;
                if depth == 0 {
                    break;
                }
            }
            Tok::Punct(',') if depth == 1 => at_item_start = true,
            Tok::Ident(s) if depth == 1 && at_item_start => {
                if s != "self" {
                    out.push(s.clone());
                }
                at_item_start = false;
            }
            _ => {}
        }
        j += 1;
    }
    out
}

/// A path found in a file: `(line, path text, first segment)`.
type Found = (usize, String, String);

/// What one file imports: a [`Found`] for every
/// `crate::` path (or `super::` path climbing to the root) outside
/// `#[cfg(test)]` items. `module` is the file's module path
/// (`["backends", "cuda"]` for `backends/cuda/mod.rs`). Also returns the
/// module paths that `#[cfg(test)] mod name;` declares (test-only files).
fn scan(src: &str, module: &[String]) -> (Vec<Found>, Vec<Vec<String>>) {
    let toks = tokens(&strip(src));
    let mut out = Vec::new();
    let mut test_mods = Vec::new();
    // Inline `mod name {` blocks we are inside: (name, brace depth at open).
    let mut inline: Vec<(String, i32)> = Vec::new();
    let mut depth = 0i32;
    let mut i = 0;
    while i < toks.len() {
        if let Some(after) = cfg_test(&toks, i) {
            // `#[cfg(test)] mod name;` names a test-only file.
            let mut k = after;
            while is(toks.get(k), '#') {
                k = skip_item(&toks, k + 1);
            }
            if ident(toks.get(k)) == Some("pub") {
                k += 1;
            }
            if ident(toks.get(k)) == Some("mod") && is(toks.get(k + 2), ';') {
                let mut m: Vec<String> = module.to_vec();
                m.extend(inline.iter().map(|(n, _)| n.clone()));
                m.push(ident(toks.get(k + 1)).unwrap_or_default().to_string());
                test_mods.push(m);
            }
            i = skip_item(&toks, after);
            continue;
        }
        match &toks[i].0 {
            Tok::Punct('{') => depth += 1,
            Tok::Punct('}') => {
                depth -= 1;
                if inline.last().is_some_and(|(_, d)| *d == depth) {
                    inline.pop();
                }
            }
            Tok::Ident(s) if s == "mod" => {
                if let (Some(name), true) = (ident(toks.get(i + 1)), is(toks.get(i + 2), '{')) {
                    inline.push((name.to_string(), depth));
                }
            }
            Tok::Ident(s) if s == "crate" && toks.get(i + 1).map(|t| &t.0) == Some(&Tok::Path) => {
                for seg in first_segments(&toks, i + 2) {
                    out.push((toks[i].1, format!("crate::{seg}"), seg));
                }
            }
            Tok::Ident(s) if s == "super" && !matches!(toks.get(i.wrapping_sub(1)).map(|t| &t.0), Some(Tok::Path)) => {
                // A `super::super::…` chain: where does it land?
                let mut here: Vec<String> = module.to_vec();
                here.extend(inline.iter().map(|(n, _)| n.clone()));
                let mut j = i;
                while ident(toks.get(j)) == Some("super") && toks.get(j + 1).map(|t| &t.0) == Some(&Tok::Path) {
                    here.pop();
                    j += 2;
                }
                if here.is_empty() {
                    for seg in first_segments(&toks, j) {
                        out.push((toks[i].1, format!("super::{seg}"), seg));
                    }
                }
            }
            _ => {}
        }
        i += 1;
    }
    (out, test_mods)
}

/// Root re-exports and root items of `lib.rs`: name → defining module.
fn root_names(lib: &str) -> BTreeMap<String, String> {
    let toks = tokens(&strip(lib));
    let mut names = BTreeMap::new();
    let mut i = 0;
    while i < toks.len() {
        match ident(toks.get(i)) {
            Some("mod") => {
                if let Some(m) = ident(toks.get(i + 1)) {
                    // A module declared in lib.rs; an inline one (`cuda_check`)
                    // is part of lib.rs's own layer.
                    let inline = is(toks.get(i + 2), '{');
                    names.insert(m.to_string(), if inline { "lib".to_string() } else { m.to_string() });
                }
            }
            Some("use") if ident(toks.get(i.wrapping_sub(1))) == Some("pub") => {
                // pub use module::…::{A, B as C};
                let end = skip_item(&toks, i);
                let module = ident(toks.get(i + 1)).unwrap_or_default().to_string();
                let mut last: Option<String> = None;
                for (t, _) in &toks[i + 1..end] {
                    match t {
                        Tok::Ident(s) if s == "as" => {}
                        Tok::Ident(s) => last = Some(s.clone()),
                        Tok::Punct(',') | Tok::Punct('}') | Tok::Punct(';') => {
                            if let Some(n) = last.take() {
                                names.insert(n, module.clone());
                            }
                        }
                        _ => {}
                    }
                }
                i = end;
                continue;
            }
            Some("macro_rules") => {
                if let Some(m) = ident(toks.get(i + 2)) {
                    names.insert(m.to_string(), "lib".to_string());
                }
            }
            Some("struct") | Some("fn") | Some("enum") | Some("const") | Some("static") | Some("type") => {
                if let Some(m) = ident(toks.get(i + 1)) {
                    names.entry(m.to_string()).or_insert_with(|| "lib".to_string());
                }
            }
            _ => {}
        }
        i += 1;
    }
    names
}

/// `#[macro_export]` macros (reached as `crate::name!`): name → module of
/// the file that defines them.
fn exported_macros(files: &[(Vec<String>, String)]) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    for (module, src) in files {
        let toks = tokens(&strip(src));
        for w in toks.windows(3) {
            if ident(Some(&w[0])) == Some("macro_rules")
                && let Some(name) = ident(Some(&w[2]))
            {
                out.insert(name.to_string(), module.first().cloned().unwrap_or_else(|| "lib".into()));
            }
        }
    }
    out
}

fn rs_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let mut entries: Vec<_> = std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().path()).collect();
    entries.sort();
    for p in entries {
        if p.is_dir() {
            rs_files(&p, out);
        } else if p.extension().is_some_and(|e| e == "rs") {
            out.push(p);
        }
    }
}

/// The module path of a file: `backends/cuda/mod.rs` → `[backends, cuda]`,
/// `lib.rs` → `[]`.
fn module_path(rel: &Path) -> Vec<String> {
    let mut parts: Vec<String> = rel.iter().map(|s| s.to_string_lossy().into_owned()).collect();
    let last = parts.pop().unwrap();
    let stem = last.trim_end_matches(".rs");
    if stem != "mod" && stem != "lib" {
        parts.push(stem.to_string());
    }
    parts
}

/// Every import of every non-test file under `src`, resolved to top-level
/// modules; errors for names that resolve to nothing.
fn read_crate(src: &Path) -> (Vec<Import>, Vec<String>) {
    let mut paths = Vec::new();
    rs_files(src, &mut paths);
    let files: Vec<(Vec<String>, String, String)> = paths
        .iter()
        .map(|p| {
            let rel = p.strip_prefix(src).unwrap();
            (module_path(rel), rel.to_string_lossy().replace('\\', "/"), std::fs::read_to_string(p).unwrap())
        })
        .collect();
    let lib = &files.iter().find(|f| f.1 == "lib.rs").expect("src/lib.rs").2;
    let roots = root_names(lib);
    let macros = exported_macros(&files.iter().map(|f| (f.0.clone(), f.2.clone())).collect::<Vec<_>>());

    let scanned: Vec<_> = files.iter().map(|(m, rel, text)| (m, rel, scan(text, m))).collect();
    let test_only: Vec<Vec<String>> = scanned.iter().flat_map(|(_, _, (_, t))| t.clone()).collect();

    let mut imports = Vec::new();
    let mut errors = Vec::new();
    for (module, rel, (found, _)) in &scanned {
        if test_only.iter().any(|t| module.starts_with(t)) {
            continue;
        }
        let from = module.first().cloned().unwrap_or_else(|| "lib".into());
        for (line, path, seg) in found {
            let target = match roots.get(seg).or_else(|| macros.get(seg)) {
                Some(t) => t.clone(),
                None => {
                    errors.push(format!("{rel}:{line}: `{path}` names nothing lib.rs declares or re-exports"));
                    continue;
                }
            };
            if target != from {
                imports.push(Import { file: rel.to_string(), line: *line, path: path.clone(), target });
            }
        }
    }
    (imports, errors)
}

fn top_of(file: &str) -> String {
    match file.split_once('/') {
        Some((dir, _)) => dir.to_string(),
        None if file == "lib.rs" => "lib".to_string(),
        None => file.trim_end_matches(".rs").to_string(),
    }
}

// ------------------------------------------------------------- checking --

type Graph = BTreeMap<String, BTreeSet<String>>;

fn graph_of(imports: &[Import]) -> Graph {
    let mut g = Graph::new();
    for i in imports {
        g.entry(top_of(&i.file)).or_default().insert(i.target.clone());
        g.entry(i.target.clone()).or_default();
    }
    g
}

/// A cycle in `g`, as the list of modules around it (first repeated last),
/// if there is one.
fn find_cycle(g: &Graph) -> Option<Vec<String>> {
    fn visit(n: &str, g: &Graph, state: &mut BTreeMap<String, u8>, stack: &mut Vec<String>) -> Option<Vec<String>> {
        state.insert(n.to_string(), 1);
        stack.push(n.to_string());
        for m in g.get(n).into_iter().flatten() {
            match state.get(m).copied().unwrap_or(0) {
                1 => {
                    let at = stack.iter().position(|s| s == m).unwrap();
                    let mut cycle = stack[at..].to_vec();
                    cycle.push(m.clone());
                    return Some(cycle);
                }
                0 => {
                    if let Some(c) = visit(m, g, state, stack) {
                        return Some(c);
                    }
                }
                _ => {}
            }
        }
        stack.pop();
        state.insert(n.to_string(), 2);
        None
    }
    let mut state = BTreeMap::new();
    for n in g.keys() {
        if state.get(n).copied().unwrap_or(0) == 0
            && let Some(c) = visit(n, g, &mut state, &mut Vec::new())
        {
            return Some(c);
        }
    }
    None
}

fn rank(layers: &[&[&str]], m: &str) -> Option<usize> {
    layers.iter().position(|l| l.contains(&m))
}

/// Edges that go up the layers, and modules placed in no layer.
fn upward_edges(g: &Graph, layers: &[&[&str]]) -> Vec<String> {
    let mut out = Vec::new();
    for (from, tos) in g {
        let Some(rf) = rank(layers, from) else {
            out.push(format!("module `{from}` is in no layer: place it in LAYERS"));
            continue;
        };
        for to in tos {
            match rank(layers, to) {
                Some(rt) if rt > rf => out.push(format!("{from} (layer {rf}) imports {to} (layer {rt}), above it")),
                _ => {}
            }
        }
    }
    out
}

fn src_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

fn where_(imports: &[Import], from: &str, to: &str) -> String {
    imports
        .iter()
        .filter(|i| top_of(&i.file) == from && i.target == to)
        .take(3)
        .map(|i| format!("{}:{} `{}`", i.file, i.line, i.path))
        .collect::<Vec<_>>()
        .join(", ")
}

#[test]
fn layers_hold() {
    let (imports, errors) = read_crate(&src_dir());
    assert!(errors.is_empty(), "unresolved crate paths:\n{}", errors.join("\n"));
    let g = graph_of(&imports);
    assert!(g.len() >= 10, "the scan found only {} modules: the parser is broken", g.len());

    // 1. No cycle.
    if let Some(cycle) = find_cycle(&g) {
        let steps: Vec<String> = cycle.windows(2).map(|w| format!("  {} -> {}: {}", w[0], w[1], where_(&imports, &w[0], &w[1]))).collect();
        panic!("import cycle among kiln's modules: {}\n{}", cycle.join(" -> "), steps.join("\n"));
    }

    // 2. Every edge goes down.
    let up = upward_edges(&g, LAYERS);
    let detail: Vec<String> = up.iter().map(|u| u.to_string()).collect();
    assert!(up.is_empty(), "imports against the layers:\n{}", detail.join("\n"));

    // 3. Below the front end, nothing imports it.
    let bad: Vec<String> = imports
        .iter()
        .filter(|i| BELOW_FRONT_END.contains(&top_of(&i.file).as_str()) && FRONT_END.contains(&i.target.as_str()))
        .map(|i| format!("{}:{}: `{}` ({} is above the backends)", i.file, i.line, i.path, i.target))
        .collect();
    assert!(bad.is_empty(), "a file below the front end imports it:\n{}", bad.join("\n"));

    // 4. The device vocabulary names no backend.
    let bad: Vec<String> = imports
        .iter()
        .filter(|i| i.file.starts_with("base/") && i.target == "backends")
        .map(|i| format!("{}:{}: `{}`", i.file, i.line, i.path))
        .collect();
    assert!(bad.is_empty(), "base/ names a backend:\n{}", bad.join("\n"));
    let base_text: String = {
        let mut files = Vec::new();
        rs_files(&src_dir().join("base"), &mut files);
        files.iter().map(|p| strip(&std::fs::read_to_string(p).unwrap())).collect()
    };
    for name in ["backends", "SimBackend", "CudaBackend", "CpuBackend"] {
        assert!(!tokens(&base_text).iter().any(|(t, _)| *t == Tok::Ident(name.to_string())), "base/ names the backend item `{name}`");
    }

    println!("layer order verified (bottom first; a module imports only its own layer or lower ones):");
    for (r, layer) in LAYERS.iter().enumerate() {
        println!("  {r:2}: {}", layer.join(", "));
    }
    println!("edges:");
    for (from, tos) in &g {
        println!("  {from} -> {}", tos.iter().cloned().collect::<Vec<_>>().join(", "));
    }
}

/// The checker itself finds what it must: a synthetic graph with a cycle,
/// an upward edge, and source text whose imports hide in groups, comments
/// and test modules.
#[test]
fn checker_finds_planted_violations() {
    let mut g = Graph::new();
    for (a, b) in [("base", "runtime"), ("runtime", "kernel"), ("kernel", "base"), ("ops", "base")] {
        g.entry(a.into()).or_default().insert(b.into());
        g.entry(b.into()).or_default();
    }
    let cycle = find_cycle(&g).expect("the planted cycle base -> runtime -> kernel -> base is found");
    assert_eq!(cycle.first(), cycle.last());
    for m in ["base", "runtime", "kernel"] {
        assert!(cycle.contains(&m.to_string()), "{cycle:?}");
    }
    assert!(!cycle.contains(&"ops".to_string()));
    g.get_mut("kernel").unwrap().clear();
    assert_eq!(find_cycle(&g), None);
    let up = upward_edges(&g, LAYERS);
    assert_eq!(up.len(), 2, "{up:?}");
    assert!(up[0].contains("base (layer 0) imports runtime"), "{up:?}");
    assert!(up[1].contains("runtime (layer 1) imports kernel"), "{up:?}");
    g.entry("novel".into()).or_default();
    assert!(upward_edges(&g, LAYERS).iter().any(|u| u.contains("`novel` is in no layer")));

    let src = r#"
        use crate::{base::device::Device, tensor::{Tensor, Dim}, Result};
        use super::super::ops::x; // from [a, b]: lands at the root
        // use crate::nn::Module;
        /// [`crate::trainer::Trainer`]
        fn f() { let s = "crate::optim"; let c = '"'; crate::registry::backend(d); }
        mod inner { use super::super::super::data::D; }
        #[cfg(test)]
        mod tests { use crate::autograd::x; }
        #[cfg(test)]
        mod helpers;
    "#;
    let (found, test_mods) = scan(src, &["a".into(), "b".into()]);
    let segs: Vec<&str> = found.iter().map(|(_, _, s)| s.as_str()).collect();
    assert_eq!(segs, ["base", "tensor", "Result", "ops", "registry", "data"]);
    assert_eq!(found[3].0, 3, "line numbers are kept");
    assert_eq!(test_mods, [vec!["a".to_string(), "b".into(), "helpers".into()]]);
}
