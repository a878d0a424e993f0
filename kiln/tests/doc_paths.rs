//! Every repository path that README.md, ARCHITECTURE.md and docs/*.md name
//! exists, and every link between them lands on a file and a heading.
//!
//! A reference is an inline code span (`` `kiln/tests/io.rs` ``), a markdown
//! link target (`[text](docs/CUDA.md#the-cuda-simulator)`), or a word of a
//! fenced shell or text block (`bash scripts/gpu-check.sh`). Each word of a
//! code span is checked on its own, after its `:line` or `#anchor` suffix and
//! surrounding punctuation are stripped:
//!
//! - a word that starts with a top-level folder (`kiln/`, `kiln-cli/`,
//!   `cudasim/`, `bench/`, `scripts/`, `docs/`, `.ci/`) must exist at that
//!   path from the repository root;
//! - a bare file name with a source extension (`ARCHITECTURE.md`, `nn.rs`)
//!   must be the name of some file in the repository;
//! - a shortened path (`ops/conv.rs`, `backends/sim/`), as ARCHITECTURE.md
//!   writes paths inside `kiln/src`, must end some path in the repository,
//!   whole component by whole component.
//!
//! Globs and placeholders (words holding `*`, `<`, `{` or `...`), absolute
//! and home paths and build outputs (`target/`) are not checked. The test
//! needs nothing but the standard library and the files, so it is fast.

use std::collections::BTreeSet;
use std::fs;
use std::path::{Path, PathBuf};

/// Folders at the repository root: a word starting with one names a path from the root.
const TOP_LEVEL_DIRS: &[&str] = &["kiln/", "kiln-cli/", "cudasim/", "bench/", "scripts/", "docs/", ".ci/"];

/// Extensions that make a bare word a file name to look for.
const SOURCE_EXTENSIONS: &[&str] = &["rs", "py", "sh", "cu", "md", "toml", "txt"];

/// Fenced block languages whose words are checked (output and shell commands).
const CHECKED_FENCES: &[&str] = &["", "sh", "bash", "console", "text"];

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("kiln/ has a parent").to_path_buf()
}

/// The files and folders of the repository, as `/`-separated paths from the
/// root (folders end with `/`), leaving out `.git` and build outputs.
fn repo_paths(root: &Path) -> BTreeSet<String> {
    fn walk(root: &Path, dir: &Path, out: &mut BTreeSet<String>) {
        let Ok(entries) = fs::read_dir(dir) else { return };
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if name == ".git" || name == "target" {
                continue;
            }
            let path = entry.path();
            let rel = path.strip_prefix(root).expect("under the root").to_string_lossy().replace('\\', "/");
            let Ok(kind) = entry.file_type() else { continue };
            if kind.is_dir() {
                out.insert(format!("{rel}/"));
                walk(root, &path, out);
            } else {
                out.insert(rel);
            }
        }
    }
    let mut out = BTreeSet::new();
    walk(root, root, &mut out);
    out
}

/// README.md, ARCHITECTURE.md and every docs/*.md, as paths from the root.
fn documents(root: &Path) -> Vec<String> {
    let mut docs = vec!["README.md".to_string(), "ARCHITECTURE.md".to_string()];
    let mut more: Vec<String> = fs::read_dir(root.join("docs"))
        .map(|entries| {
            entries
                .flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|name| name.ends_with(".md"))
                .map(|name| format!("docs/{name}"))
                .collect()
        })
        .unwrap_or_default();
    more.sort();
    docs.extend(more);
    docs
}

/// How a reference was written, which decides what it is relative to.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Kind {
    /// A code span or a word of a fenced block: relative to the repository root.
    Code,
    /// A markdown link target: relative to the document's folder.
    Link,
}

#[derive(Clone, Debug)]
struct Reference {
    line: usize,
    kind: Kind,
    text: String,
}

/// The text with every fenced block blanked out (its lines kept, empty, so
/// that byte offsets still give line numbers), and the fenced blocks' words
/// that are checked, with their lines.
fn split_fences(text: &str) -> (String, Vec<Reference>) {
    let mut prose = String::with_capacity(text.len());
    let mut words = Vec::new();
    let mut fence: Option<(String, bool)> = None; // (marker, checked)
    for (i, line) in text.lines().enumerate() {
        let trimmed = line.trim_start();
        let marker = if trimmed.starts_with("```") {
            Some("```")
        } else if trimmed.starts_with("~~~") {
            Some("~~~")
        } else {
            None
        };
        match (&fence, marker) {
            (None, Some(m)) => {
                let lang = trimmed[m.len()..].trim().split([',', ' ']).next().unwrap_or("").to_string();
                fence = Some((m.to_string(), CHECKED_FENCES.contains(&lang.as_str())));
            }
            (Some((open, _)), Some(m)) if m == open && trimmed[m.len()..].trim().is_empty() => fence = None,
            (Some((_, true)), _) => {
                for word in line.split_whitespace() {
                    words.push(Reference { line: i + 1, kind: Kind::Code, text: word.to_string() });
                }
            }
            (Some((_, false)), _) => {}
            (None, None) => prose.push_str(line),
        }
        prose.push('\n');
    }
    (prose, words)
}

/// The 1-based line of a byte offset.
fn line_of(text: &str, offset: usize) -> usize {
    text[..offset].bytes().filter(|&b| b == b'\n').count() + 1
}

/// Inline code spans (their words) and link targets of prose with the fenced
/// blocks blanked out. A code span opened by n backticks closes at the next
/// run of exactly n; one that does not close before a blank line is text.
fn prose_references(prose: &str) -> Vec<Reference> {
    let bytes = prose.as_bytes();
    let mut refs = Vec::new();
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'`' {
            let run = bytes[i..].iter().take_while(|&&b| b == b'`').count();
            let start = i + run;
            let mut j = start;
            let mut close = None;
            while j < bytes.len() {
                if bytes[j] == b'`' {
                    let r = bytes[j..].iter().take_while(|&&b| b == b'`').count();
                    if r == run {
                        close = Some(j);
                        break;
                    }
                    j += r;
                } else if bytes[j] == b'\n' && bytes.get(j + 1) == Some(&b'\n') {
                    break;
                } else {
                    j += 1;
                }
            }
            match close {
                Some(end) => {
                    let line = line_of(prose, start);
                    for word in prose[start..end].split_whitespace() {
                        refs.push(Reference { line, kind: Kind::Code, text: word.to_string() });
                    }
                    i = end + run;
                }
                None => i = start,
            }
        } else if bytes[i] == b']' && bytes.get(i + 1) == Some(&b'(') {
            let start = i + 2;
            if let Some(len) = prose[start..].find(')') {
                let target = prose[start..start + len].trim();
                refs.push(Reference { line: line_of(prose, start), kind: Kind::Link, text: target.to_string() });
                i = start + len + 1;
            } else {
                i = start;
            }
        } else {
            i += 1;
        }
    }
    refs
}

/// GitHub's anchor for a heading: lower case, backticks and punctuation
/// dropped (but `-` and `_`), spaces as `-`.
fn slug(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter(|c| c.is_alphanumeric() || matches!(c, ' ' | '-' | '_'))
        .map(|c| if c == ' ' { '-' } else { c })
        .collect()
}

/// The anchors of a document's headings (outside fenced blocks), with
/// GitHub's `-1`, `-2` suffixes for repeated ones.
fn anchors(text: &str) -> BTreeSet<String> {
    let (prose, _) = split_fences(text);
    let mut seen = BTreeSet::new();
    for line in prose.lines() {
        let hashes = line.bytes().take_while(|&b| b == b'#').count();
        if (1..=6).contains(&hashes) && line[hashes..].starts_with(' ') {
            let base = slug(&line[hashes..]);
            let mut anchor = base.clone();
            let mut n = 0;
            while seen.contains(&anchor) {
                n += 1;
                anchor = format!("{base}-{n}");
            }
            seen.insert(anchor);
        }
    }
    seen
}

/// A word stripped of surrounding punctuation and of a `:line` or `#anchor`
/// suffix; `None` for words that name no repository path (placeholders,
/// globs, URLs, absolute or home paths, build outputs).
fn clean(word: &str) -> Option<String> {
    let word = word.trim_start_matches(['(', '[', '"', '\'', '`']);
    let word = word.trim_end_matches(['.', ',', ';', ':', ')', ']', '"', '\'', '`', '!', '?']);
    if word.is_empty()
        || ["*", "<", ">", "{", "}", "...", "…", "$", "|", "="].iter().any(|p| word.contains(p))
        || word.contains("://")
        || word.starts_with(['/', '~', '-'])
        || word.starts_with("target/")
        || word.starts_with("mailto:")
    {
        return None;
    }
    let word = word.strip_prefix("./").unwrap_or(word);
    let path = word.split_once('#').map_or(word, |(p, _)| p);
    // `file.rs:120` and `file.rs:120:5`: a line, not part of the path.
    let path = match path.split_once(':') {
        Some((p, rest)) if rest.split(':').all(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit())) => p,
        Some(_) => return None, // `kiln::nn`, `file:line`: not a path
        None => path,
    };
    Some(path.to_string())
}

/// The extension of a path's last component, when it looks like a file name.
fn extension(path: &str) -> Option<&str> {
    let last = path.rsplit('/').next()?;
    let (stem, ext) = last.rsplit_once('.')?;
    (!stem.is_empty() && SOURCE_EXTENSIONS.contains(&ext)).then_some(ext)
}

/// Whether `path` ends some repository path, component by component.
fn is_suffix_of_some(paths: &BTreeSet<String>, path: &str) -> bool {
    paths.iter().any(|p| p == path || p.ends_with(&format!("/{path}")))
}

/// Whether the file or folder `path` (from the root) exists.
fn exists(paths: &BTreeSet<String>, path: &str) -> bool {
    paths.contains(path) || paths.contains(&format!("{}/", path.trim_end_matches('/')))
}

/// What is wrong with a path written in code (a code span's word or a fenced
/// block's), if anything: see the module's documentation for the rules.
fn code_path_problem(path: &str, paths: &BTreeSet<String>) -> Option<String> {
    let nested_folder = path.ends_with('/') && path.trim_end_matches('/').contains('/');
    if TOP_LEVEL_DIRS.iter().any(|d| path.starts_with(d)) {
        (!exists(paths, path)).then(|| format!("`{path}` does not exist"))
    } else if extension(path).is_none() && !nested_folder {
        None // not a file name, nor a shortened path
    } else if !path.contains('/') {
        (!is_suffix_of_some(paths, path)).then(|| format!("no file is named `{path}`"))
    } else {
        (!is_suffix_of_some(paths, path)).then(|| format!("no path ends with `{path}`"))
    }
}

/// Folds `a/../b` and `a/./b` in a `/`-separated relative path; `None` when
/// it climbs out of the repository.
fn normalize(path: &str) -> Option<String> {
    let trailing = path.ends_with('/');
    let mut parts: Vec<&str> = Vec::new();
    for part in path.split('/') {
        match part {
            "" | "." => {}
            ".." => {
                parts.pop()?;
            }
            p => parts.push(p),
        }
    }
    let mut out = parts.join("/");
    if trailing && !out.is_empty() {
        out.push('/');
    }
    Some(out)
}

/// Every problem with the references of one document, each as
/// `DOC:LINE: what`. `read` gives the text of another document (for anchors).
fn check_document(doc: &str, text: &str, paths: &BTreeSet<String>, read: &dyn Fn(&str) -> Option<String>) -> Vec<String> {
    let (prose, mut refs) = split_fences(text);
    refs.extend(prose_references(&prose));
    let doc_dir = doc.rsplit_once('/').map(|(d, _)| format!("{d}/")).unwrap_or_default();
    let mut problems = Vec::new();
    for r in refs {
        let at = format!("{doc}:{}", r.line);
        match r.kind {
            Kind::Link => {
                let target = r.text.split_whitespace().next().unwrap_or("");
                if target.contains("://") || target.starts_with("mailto:") || target.is_empty() {
                    continue;
                }
                let (file, anchor) = match target.split_once('#') {
                    Some((f, a)) => (f, Some(a)),
                    None => (target, None),
                };
                let file = if file.is_empty() {
                    doc.to_string()
                } else {
                    match normalize(&format!("{doc_dir}{file}")) {
                        Some(f) => f,
                        None => {
                            problems.push(format!("{at}: link `{target}` leaves the repository"));
                            continue;
                        }
                    }
                };
                if !exists(paths, &file) {
                    problems.push(format!("{at}: link `{target}`: `{file}` does not exist"));
                    continue;
                }
                if let (Some(anchor), true) = (anchor, file.ends_with(".md")) {
                    let other = if file == doc { Some(text.to_string()) } else { read(&file) };
                    let found = other.map(|t| anchors(&t).contains(anchor)).unwrap_or(false);
                    if !found {
                        problems.push(format!("{at}: link `{target}`: `{file}` has no heading with anchor `#{anchor}`"));
                    }
                }
            }
            Kind::Code => {
                let Some(path) = clean(&r.text) else { continue };
                if let Some(problem) = code_path_problem(&path, paths) {
                    problems.push(format!("{at}: {problem}"));
                }
            }
        }
    }
    problems
}

#[test]
fn every_path_the_docs_name_exists() {
    let root = repo_root();
    let paths = repo_paths(&root);
    let read = |rel: &str| fs::read_to_string(root.join(rel)).ok();
    let docs = documents(&root);
    let mut problems = Vec::new();
    for doc in &docs {
        let text = read(doc).unwrap_or_else(|| panic!("cannot read {doc}"));
        problems.extend(check_document(doc, &text, &paths, &read));
    }
    assert!(
        problems.is_empty(),
        "{} reference(s) in {} name(s) nothing in the repository:\n{}",
        problems.len(),
        docs.join(", "),
        problems.join("\n")
    );
}

/// Every page with rust examples has them run: `kiln/src/lib.rs` includes it
/// in a `#[cfg(doctest)]` item (`ReadmeDoctests`, `TrainingDoctests`, ...).
#[test]
fn every_page_with_rust_examples_runs_them_as_doctests() {
    let root = repo_root();
    let lib = fs::read_to_string(root.join("kiln/src/lib.rs")).expect("kiln/src/lib.rs");
    let mut missing = Vec::new();
    for doc in documents(&root) {
        let text = fs::read_to_string(root.join(&doc)).unwrap_or_else(|e| panic!("cannot read {doc}: {e}"));
        let has_rust = text.lines().any(|l| l.trim_start().strip_prefix("```").is_some_and(|lang| lang.starts_with("rust")));
        let include = format!("#[doc = include_str!(\"../../{doc}\")]\n#[cfg(doctest)]");
        if has_rust && !lib.contains(&include) {
            missing.push(format!("{doc}: add to kiln/src/lib.rs\n{include}\npub struct <Name>Doctests;"));
        }
    }
    assert!(missing.is_empty(), "pages whose rust examples no doctest runs:\n{}", missing.join("\n"));
}

/// The checker itself: it reports stale paths of every kind, and lets
/// placeholders, globs and non-paths through.
#[test]
fn the_checker_finds_stale_paths() {
    let paths: BTreeSet<String> = [
        "README.md",
        "docs/",
        "docs/GUIDE.md",
        "kiln/",
        "kiln/src/",
        "kiln/src/ops/",
        "kiln/src/ops/conv.rs",
        "kiln/tests/",
        "kiln/tests/cuda/",
        "kiln/tests/cuda/main.rs",
        "scripts/",
        "scripts/tsan.sh",
    ]
    .into_iter()
    .map(String::from)
    .collect();
    let guide = "# Guide\n\n## The CUDA simulator\n";
    let read = |rel: &str| (rel == "docs/GUIDE.md").then(|| guide.to_string());
    let doc = "\
# Title

Good: `kiln/tests/cuda/`, `kiln/src/ops/conv.rs:12`, `ops/conv.rs`, `main.rs`, (`scripts/tsan.sh`),
`bash scripts/tsan.sh --quick`, [guide](docs/GUIDE.md#the-cuda-simulator), [up](#title),
`kiln/tests/*.rs`, `kiln/<name>/`, `kiln::nn`, `file:line`, `target/debug/kiln`, `x.npy`.
Stale: `kiln/tests/cuda.rs`, `kiln/src/cuda_check.rs`, `fuzz_programs.rs`, `ops/gone.rs`,
[missing](docs/NOPE.md), [anchor](docs/GUIDE.md#nowhere), [here](#nowhere), ``a `scripts/old.sh` b``.

```sh
bash scripts/gone.sh
```

```rust
let p = \"kiln/not/checked.rs\";
```
";
    let problems = check_document("README.md", doc, &paths, &read);
    let joined = problems.join("\n");
    for stale in [
        "`kiln/tests/cuda.rs`",
        "`kiln/src/cuda_check.rs`",
        "`fuzz_programs.rs`",
        "`ops/gone.rs`",
        "docs/NOPE.md",
        "#nowhere`",
        "`scripts/old.sh`",
        "`scripts/gone.sh`",
    ] {
        assert!(joined.contains(stale), "{stale} not reported in:\n{joined}");
    }
    assert_eq!(problems.len(), 9, "unexpected reports:\n{joined}");
}

/// The README is a guide read top to bottom: at most 400 lines, the rest
/// in docs/.
#[test]
fn the_readme_stays_a_guide_of_at_most_400_lines() {
    let readme = fs::read_to_string(repo_root().join("README.md")).expect("README.md");
    let lines = readme.lines().count();
    assert!(lines <= 400, "README.md has {lines} lines: move detail to docs/ (it links each page)");
}
