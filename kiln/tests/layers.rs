//! The layer check: kiln's modules form layers in which control only goes
//! down, and this test fails when the source says otherwise.
//!
//! ```text
//!   lib.rs (re-exports, cuda_check)                       top
//!   trainer
//!   optim   checkpoint   io   models   dist
//!   nn   data   comm   sim
//!   ops          the front end's operations (one op, one file)
//!   autograd     the tape and backward
//!   tensor   host_nn
//!   registry     which devices exist; builds the backends
//!   backends     cpu, host, sim, cuda: one folder each
//!   kernel       the Backend trait, Storage, the kernel contract
//!   runtime      memory pools, ledger, rng, threads
//!   base         device vocabulary, dtype, shape, errors, CpuBuffer  bottom
//! ```
//!
//! The crate is read with `syn`, as rustc would find it: from `lib.rs`
//! through every `mod` declaration (inline or in its own file), skipping
//! `#[cfg(test)]` and `#[cfg(doctest)]` items, so a unit test of a lower
//! layer may drive it through the front end. Every path a module writes is
//! resolved by name to the module that defines what it names:
//! - `use` trees (groups, renames, `self`, globs) at any depth, including
//!   inside function bodies and macro bodies (`$crate::…`);
//! - `crate::`, `$crate::`, `super::` and `self::` paths in any expression,
//!   type or attribute argument;
//! - paths whose first segment is a name the module has in scope (a child
//!   module, a `use` alias, or a name brought in by a glob such as
//!   `use super::*`), and single names that only a glob brings in;
//! - through re-exports (`pub use`) at every level, so `crate::Tensor`
//!   lands on `tensor`, and `#[macro_export]` macros (`crate::kernel_args!`)
//!   on the module whose file defines them.
//!
//! A path that starts at the crate but names nothing fails the test (the
//! reader is then wrong, not the code). Names the crate does not define
//! (`std`, other crates, locals) are not imports.
//!
//! Each resolved path is an edge from the module where it is written to the
//! module it reaches. At the top level, the rules are:
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
//! And inside every module:
//! 5. its child modules import each other without a cycle (an edge from
//!    `a::x::…` to `a::y::…` is an edge `x → y` among `a`'s children).
//!    A parent using its children, or a child using what its parent
//!    defines, is not an edge between siblings.
//!
//! What the rules allow, stated precisely: an op's CUDA kernel is declared
//! in its own file under `ops/` and *registered* with `inventory::submit!`
//! into a list that `kernel/cuda.rs` defines; `backends/cuda` then finds it
//! by name through `kernel::cuda::declared_modules()`. That is an edge
//! ops → kernel (down); the backend never names the op. Doc comments and
//! doc links (`[`crate::Tensor`]`) are not imports and are not read.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use proc_macro2::{Delimiter, Spacing, TokenStream, TokenTree};
use quote::ToTokens;

/// The layers, bottom first. A module may import modules of its own layer
/// or of a lower one.
const LAYERS: &[&[&str]] = &[
    &["base"],
    &["runtime"],
    &["kernel"],
    &["backends"],
    &["registry"],
    // host_nn: kernels over host slices, beside the Tensor handle.
    &["tensor", "host_nn"],
    &["autograd"],
    &["ops"],
    &["nn", "data", "comm", "sim"],
    &["optim", "checkpoint", "io", "models", "dist"],
    &["trainer"],
    // lib.rs's own items and its inline module of NVRTC checks.
    &["lib", "cuda_check"],
];

/// Modules below the front end: they must not import it.
const BELOW_FRONT_END: &[&str] = &["base", "runtime", "kernel", "backends"];
/// The front end (and the registry above the backends).
const FRONT_END: &[&str] =
    &["registry", "tensor", "autograd", "ops", "nn", "optim", "data", "comm", "sim", "dist", "trainer", "checkpoint", "io"];

/// A module path from the crate root: `[]` is the root, `[backends, cuda]`
/// is `crate::backends::cuda`.
type ModPath = Vec<String>;

/// What a module has in scope by its own declarations.
#[derive(Default, Debug)]
struct Module {
    /// The source file that holds it (relative to `src/`).
    file: String,
    children: BTreeSet<String>,
    /// Items it defines (functions, types, traits, consts, statics, macros).
    items: BTreeSet<String>,
    /// Names that item-level macro calls in it may define (looked up after
    /// its `use` names, so that a re-export is never shadowed by a guess).
    macro_made: BTreeSet<String>,
    /// `use` names: the name in this module → the path as written here.
    aliases: BTreeMap<String, Vec<String>>,
    /// `use path::*;` sources, as written here.
    globs: Vec<Vec<String>>,
}

/// A path written in a module.
#[derive(Clone, Debug)]
struct Written {
    module: ModPath,
    file: String,
    line: usize,
    path: Vec<String>,
    /// Read from the tokens of an item (a function body, a macro), not
    /// from a module-level `use`.
    in_item: bool,
}

/// The crate as the checker sees it.
#[derive(Default, Debug)]
struct Crate {
    modules: BTreeMap<ModPath, Module>,
    /// `#[macro_export]` macros, reached as `crate::name!`: name → module.
    exported_macros: BTreeMap<String, ModPath>,
    written: Vec<Written>,
    errors: Vec<String>,
    /// (module, name) glob searches under way, to end cycles of globs.
    globbing: std::cell::RefCell<BTreeSet<(ModPath, String)>>,
    /// Item-level macro calls: (module, macro name, the names the call's
    /// own text declares: an identifier before a `{ … }` body).
    macro_calls: Vec<(ModPath, String, Vec<String>)>,
    /// `macro_rules!` definitions: name → the item names their bodies
    /// spell out (`pub enum UnaryOp`).
    macro_items: BTreeMap<String, Vec<String>>,
}

const ITEM_KEYWORDS: &[&str] = &["struct", "enum", "fn", "trait", "type", "const", "static", "union"];

/// Names after an item keyword in the top-level groups of a
/// `macro_rules!` body (each rule's expansion), not deeper: an `impl`
/// block's methods are not items of the module.
fn keyword_names(ts: TokenStream, out: &mut Vec<String>) {
    for t in ts {
        if let TokenTree::Group(g) = t {
            let tts: Vec<TokenTree> = g.stream().into_iter().collect();
            for (i, t) in tts.iter().enumerate() {
                if let TokenTree::Ident(k) = t
                    && ITEM_KEYWORDS.contains(&k.to_string().as_str())
                    && let Some(TokenTree::Ident(n)) = tts.get(i + 1)
                {
                    out.push(n.to_string());
                }
            }
        }
    }
}

/// `#[cfg(...)]` that holds only under `test` or `doctest`: the item is
/// compiled for tests alone. `cfg(any(test, feature = "x"))` ships.
fn test_only(attrs: &[syn::Attribute]) -> bool {
    fn requires_test(meta: &syn::Meta) -> bool {
        let nested = |l: &syn::MetaList| -> Vec<syn::Meta> {
            l.parse_args_with(syn::punctuated::Punctuated::<syn::Meta, syn::Token![,]>::parse_terminated)
                .map(|p| p.into_iter().collect())
                .unwrap_or_default()
        };
        match meta {
            syn::Meta::Path(p) => p.is_ident("test") || p.is_ident("doctest"),
            syn::Meta::List(l) if l.path.is_ident("all") => nested(l).iter().any(requires_test),
            syn::Meta::List(l) if l.path.is_ident("any") => {
                let parts = nested(l);
                !parts.is_empty() && parts.iter().all(requires_test)
            }
            syn::Meta::List(_) | syn::Meta::NameValue(_) => false,
        }
    }
    attrs.iter().any(|a| a.path().is_ident("cfg") && a.parse_args::<syn::Meta>().is_ok_and(|m| requires_test(&m)))
}

fn idents(ts: TokenStream) -> Vec<String> {
    let mut out = Vec::new();
    for t in ts {
        match t {
            TokenTree::Ident(i) => out.push(i.to_string()),
            TokenTree::Group(g) => out.extend(idents(g.stream())),
            _ => {}
        }
    }
    out
}

fn line_of(span: proc_macro2::Span) -> usize {
    span.start().line
}

/// Every (name or glob, path) a use tree declares. `name` is `None` for a
/// glob and for `_`.
fn use_paths(tree: &syn::UseTree, prefix: &mut Vec<String>, out: &mut Vec<(Option<String>, Vec<String>)>) {
    match tree {
        syn::UseTree::Path(p) => {
            prefix.push(p.ident.to_string());
            use_paths(&p.tree, prefix, out);
            prefix.pop();
        }
        syn::UseTree::Name(n) => {
            let name = n.ident.to_string();
            if name == "self" {
                out.push((prefix.last().cloned(), prefix.clone()));
            } else {
                let mut p = prefix.clone();
                p.push(name.clone());
                out.push((Some(name), p));
            }
        }
        syn::UseTree::Rename(r) => {
            let mut p = prefix.clone();
            if r.ident != "self" {
                p.push(r.ident.to_string());
            }
            let name = r.rename.to_string();
            out.push(((name != "_").then_some(name), p));
        }
        syn::UseTree::Glob(_) => {
            let mut p = prefix.clone();
            p.push("*".into());
            out.push((None, p));
        }
        syn::UseTree::Group(g) => {
            for t in &g.items {
                use_paths(t, prefix, out);
            }
        }
    }
}

fn is_path_sep(tts: &[TokenTree], j: usize) -> bool {
    matches!((tts.get(j), tts.get(j + 1)), (Some(TokenTree::Punct(a)), Some(TokenTree::Punct(b)))
        if a.as_char() == ':' && a.spacing() == Spacing::Joint && b.as_char() == ':')
}

/// The paths that continue `prefix` from `tts[j..]`: `::seg` repeated, a
/// brace group of further paths (`::{a, b::c, self}`), or a glob. Returns
/// the paths and the index after them.
fn follow(tts: &[TokenTree], mut j: usize, mut prefix: Vec<String>) -> (Vec<Vec<String>>, usize) {
    while is_path_sep(tts, j) {
        match tts.get(j + 2) {
            Some(TokenTree::Ident(i)) => {
                prefix.push(i.to_string());
                j += 3;
            }
            Some(TokenTree::Group(g)) if g.delimiter() == Delimiter::Brace => {
                let inner: Vec<TokenTree> = g.stream().into_iter().collect();
                let mut out = Vec::new();
                for piece in inner.split(|t| matches!(t, TokenTree::Punct(p) if p.as_char() == ',')) {
                    match piece.first() {
                        Some(TokenTree::Ident(i)) if i == "self" => out.push(prefix.clone()),
                        Some(TokenTree::Ident(i)) => {
                            let mut p = prefix.clone();
                            p.push(i.to_string());
                            out.extend(follow(piece, 1, p).0);
                        }
                        Some(TokenTree::Punct(p)) if p.as_char() == '*' => {
                            let mut p = prefix.clone();
                            p.push("*".into());
                            out.push(p);
                        }
                        _ => {}
                    }
                }
                return (out, j + 3);
            }
            Some(TokenTree::Punct(p)) if p.as_char() == '*' => {
                prefix.push("*".into());
                return (vec![prefix], j + 3);
            }
            _ => break,
        }
    }
    (vec![prefix], j)
}

/// Every path written in `ts` (with its line): a path starts at an
/// identifier that does not follow `::` or `.`; `$crate` is `crate`.
fn token_paths(ts: TokenStream, out: &mut Vec<(usize, Vec<String>)>) {
    let tts: Vec<TokenTree> = ts.into_iter().collect();
    let mut i = 0;
    while i < tts.len() {
        match &tts[i] {
            TokenTree::Group(g) => {
                token_paths(g.stream(), out);
                i += 1;
            }
            TokenTree::Ident(id) => {
                let after_sep = i >= 2 && is_path_sep(&tts, i - 2);
                // `x.field` and `x.method()`, but not `..crate::X` (a range
                // or a struct update).
                let is_dot = |j: usize| matches!(&tts[j], TokenTree::Punct(p) if p.as_char() == '.');
                let after_dot = i >= 1 && is_dot(i - 1) && !(i >= 2 && is_dot(i - 2));
                if after_sep || after_dot {
                    i += 1;
                    continue;
                }
                let first = id.to_string();
                let (paths, next) = follow(&tts, i + 1, vec![first]);
                for p in paths {
                    out.push((line_of(id.span()), p));
                }
                i = next.max(i + 1);
            }
            TokenTree::Punct(_) | TokenTree::Literal(_) => i += 1,
        }
    }
}

impl Crate {
    fn read(src: &Path) -> Crate {
        let mut c = Crate::default();
        c.read_file(src, Path::new("lib.rs"), Vec::new());
        // What item-level macro calls define: the names their macro's body
        // spells out, and the names the call itself declares.
        for (module, mac, declared) in std::mem::take(&mut c.macro_calls) {
            let defined = c.macro_items.get(&mac).cloned().unwrap_or_default();
            if let Some(m) = c.modules.get_mut(&module) {
                m.macro_made.extend(defined.into_iter().chain(declared));
            }
        }
        c
    }

    fn read_file(&mut self, src: &Path, rel: &Path, module: ModPath) {
        let text = match std::fs::read_to_string(src.join(rel)) {
            Ok(t) => t,
            Err(e) => {
                self.errors.push(format!("{}: cannot read: {e}", rel.display()));
                return;
            }
        };
        let file = match syn::parse_file(&text) {
            Ok(f) => f,
            Err(e) => {
                self.errors.push(format!("{}:{}: syn cannot parse it: {e}", rel.display(), line_of(e.span())));
                return;
            }
        };
        // Where this file's out-of-line child modules live.
        let dir = match rel.file_name().and_then(|n| n.to_str()) {
            Some("lib.rs") | Some("mod.rs") => rel.parent().unwrap_or(Path::new("")).to_path_buf(),
            _ => rel.with_extension(""),
        };
        self.read_items(src, &dir, rel, module, &file.items);
    }

    fn read_items(&mut self, src: &Path, dir: &Path, rel: &Path, module: ModPath, items: &[syn::Item]) {
        let file = rel.to_string_lossy().replace('\\', "/");
        self.modules.entry(module.clone()).or_default().file = file.clone();
        for item in items {
            let attrs: &[syn::Attribute] = match item {
                syn::Item::Const(i) => &i.attrs,
                syn::Item::Enum(i) => &i.attrs,
                syn::Item::ExternCrate(i) => &i.attrs,
                syn::Item::Fn(i) => &i.attrs,
                syn::Item::ForeignMod(i) => &i.attrs,
                syn::Item::Impl(i) => &i.attrs,
                syn::Item::Macro(i) => &i.attrs,
                syn::Item::Mod(i) => &i.attrs,
                syn::Item::Static(i) => &i.attrs,
                syn::Item::Struct(i) => &i.attrs,
                syn::Item::Trait(i) => &i.attrs,
                syn::Item::TraitAlias(i) => &i.attrs,
                syn::Item::Type(i) => &i.attrs,
                syn::Item::Union(i) => &i.attrs,
                syn::Item::Use(i) => &i.attrs,
                _ => &[],
            };
            if test_only(attrs) {
                continue;
            }
            let defines = |this: &mut Crate, name: String| {
                this.modules.get_mut(&module).expect("module entered above").items.insert(name);
            };
            match item {
                syn::Item::Mod(m) => {
                    let name = m.ident.to_string();
                    if m.attrs.iter().any(|a| a.path().is_ident("path")) {
                        self.errors.push(format!(
                            "{file}: `mod {name}` has a #[path]: the layer check reads modules where rustc finds them by default"
                        ));
                        continue;
                    }
                    self.modules.get_mut(&module).expect("module entered above").children.insert(name.clone());
                    let mut child = module.clone();
                    child.push(name.clone());
                    if let Some((_, inner)) = &m.content {
                        self.read_items(src, &dir.join(&name), rel, child, inner);
                    } else {
                        let flat = dir.join(format!("{name}.rs"));
                        let folder = dir.join(&name).join("mod.rs");
                        if src.join(&flat).is_file() {
                            self.read_file(src, &flat, child);
                        } else if src.join(&folder).is_file() {
                            self.read_file(src, &folder, child);
                        } else {
                            self.errors.push(format!("{file}: `mod {name};` has neither {} nor {}", flat.display(), folder.display()));
                        }
                    }
                }
                syn::Item::Use(u) => {
                    let mut found = Vec::new();
                    use_paths(&u.tree, &mut Vec::new(), &mut found);
                    let line = line_of(u.use_token.span);
                    let m = self.modules.get_mut(&module).expect("module entered above");
                    for (name, path) in found {
                        if path.last().is_some_and(|s| s == "*") {
                            m.globs.push(path[..path.len() - 1].to_vec());
                        } else if let Some(name) = name {
                            m.aliases.insert(name, path.clone());
                        }
                        self.written.push(Written { module: module.clone(), file: file.clone(), line, path, in_item: false });
                    }
                }
                other => {
                    let name = match other {
                        syn::Item::Const(i) => Some(i.ident.to_string()),
                        syn::Item::Enum(i) => Some(i.ident.to_string()),
                        syn::Item::Fn(i) => Some(i.sig.ident.to_string()),
                        syn::Item::Static(i) => Some(i.ident.to_string()),
                        syn::Item::Struct(i) => Some(i.ident.to_string()),
                        syn::Item::Trait(i) => Some(i.ident.to_string()),
                        syn::Item::TraitAlias(i) => Some(i.ident.to_string()),
                        syn::Item::Type(i) => Some(i.ident.to_string()),
                        syn::Item::Union(i) => Some(i.ident.to_string()),
                        syn::Item::Macro(i) => i.ident.as_ref().map(|n| n.to_string()),
                        _ => None,
                    };
                    if let Some(name) = name {
                        if let syn::Item::Macro(mac) = other
                            && mac.attrs.iter().any(|a| a.path().is_ident("macro_export"))
                        {
                            self.exported_macros.insert(name.clone(), module.clone());
                        }
                        defines(self, name);
                    }
                    if let syn::Item::Macro(mac) = other {
                        let name = mac.mac.path.segments.last().map(|s| s.ident.to_string()).unwrap_or_default();
                        if let Some(def) = &mac.ident {
                            let mut names = Vec::new();
                            keyword_names(mac.mac.tokens.clone(), &mut names);
                            self.macro_items.insert(def.to_string(), names);
                        } else {
                            let tts: Vec<TokenTree> = mac.mac.tokens.clone().into_iter().collect();
                            let declared = tts
                                .windows(2)
                                .filter_map(|w| match w {
                                    [TokenTree::Ident(n), TokenTree::Group(g)] if g.delimiter() == Delimiter::Brace => Some(n.to_string()),
                                    _ => None,
                                })
                                .collect();
                            self.macro_calls.push((module.clone(), name, declared));
                        }
                    }
                    if let syn::Item::ForeignMod(f) = other {
                        for fi in &f.items {
                            if let syn::ForeignItem::Fn(func) = fi {
                                defines(self, func.sig.ident.to_string());
                            }
                        }
                    }
                    let mut found = Vec::new();
                    token_paths(other.to_token_stream(), &mut found);
                    for (line, path) in found {
                        self.written.push(Written { module: module.clone(), file: file.clone(), line, path, in_item: true });
                    }
                }
            }
        }
    }
}

// ------------------------------------------------------------- resolving --

/// What a path reaches: a module itself, or an item defined in a module.
#[derive(Clone, Debug, PartialEq)]
enum Reached {
    Module(ModPath),
    Item(ModPath),
}

impl Reached {
    fn module(&self) -> &ModPath {
        match self {
            Reached::Module(m) | Reached::Item(m) => m,
        }
    }
}

const DEPTH: usize = 24;

impl Crate {
    /// `name` looked up in module `m`'s own scope: its items, children,
    /// `use` names, then its globs.
    fn lookup(&self, m: &ModPath, name: &str, depth: usize) -> Option<Reached> {
        let module = self.modules.get(m)?;
        assert!(depth <= DEPTH, "resolving `{name}` in crate::{} went {DEPTH} re-exports deep: a cycle of `use`s?", m.join("::"));
        if m.is_empty()
            && let Some(def) = self.exported_macros.get(name)
        {
            return Some(Reached::Item(def.clone()));
        }
        if module.children.contains(name) {
            let mut c = m.clone();
            c.push(name.to_string());
            return Some(Reached::Module(c));
        }
        if module.items.contains(name) {
            return Some(Reached::Item(m.clone()));
        }
        if let Some(path) = module.aliases.get(name) {
            // A name imported from another crate (or a broken path, which
            // its `use` reports) ends here: no edge inside this crate.
            return Some(self.resolve(m, path, depth + 1).ok().flatten().unwrap_or_else(|| Reached::Item(m.clone())));
        }
        if module.macro_made.contains(name) {
            return Some(Reached::Item(m.clone()));
        }
        self.through_globs(m, name, depth)
    }

    fn through_globs(&self, m: &ModPath, name: &str, depth: usize) -> Option<Reached> {
        // Two modules may glob each other (`use super::*` beside the
        // parent's `use child::*`): a search already under way for this
        // name here finds nothing more by coming back.
        let key = (m.clone(), name.to_string());
        if !self.globbing.borrow_mut().insert(key.clone()) {
            return None;
        }
        let found = self.through_globs_once(m, name, depth);
        self.globbing.borrow_mut().remove(&key);
        found
    }

    fn through_globs_once(&self, m: &ModPath, name: &str, depth: usize) -> Option<Reached> {
        for g in &self.modules.get(m)?.globs {
            if let Ok(Some(Reached::Module(source))) = self.resolve(m, g, depth + 1)
                && let Some(r) = self.lookup(&source, name, depth + 1)
            {
                return Some(r);
            }
        }
        None
    }

    /// Resolves `path` as written in module `m`. `Ok(None)`: the path does
    /// not start at anything this crate defines (std, another crate, a
    /// local). `Err`: it starts in the crate but names nothing there.
    fn resolve(&self, m: &ModPath, path: &[String], depth: usize) -> Result<Option<Reached>, String> {
        let Some(first) = path.first() else { return Ok(None) };
        let mut at = match first.as_str() {
            "crate" => Reached::Module(Vec::new()),
            "self" => Reached::Module(m.clone()),
            "super" => {
                let mut up = m.clone();
                if up.pop().is_none() {
                    return Err("`super` at the crate root".into());
                }
                Reached::Module(up)
            }
            name => match self.lookup(m, name, depth) {
                Some(r) => r,
                None => return Ok(None),
            },
        };
        for seg in &path[1..] {
            let Reached::Module(here) = &at else { break };
            if seg == "*" {
                break;
            }
            at = if seg == "super" {
                let mut up = here.clone();
                if up.pop().is_none() {
                    return Err("`super` at the crate root".into());
                }
                Reached::Module(up)
            } else {
                match self.lookup(here, seg, depth) {
                    Some(r) => r,
                    None => return Err(format!("`{seg}` is not in `crate::{}`", here.join("::"))),
                }
            };
        }
        Ok(Some(at))
    }

    /// Every written path that reaches a module other than its own, with
    /// the module it reaches; errors for crate paths that name nothing.
    fn edges(&self) -> (Vec<(Written, ModPath)>, Vec<String>) {
        let mut out = Vec::new();
        let mut errors = self.errors.clone();
        for w in &self.written {
            if w.in_item && w.path.last().is_some_and(|s| s == "*") {
                // What a module's glob brings into a function is invisible
                // here (an enum's variants are harmless).
                if let Ok(Some(Reached::Module(_))) = self.resolve(&w.module, &w.path[..w.path.len() - 1], 0) {
                    errors.push(format!("{}:{}: `use {}` inside an item: import the names it needs", w.file, w.line, w.path.join("::")));
                }
                continue;
            }
            let anchored = matches!(w.path[0].as_str(), "crate" | "super" | "self");
            if w.path.len() == 1 && anchored {
                // `pub(crate)`, `pub(super)`, a `self` receiver.
                continue;
            }
            if w.path.len() == 1 {
                // A lone name: an import only when a glob brings it in (a
                // `use` alias or a child is an edge where it is declared).
                if let Some(r) = self.through_globs(&w.module, &w.path[0], 0)
                    && r.module() != &w.module
                {
                    out.push((w.clone(), r.module().clone()));
                }
                continue;
            }
            match self.resolve(&w.module, &w.path, 0) {
                Ok(Some(r)) => {
                    if r.module() != &w.module {
                        out.push((w.clone(), r.module().clone()));
                    }
                }
                Ok(None) => {}
                Err(why) => errors.push(format!("{}:{}: `{}`: {why}", w.file, w.line, w.path.join("::"))),
            }
        }
        (out, errors)
    }
}

// ------------------------------------------------------------- checking --

type Graph = BTreeMap<String, BTreeSet<String>>;

/// One edge between siblings: the parent, the two children, where.
#[derive(Clone, Debug)]
struct Edge {
    parent: ModPath,
    from: String,
    to: String,
    at: String,
}

fn top(m: &ModPath) -> String {
    m.first().cloned().unwrap_or_else(|| "lib".into())
}

/// Every edge, split by the parent under which its two ends are siblings;
/// the root's edges use `lib` for the crate root's own items.
fn sibling_edges(edges: &[(Written, ModPath)]) -> Vec<Edge> {
    let mut out = Vec::new();
    for (w, to) in edges {
        let from = &w.module;
        let k = from.iter().zip(to).take_while(|(a, b)| a == b).count();
        let at = format!("{}:{} `{}`", w.file, w.line, w.path.join("::"));
        if k == 0 {
            let (f, t) = (top(from), top(to));
            if f != t {
                out.push(Edge { parent: Vec::new(), from: f, to: t, at });
            }
        } else if k < from.len() && k < to.len() {
            out.push(Edge { parent: from[..k].to_vec(), from: from[k].clone(), to: to[k].clone(), at });
        }
    }
    out
}

fn graph_of<'a>(edges: impl IntoIterator<Item = &'a Edge>) -> Graph {
    let mut g = Graph::new();
    for e in edges {
        g.entry(e.from.clone()).or_default().insert(e.to.clone());
        g.entry(e.to.clone()).or_default();
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
                    let at = stack.iter().position(|s| s == m).expect("on the stack");
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

/// The strongly connected parts of `g` with more than one module: every
/// module in one of them reaches every other through imports.
fn tangles(g: &Graph) -> Vec<Vec<String>> {
    // Reachability by a search from each module: these graphs are small.
    let reach = |from: &str| -> BTreeSet<String> {
        let mut seen = BTreeSet::new();
        let mut todo = vec![from.to_string()];
        while let Some(n) = todo.pop() {
            for m in g.get(&n).into_iter().flatten() {
                if seen.insert(m.clone()) {
                    todo.push(m.clone());
                }
            }
        }
        seen
    };
    let reached: BTreeMap<&String, BTreeSet<String>> = g.keys().map(|n| (n, reach(n))).collect();
    let mut placed = BTreeSet::new();
    let mut out = Vec::new();
    for n in g.keys() {
        if placed.contains(n) || !reached[n].contains(n) {
            continue;
        }
        let part: Vec<String> = g.keys().filter(|m| reached[n].contains(*m) && reached[*m].contains(n)).cloned().collect();
        placed.extend(part.iter().cloned());
        out.push(part);
    }
    out
}

/// Every tangle among the children of each module, with where each of its
/// imports is written.
fn sibling_cycles(edges: &[Edge]) -> Vec<String> {
    let mut by_parent: BTreeMap<&ModPath, Vec<&Edge>> = BTreeMap::new();
    for e in edges.iter().filter(|e| !e.parent.is_empty()) {
        by_parent.entry(&e.parent).or_default().push(e);
    }
    let mut out = Vec::new();
    for (parent, es) in by_parent {
        let g = graph_of(es.iter().copied());
        for part in tangles(&g) {
            let steps: Vec<String> = part
                .iter()
                .flat_map(|a| part.iter().map(move |b| (a, b)))
                .filter(|(a, b)| g[*a].contains(*b))
                .map(|(a, b)| format!("    {a} -> {b}: {}", where_(&es, a, b)))
                .collect();
            out.push(format!("  in crate::{}: {}\n{}", parent.join("::"), part.join(", "), steps.join("\n")));
        }
    }
    out
}

fn where_(edges: &[&Edge], from: &str, to: &str) -> String {
    edges.iter().filter(|e| e.from == from && e.to == to).take(3).map(|e| e.at.clone()).collect::<Vec<_>>().join(", ")
}

fn src_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

#[test]
fn layers_hold() {
    let krate = Crate::read(&src_dir());
    let (resolved, errors) = krate.edges();
    assert!(errors.is_empty(), "crate paths the checker cannot resolve:\n{}", errors.join("\n"));
    assert!(krate.modules.len() >= 100, "the reader found only {} modules: it is broken", krate.modules.len());
    let edges = sibling_edges(&resolved);
    let root: Vec<&Edge> = edges.iter().filter(|e| e.parent.is_empty()).collect();
    let g = graph_of(root.iter().copied());
    assert!(g.len() >= 10, "the scan found only {} top-level modules: it is broken", g.len());

    // 1. No cycle at the top.
    if let Some(cycle) = find_cycle(&g) {
        let steps: Vec<String> = cycle.windows(2).map(|w| format!("  {} -> {}: {}", w[0], w[1], where_(&root, &w[0], &w[1]))).collect();
        panic!("import cycle among kiln's modules: {}\n{}", cycle.join(" -> "), steps.join("\n"));
    }

    // 2. Every edge goes down.
    let up = upward_edges(&g, LAYERS);
    assert!(up.is_empty(), "imports against the layers:\n{}", up.join("\n"));

    // 3. Below the front end, nothing imports it.
    let bad: Vec<String> = root
        .iter()
        .filter(|e| BELOW_FRONT_END.contains(&e.from.as_str()) && FRONT_END.contains(&e.to.as_str()))
        .map(|e| format!("{} ({} is above the backends)", e.at, e.to))
        .collect();
    assert!(bad.is_empty(), "a file below the front end imports it:\n{}", bad.join("\n"));

    // 4. The device vocabulary names no backend.
    let bad: Vec<String> = root.iter().filter(|e| e.from == "base" && e.to == "backends").map(|e| e.at.clone()).collect();
    assert!(bad.is_empty(), "base/ names a backend:\n{}", bad.join("\n"));
    let mut base_words = BTreeSet::new();
    for (path, m) in &krate.modules {
        if path.first().is_some_and(|p| p == "base") {
            let text = std::fs::read_to_string(src_dir().join(&m.file)).expect("read base file");
            let file = syn::parse_file(&text).expect("parsed above");
            base_words.extend(idents(file.to_token_stream()));
        }
    }
    for name in ["backends", "SimBackend", "CudaBackend", "CpuBackend"] {
        assert!(!base_words.contains(name), "base/ names the backend item `{name}`");
    }

    // 5. No cycle among the children of any module.
    let cycles = sibling_cycles(&edges);
    assert!(cycles.is_empty(), "import cycles inside modules:\n{}", cycles.join("\n"));

    println!("layer order verified (bottom first; a module imports only its own layer or lower ones):");
    for (r, layer) in LAYERS.iter().enumerate() {
        println!("  {r:2}: {}", layer.join(", "));
    }
    println!("edges:");
    for (from, tos) in &g {
        println!("  {from} -> {}", tos.iter().cloned().collect::<Vec<_>>().join(", "));
    }
    let parents: BTreeSet<&ModPath> = edges.iter().filter(|e| !e.parent.is_empty()).map(|e| &e.parent).collect();
    println!(
        "{} modules read, {} paths resolved; no cycle among the children of {} modules with sibling imports",
        krate.modules.len(),
        resolved.len(),
        parents.len()
    );
}

/// Writes `files` under a fresh folder and reads it as a crate.
fn planted(files: &[(&str, &str)]) -> (Crate, Vec<Edge>, Vec<String>) {
    let dir = std::env::temp_dir().join(format!("kiln-layers-{}-{}", std::process::id(), files.len()));
    let _ = std::fs::remove_dir_all(&dir);
    for (rel, text) in files {
        let p = dir.join(rel);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, text).unwrap();
    }
    let krate = Crate::read(&dir);
    let (resolved, errors) = krate.edges();
    let edges = sibling_edges(&resolved);
    let _ = std::fs::remove_dir_all(&dir);
    (krate, edges, errors)
}

/// The checker itself finds what it must: a synthetic graph with a cycle,
/// an upward edge, and synthetic crates whose imports hide in groups,
/// re-exports, globs, macro bodies, comments, strings and test modules.
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

    // A crate whose imports hide everywhere the reader must look.
    let (krate, edges, errors) = planted(&[
        (
            "lib.rs",
            r#"
            mod base; mod tensor; mod ops; mod nn;
            pub use tensor::Tensor;
            #[cfg(test)]
            mod tests { use crate::nn::Linear; }
            #[cfg(doctest)]
            fn doc() { crate::nn::Linear; }
            "#,
        ),
        ("base/mod.rs", "pub struct Device;\n#[macro_export]\nmacro_rules! shape { () => { $crate::ops::conv::Conv } }\n"),
        ("tensor.rs", "pub struct Tensor;\n// use crate::nn::Linear;\n/// [`crate::ops::Op`]\nfn f() { let s = \"crate::nn\"; }\n"),
        ("ops/mod.rs", "mod conv; mod pool; pub(crate) use conv::Conv; use crate::Tensor; pub struct Op;\n"),
        ("ops/conv.rs", "use super::*;\npub struct Conv;\nfn f() { pool_helper(); }\n"),
        ("ops/pool.rs", "pub fn pool_helper() { let _ = super::Conv; }\n"),
        ("nn/mod.rs", "pub struct Linear;\nfn f() { crate::shape!(); use crate::{base::Device, ops::{self, Op}}; }\n"),
    ]);
    assert!(errors.is_empty(), "{errors:?}");
    assert_eq!(krate.modules.len(), 7, "{:?}", krate.modules.keys().collect::<Vec<_>>());
    let at = |parent: &[&str], from: &str, to: &str| edges.iter().any(|e| e.parent == parent && e.from == from && e.to == to);
    // Re-exports resolve to the defining module: `crate::Tensor` is tensor's.
    assert!(at(&[], "ops", "tensor"));
    // Groups inside a function body, and an exported macro, lead where they are defined.
    assert!(at(&[], "nn", "base") && at(&[], "nn", "ops"));
    // `$crate::` in a macro body is an edge of the module that defines the macro.
    assert!(at(&[], "base", "ops"));
    // Comments, strings, doc links and cfg(test)/cfg(doctest) items are not imports.
    assert!(!edges.iter().any(|e| e.to == "nn"), "{edges:?}");
    // A path through the parent's re-export (`super::Conv`) is an edge to
    // the module that defines it. conv's glob (`use super::*`) does not reach
    // pool's helper, which the parent does not import: no edge back.
    assert!(at(&["ops"], "pool", "conv"));
    assert!(!at(&["ops"], "conv", "pool"));
    assert!(sibling_cycles(&edges).is_empty());

    // Now the parent imports pool's helper; conv's glob reaches it: a cycle.
    let (_, edges, errors) = planted(&[
        ("lib.rs", "mod ops;"),
        ("ops/mod.rs", "mod conv; mod pool; use conv::Conv; use pool::pool_helper;\n"),
        ("ops/conv.rs", "use super::*;\npub struct Conv;\nfn f() { pool_helper(); }\n"),
        ("ops/pool.rs", "pub fn pool_helper() { let _ = super::Conv; }\n"),
    ]);
    assert!(errors.is_empty(), "{errors:?}");
    let cycles = sibling_cycles(&edges);
    assert_eq!(cycles.len(), 1, "{cycles:?}");
    assert!(cycles[0].contains("in crate::ops: conv, pool"), "{cycles:?}");
    assert!(cycles[0].contains("ops/pool.rs:1 `super::Conv`"), "{cycles:?}");

    // Code that ships under `cfg(any(test, feature))` is read; a path after
    // `..` is seen; a module glob inside a function and a #[path] module are
    // refused, since what they bring in cannot be followed.
    let (_, edges, errors) = planted(&[
        ("lib.rs", "mod a; mod b; mod c;\n#[path = \"elsewhere.rs\"]\nmod d;"),
        (
            "a.rs",
            "#[cfg(any(test, feature = \"x\"))]\nfn f() { crate::b::g(); }\nfn h(s: crate::c::S) -> crate::c::S { crate::c::S { ..s } }\n",
        ),
        ("b.rs", "pub fn g() {}\nfn k() { let _ = 0..crate::c::N; use super::c::*; }\n"),
        ("c.rs", "pub struct S; pub const N: usize = 1;\n#[cfg(all(test, unix))]\nfn t() { crate::a::h(S); }\n"),
        ("d.rs", ""),
    ]);
    let at = |from: &str, to: &str| edges.iter().any(|e| e.parent.is_empty() && e.from == from && e.to == to);
    assert!(at("a", "b") && at("a", "c") && at("b", "c"), "{edges:?}");
    assert!(!at("c", "a"), "cfg(all(test, ..)) is test-only: {edges:?}");
    assert_eq!(errors.len(), 2, "{errors:?}");
    assert!(errors.iter().any(|e| e.contains("`mod d` has a #[path]")), "{errors:?}");
    assert!(errors.iter().any(|e| e.contains("b.rs:2: `use super::c::*` inside an item")), "{errors:?}");

    // A crate path that names nothing is an error, not a silent miss.
    let (_, _, errors) = planted(&[("lib.rs", "mod a; mod b;"), ("a.rs", "fn f() { crate::b::missing(); }"), ("b.rs", "")]);
    assert_eq!(errors.len(), 1, "{errors:?}");
    assert!(errors[0].contains("a.rs:1: `crate::b::missing`: `missing` is not in `crate::b`"), "{errors:?}");
}
