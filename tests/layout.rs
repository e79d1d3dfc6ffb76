//! The structure the project promises (docs/src/development.md, "Layout"), checked so it
//! cannot rot: the core crate depends on no runtime, store or broker client, the agent's modules
//! import each other one way (`crate::` paths), and no file under `src/`, `core/src/` or
//! `sinks/*/src/` grows past 500 lines (tests and benches are not held to it).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

const ROOT: &str = env!("CARGO_MANIFEST_DIR");

#[test]
fn the_core_crate_depends_on_no_runtime_store_or_broker_client() {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let output = std::process::Command::new(cargo)
        .current_dir(ROOT)
        .args([
            "tree",
            "--offline",
            "-p",
            "sched-relay-core",
            "-e",
            "normal",
            "--prefix",
            "none",
        ])
        .output()
        .expect("cargo tree runs");
    let tree = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(tree.contains("sched-relay-core"), "{tree}");
    let crates: BTreeSet<&str> = tree
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .collect();
    for forbidden in [
        "tokio",
        "redb",
        "reqwest",
        "rdkafka",
        "lapin",
        "async-nats",
        "axum",
        "hyper",
    ] {
        assert!(
            !crates.contains(forbidden),
            "sched-relay-core pulls in {forbidden}:\n{tree}"
        );
    }
}

/// Every `.rs` file under `dir`.
fn sources(dir: &Path) -> Vec<PathBuf> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            found.extend(sources(&path));
        } else if path.extension().is_some_and(|e| e == "rs") {
            found.push(path);
        }
    }
    found
}

/// The top-level modules each top-level module of `src/` names as `crate::<module>`.
fn module_imports() -> BTreeMap<String, BTreeSet<String>> {
    let src = Path::new(ROOT).join("src");
    let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for file in sources(&src) {
        let relative = file.strip_prefix(&src).unwrap();
        let first = relative
            .components()
            .next()
            .unwrap()
            .as_os_str()
            .to_string_lossy();
        let module = first.trim_end_matches(".rs").to_owned();
        if module == "main" || module == "lib" {
            continue;
        }
        // Code only: a doc link to another module is not an import.
        let text: String = std::fs::read_to_string(&file)
            .unwrap()
            .lines()
            .map(strip_comment)
            .collect::<Vec<_>>()
            .join("\n");
        let mut names = BTreeSet::new();
        for (at, _) in text.match_indices("crate::") {
            let rest = &text[at + "crate::".len()..];
            if let Some(group) = rest.strip_prefix('{') {
                names.extend(top_level_names(group));
            } else {
                let name: String = rest
                    .chars()
                    .take_while(|c| c.is_alphanumeric() || *c == '_')
                    .collect();
                names.insert(name);
            }
        }
        names.retain(|n| !n.is_empty() && *n != module && n.chars().next().unwrap().is_lowercase());
        graph.entry(module).or_default().extend(names);
    }
    graph
}

/// A line without its `//` comment (a `//` inside a URL such as `"http://x"` is kept).
fn strip_comment(line: &str) -> &str {
    let mut from = 0;
    while let Some(at) = line[from..].find("//") {
        let at = from + at;
        if at == 0 || line[..at].ends_with(char::is_whitespace) {
            return &line[..at];
        }
        from = at + 2;
    }
    line
}

/// The first segment of every path in a `use crate::{a, b::{c, d}, e}` group (the text
/// after the opening brace).
fn top_level_names(group: &str) -> Vec<String> {
    let mut paths = Vec::new();
    let (mut depth, mut start) = (0, 0);
    for (at, c) in group.char_indices() {
        match c {
            '{' => depth += 1,
            '}' if depth == 0 => {
                paths.push(&group[start..at]);
                break;
            }
            '}' => depth -= 1,
            ',' if depth == 0 => {
                paths.push(&group[start..at]);
                start = at + 1;
            }
            _ => {}
        }
    }
    paths
        .iter()
        .map(|path| {
            path.trim()
                .split("::")
                .next()
                .unwrap_or("")
                .trim()
                .to_owned()
        })
        .collect()
}

#[test]
fn import_parsing_sees_nested_groups_and_ignores_comments() {
    assert_eq!(top_level_names("a::{b, c}, d, e::f};"), ["a", "d", "e"]);
    assert_eq!(
        strip_comment("let u = \"http://x\"; // crate::y"),
        "let u = \"http://x\"; "
    );
    assert_eq!(strip_comment("    //! crate::y"), "    ");
}

#[test]
fn the_agent_modules_import_each_other_without_cycles() {
    let graph = module_imports();
    assert!(
        graph.contains_key("agent") && graph.contains_key("config"),
        "{graph:?}"
    );
    if let Some(cycle) = cycle(&graph) {
        panic!("import cycle: {}\n{graph:#?}", cycle.join(" -> "));
    }
}

/// Inside the top-level module `module` (a folder of `src/`), the child modules each child
/// names: `crate::<module>::<child>`, or `super::<child>` from as deep as it is written
/// (`super::super::` from a grandchild). Its `tests` are left out: they may name anything.
fn child_imports(module: &str) -> BTreeMap<String, BTreeSet<String>> {
    let root = Path::new(ROOT).join("src").join(module);
    let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for file in sources(&root) {
        let relative = file.strip_prefix(&root).unwrap();
        let parts: Vec<String> = relative
            .components()
            .map(|c| {
                c.as_os_str()
                    .to_string_lossy()
                    .trim_end_matches(".rs")
                    .to_owned()
            })
            .collect();
        let child = parts[0].clone();
        if child == "mod" || child == "tests" {
            continue;
        }
        // child.rs and child/mod.rs are the child itself; child/x.rs is one deeper.
        let depth = parts.len() - 1 - usize::from(parts.last().is_some_and(|p| p == "mod"));
        let text: String = std::fs::read_to_string(&file)
            .unwrap()
            .lines()
            .map(strip_comment)
            .collect::<Vec<_>>()
            .join("\n");
        let mut names = BTreeSet::new();
        let mut add = |rest: &str| {
            if let Some(group) = rest.strip_prefix('{') {
                names.extend(top_level_names(group));
            } else {
                names.insert(
                    rest.chars()
                        .take_while(|c| c.is_alphanumeric() || *c == '_')
                        .collect::<String>(),
                );
            }
        };
        let own = format!("crate::{module}::");
        for (at, _) in text.match_indices(own.as_str()) {
            add(&text[at + own.len()..]);
        }
        let up = "super::".repeat(depth + 1);
        for (at, _) in text.match_indices(up.as_str()) {
            let rest = &text[at + up.len()..];
            // One more `super::` goes above the module: not a child.
            if !rest.starts_with("super::") && !text[..at].ends_with("super::") {
                add(rest);
            }
        }
        names.retain(|n| !n.is_empty() && *n != child && n.chars().next().unwrap().is_lowercase());
        graph.entry(child).or_default().extend(names);
    }
    graph
}

/// A cycle in `graph`, as a path, if there is one.
fn cycle(graph: &BTreeMap<String, BTreeSet<String>>) -> Option<Vec<String>> {
    fn visit(
        node: &str,
        graph: &BTreeMap<String, BTreeSet<String>>,
        path: &mut Vec<String>,
        done: &mut BTreeSet<String>,
    ) -> Option<Vec<String>> {
        if let Some(start) = path.iter().position(|n| n == node) {
            let mut cycle = path[start..].to_vec();
            cycle.push(node.to_owned());
            return Some(cycle);
        }
        if done.contains(node) {
            return None;
        }
        path.push(node.to_owned());
        for next in graph.get(node).into_iter().flatten() {
            if let Some(cycle) = visit(next, graph, path, done) {
                return Some(cycle);
            }
        }
        path.pop();
        done.insert(node.to_owned());
        None
    }
    let mut done = BTreeSet::new();
    graph
        .keys()
        .find_map(|module| visit(module, graph, &mut Vec::new(), &mut done))
}

#[test]
fn the_rooms_inside_each_module_import_each_other_without_cycles() {
    let src = Path::new(ROOT).join("src");
    let mut checked = Vec::new();
    for entry in std::fs::read_dir(&src).unwrap() {
        let path = entry.unwrap().path();
        if !path.is_dir() {
            continue;
        }
        let module = path.file_name().unwrap().to_string_lossy().into_owned();
        let graph = child_imports(&module);
        if let Some(cycle) = cycle(&graph) {
            panic!(
                "import cycle inside {module}: {}\n{graph:#?}",
                cycle.join(" -> ")
            );
        }
        checked.push(module);
    }
    assert!(checked.contains(&"coordinator".to_owned()), "{checked:?}");
    // The parser sees what it must: the engine names the store.
    assert!(
        child_imports("coordinator")["engine"].contains("store"),
        "{:#?}",
        child_imports("coordinator")
    );
}

#[test]
fn configuration_is_assembled_from_its_owners_and_nothing_imports_it_back() {
    let graph = module_imports();
    let importers: Vec<&String> = graph
        .iter()
        .filter(|(_, imports)| imports.contains("config"))
        .map(|(module, _)| module)
        .collect();
    // Only the wiring (agent), the demo, which builds a configuration in code, and the
    // coordinator, whose own file reports problems the same way.
    assert_eq!(importers, ["agent", "coordinator", "demo"], "{graph:#?}");
}

#[test]
fn no_library_source_file_is_longer_than_500_lines() {
    let root = Path::new(ROOT);
    let mut dirs = vec![root.join("src"), root.join("core/src")];
    for entry in std::fs::read_dir(root.join("sinks")).unwrap() {
        dirs.push(entry.unwrap().path().join("src"));
    }
    let long: Vec<String> = dirs
        .iter()
        .flat_map(|dir| sources(dir))
        .filter_map(|file| {
            let lines = std::fs::read_to_string(&file).unwrap().lines().count();
            (lines > 500).then(|| {
                format!(
                    "{} ({lines} lines)",
                    file.strip_prefix(root).unwrap().display()
                )
            })
        })
        .collect();
    assert!(long.is_empty(), "split these by job: {long:?}");
}
