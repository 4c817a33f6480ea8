//! The dependency rule of SPEC §1, read from the workspace's own manifests
//! (`cargo metadata --no-deps`: declared dependencies of the workspace
//! packages, nothing fetched).
//!
//! - The main crates — the packages of `control/Cargo.toml`,
//!   `ztunnel/Cargo.toml` and `cni/Cargo.toml` — never depend on one another.
//! - A shared crate nested under `control/`, `ztunnel/` or `cni/` (anything
//!   there but the three main crates and the CLI) depends on no main crate.
//! - Only `ambitctl`, `ambit-tests` and `ambit-benches` may depend on the main
//!   crates; every other package (e.g. `ambit-proto`) depends on none.
//!
//! "Depends" covers normal, build and dev dependencies, direct or through
//! other workspace packages: a dev-dependency of a main crate on another main
//! crate still couples their builds and tests (tests that need several main
//! crates belong in `tests/`). The first hop may be of any kind; after it only
//! normal and build dependencies count, as dev-dependencies are not
//! inherited. The walk stops at a main crate, whose own edges are checked on
//! their own.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::path::{Path, PathBuf};
use std::process::Command;

use ambit_tests::workspace_root;
use anyhow::{Context, Result, bail};
use serde_json::{Value, json};

/// The main crates: manifest directory and package name.
const MAIN_CRATES: [(&str, &str); 3] = [
    ("control", "ambit-control"),
    ("ztunnel", "ambit-ztunnel"),
    ("cni", "ambit-cni"),
];

/// The packages that may depend on everything.
const MAY_DEPEND_ON_EVERYTHING: [&str; 3] = ["ambitctl", "ambit-tests", "ambit-benches"];

/// The CLI: nested in `control/` but not a shared crate.
const CLI: &str = "ambitctl";

/// Edges that break the rule and are known to be on their way out; empty
/// now that the config and in-pod crates have landed. An entry must still
/// exist and still be forbidden, or the test fails, so the list cannot go
/// stale.
const PENDING_EDGES: &[(&str, &str)] = &[];

#[test]
fn the_workspace_keeps_the_dependency_rule() {
    let metadata = cargo_metadata().unwrap();
    let problems = check(&metadata, PENDING_EDGES).unwrap();
    assert!(
        problems.is_empty(),
        "dependency rule (SPEC §1) broken:\n  {}",
        problems.join("\n  ")
    );
}

fn cargo_metadata() -> Result<Value> {
    let root = workspace_root();
    let out = Command::new(env!("CARGO"))
        .args([
            "metadata",
            "--format-version",
            "1",
            "--no-deps",
            "--offline",
        ])
        .arg("--manifest-path")
        .arg(root.join("Cargo.toml"))
        .current_dir(&root)
        .output()
        .context("running cargo metadata")?;
    if !out.status.success() {
        bail!(
            "cargo metadata failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    serde_json::from_slice(&out.stdout).context("parsing cargo metadata's JSON")
}

// ------------------------------------------------------------ the check

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Kind {
    Normal,
    Build,
    Dev,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::Normal => "normal",
            Kind::Build => "build",
            Kind::Dev => "dev",
        }
    }
}

#[derive(Debug)]
struct Package {
    name: String,
    /// Manifest directory relative to the workspace root (`control/ambitctl`).
    dir: String,
    /// (package index, kind), sorted.
    deps: Vec<(usize, Kind)>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Role {
    Main,
    /// `ambitctl`, `ambit-tests`, `ambit-benches`.
    Everything,
    /// Under `control/`, `ztunnel/` or `cni/`, not main, not the CLI.
    Nested,
    /// Any other package (`ambit-proto`, a new top-level crate).
    Other,
}

/// The workspace packages with their dependencies on one another.
fn workspace(metadata: &Value) -> Result<Vec<Package>> {
    let root = PathBuf::from(
        metadata["workspace_root"]
            .as_str()
            .context("no workspace_root")?,
    );
    let members: BTreeSet<&str> = metadata["workspace_members"]
        .as_array()
        .context("no workspace_members")?
        .iter()
        .filter_map(Value::as_str)
        .collect();
    let mut raw = Vec::new();
    for p in metadata["packages"].as_array().context("no packages")? {
        if !p["id"].as_str().is_some_and(|id| members.contains(id)) {
            continue;
        }
        let name = p["name"].as_str().context("package without name")?;
        let manifest = Path::new(p["manifest_path"].as_str().context("no manifest_path")?);
        let dir = manifest.parent().context("manifest without directory")?;
        raw.push((name.to_string(), dir.to_path_buf(), &p["dependencies"]));
    }
    let index: BTreeMap<PathBuf, usize> = raw
        .iter()
        .enumerate()
        .map(|(i, (_, dir, _))| (dir.clone(), i))
        .collect();
    let mut packages = Vec::new();
    for (name, dir, deps) in &raw {
        let mut edges = BTreeSet::new();
        for d in deps.as_array().context("dependencies not a list")? {
            // Workspace packages are path dependencies; others are not ours.
            let Some(to) = d["path"].as_str().and_then(|p| index.get(Path::new(p))) else {
                continue;
            };
            let kind = match d["kind"].as_str() {
                None => Kind::Normal,
                Some("build") => Kind::Build,
                Some("dev") => Kind::Dev,
                Some(other) => bail!("{name}: unknown dependency kind {other:?}"),
            };
            edges.insert((*to, kind));
        }
        let rel = dir.strip_prefix(&root).unwrap_or(dir);
        packages.push(Package {
            name: name.clone(),
            dir: rel
                .components()
                .map(|c| c.as_os_str().to_string_lossy())
                .collect::<Vec<_>>()
                .join("/"),
            deps: edges.into_iter().collect(),
        });
    }
    Ok(packages)
}

fn role(p: &Package) -> Role {
    if MAIN_CRATES.iter().any(|(dir, _)| p.dir == *dir) {
        Role::Main
    } else if MAY_DEPEND_ON_EVERYTHING.contains(&p.name.as_str()) {
        Role::Everything
    } else if MAIN_CRATES
        .iter()
        .any(|(dir, _)| p.dir.starts_with(&format!("{dir}/")))
    {
        Role::Nested
    } else {
        Role::Other
    }
}

/// The rule `p` is held to, as an operator would read it.
fn rule(p: &Package) -> String {
    let mains: Vec<&str> = MAIN_CRATES.iter().map(|(_, n)| *n).collect();
    match role(p) {
        Role::Main => {
            let others: Vec<&str> = mains.into_iter().filter(|n| *n != p.name).collect();
            format!(
                "SPEC §1: {} never depends on {}",
                p.name,
                others.join(" or ")
            )
        }
        Role::Nested => format!(
            "SPEC §1: {} ({}) is a nested shared crate and depends on no main crate ({})",
            p.name,
            p.dir,
            mains.join(", ")
        ),
        Role::Other | Role::Everything => format!(
            "SPEC §1: only {} may depend on the main crates ({}); {} may not",
            MAY_DEPEND_ON_EVERYTHING.join(", "),
            mains.join(", "),
            p.name
        ),
    }
}

/// Everything wrong with the workspace's dependencies, allowing the direct
/// edges in `pending` (each of which must exist and be forbidden).
fn check(metadata: &Value, pending: &[(&str, &str)]) -> Result<Vec<String>> {
    let packages = workspace(metadata)?;
    let by_name: BTreeMap<&str, usize> = packages
        .iter()
        .enumerate()
        .map(|(i, p)| (p.name.as_str(), i))
        .collect();
    let mut problems = Vec::new();

    // The layout the rule is stated in.
    for (dir, name) in MAIN_CRATES {
        match packages.iter().find(|p| p.dir == dir) {
            Some(p) if p.name == name => {}
            Some(p) => problems.push(format!(
                "main crate {dir}/Cargo.toml is package {}, expected {name}: update MAIN_CRATES and SPEC §1",
                p.name
            )),
            None => problems.push(format!(
                "no workspace package at {dir}/Cargo.toml (main crate {name}): update MAIN_CRATES and SPEC §1"
            )),
        }
    }
    for name in MAY_DEPEND_ON_EVERYTHING {
        if !by_name.contains_key(name) {
            problems.push(format!(
                "no workspace package {name}: update MAY_DEPEND_ON_EVERYTHING"
            ));
        }
    }
    if let Some(&cli) = by_name.get(CLI)
        && !packages[cli].dir.starts_with("control/")
    {
        problems.push(format!(
            "{CLI} is at {}/, SPEC §1 puts the CLI in control/",
            packages[cli].dir
        ));
    }

    // The allow-list: every entry a forbidden edge that still exists.
    let mut allowed = BTreeSet::new();
    for &(from, to) in pending {
        let (Some(&f), Some(&t)) = (by_name.get(from), by_name.get(to)) else {
            problems.push(format!(
                "PENDING_EDGES lists {from} → {to}, but there is no such package: remove the entry"
            ));
            continue;
        };
        if role(&packages[f]) == Role::Everything || role(&packages[t]) != Role::Main {
            problems.push(format!(
                "PENDING_EDGES lists {from} → {to}, which the rule allows anyway: remove the entry"
            ));
        } else if !packages[f].deps.iter().any(|&(d, _)| d == t) {
            problems.push(format!(
                "PENDING_EDGES lists {from} → {to}, but {from} no longer depends on {to}: remove the entry (empty the list once the config and in-pod crates have landed)"
            ));
        }
        allowed.insert((f, t));
    }

    // The rule: from each restricted package, no main crate is reachable.
    for (start, p) in packages.iter().enumerate() {
        if role(p) == Role::Everything {
            continue;
        }
        for path in reachable_mains(&packages, start, &allowed) {
            let mut text = p.name.clone();
            for (to, kind) in &path {
                text.push_str(&format!(" → {} ({})", packages[*to].name, kind.name()));
            }
            problems.push(format!("{text} breaks the rule: {}", rule(p)));
        }
    }
    Ok(problems)
}

/// One path to each main crate reachable from `start`: (package, kind of
/// the edge into it) per hop. The first hop may be a dev-dependency, later
/// ones are normal or build; the walk does not go through main crates.
fn reachable_mains(
    packages: &[Package],
    start: usize,
    allowed: &BTreeSet<(usize, usize)>,
) -> Vec<Vec<(usize, Kind)>> {
    let mut came_from: BTreeMap<usize, (usize, Kind)> = BTreeMap::new();
    let mut queue = VecDeque::from([start]);
    while let Some(at) = queue.pop_front() {
        for &(to, kind) in &packages[at].deps {
            if to == start
                || came_from.contains_key(&to)
                || allowed.contains(&(at, to))
                || (at != start && kind == Kind::Dev)
            {
                continue;
            }
            came_from.insert(to, (at, kind));
            if role(&packages[to]) != Role::Main {
                queue.push_back(to);
            }
        }
    }
    let mut paths = Vec::new();
    for (&end, _) in came_from
        .iter()
        .filter(|(to, _)| role(&packages[**to]) == Role::Main)
    {
        let mut path = Vec::new();
        let mut at = end;
        while at != start {
            let (from, kind) = came_from[&at];
            path.push((at, kind));
            at = from;
        }
        path.reverse();
        paths.push(path);
    }
    paths
}

// ------------------------------------------------- the check on made-up workspaces

/// A package of a made-up workspace: its dependencies are (package, kind).
#[derive(Debug, Clone)]
struct FakePackage {
    name: &'static str,
    dir: &'static str,
    deps: Vec<(&'static str, &'static str)>,
}

fn pkg(
    name: &'static str,
    dir: &'static str,
    deps: &[(&'static str, &'static str)],
) -> FakePackage {
    FakePackage {
        name,
        dir,
        deps: deps.to_vec(),
    }
}

/// `cargo metadata --no-deps` of a workspace at `/ws`.
fn fake(packages: &[FakePackage]) -> Value {
    let dir_of: BTreeMap<&str, &str> = packages.iter().map(|p| (p.name, p.dir)).collect();
    let id = |name: &str| format!("path+file:///ws/{}#{name}@0.1.0", dir_of[name]);
    let pkgs: Vec<Value> = packages
        .iter()
        .map(|p| {
            let deps: Vec<Value> = p
                .deps
                .iter()
                .map(|(to, kind)| {
                    json!({
                        "name": to,
                        "kind": if *kind == "normal" { Value::Null } else { json!(kind) },
                        "path": format!("/ws/{}", dir_of[to]),
                    })
                })
                .collect();
            json!({
                "name": p.name,
                "id": id(p.name),
                "manifest_path": format!("/ws/{}/Cargo.toml", p.dir),
                "dependencies": deps,
            })
        })
        .collect();
    json!({
        "workspace_root": "/ws",
        "workspace_members": packages.iter().map(|p| id(p.name)).collect::<Vec<_>>(),
        "packages": pkgs,
    })
}

/// The intended workspace: a config crate and an in-pod crate, nobody
/// breaking the rule.
fn good() -> Vec<FakePackage> {
    const MAINS: [(&str, &str); 3] = [
        ("ambit-control", "normal"),
        ("ambit-ztunnel", "normal"),
        ("ambit-cni", "normal"),
    ];
    vec![
        pkg("ambit-proto", "proto", &[]),
        pkg(
            "ambit-config",
            "control/config",
            &[("ambit-proto", "normal")],
        ),
        pkg("ambit-inpod", "ztunnel/inpod", &[("ambit-proto", "build")]),
        pkg(
            "ambit-control",
            "control",
            &[("ambit-proto", "normal"), ("ambit-config", "normal")],
        ),
        pkg(
            "ambit-ztunnel",
            "ztunnel",
            &[("ambit-proto", "normal"), ("ambit-inpod", "normal")],
        ),
        pkg(
            "ambit-cni",
            "cni",
            &[("ambit-config", "normal"), ("ambit-inpod", "normal")],
        ),
        pkg("ambitctl", "control/ambitctl", &MAINS),
        pkg(
            "ambit-tests",
            "tests",
            &[&MAINS[..], &[("ambitctl", "normal")]].concat(),
        ),
        pkg(
            "ambit-benches",
            "benches",
            &[("ambit-tests", "normal"), ("ambit-control", "dev")],
        ),
    ]
}

/// The package `name` of `ws`.
fn find<'a>(ws: &'a mut [FakePackage], name: &str) -> &'a mut FakePackage {
    ws.iter_mut().find(|p| p.name == name).unwrap()
}

/// `good()` with `from` also depending on `to`.
fn with_edge(from: &str, to: &'static str, kind: &'static str) -> Value {
    let mut ws = good();
    find(&mut ws, from).deps.push((to, kind));
    fake(&ws)
}

#[test]
fn the_intended_layout_passes() {
    assert_eq!(check(&fake(&good()), &[]).unwrap(), Vec::<String>::new());
}

#[test]
fn a_main_crate_on_another_is_named_with_the_rule() {
    for kind in ["normal", "build", "dev"] {
        let problems = check(&with_edge("ambit-ztunnel", "ambit-control", kind), &[]).unwrap();
        assert_eq!(
            problems,
            [format!(
                "ambit-ztunnel → ambit-control ({kind}) breaks the rule: SPEC §1: ambit-ztunnel never depends on ambit-control or ambit-cni"
            )]
        );
    }
    let problems = check(&with_edge("ambit-control", "ambit-cni", "normal"), &[]).unwrap();
    assert_eq!(problems.len(), 1);
    assert!(
        problems[0].contains("ambit-control never depends on ambit-ztunnel or ambit-cni"),
        "{problems:?}"
    );
}

#[test]
fn a_nested_shared_crate_on_a_main_crate_is_refused() {
    let problems = check(&with_edge("ambit-inpod", "ambit-ztunnel", "normal"), &[]).unwrap();
    assert!(
        problems.contains(&"ambit-inpod → ambit-ztunnel (normal) breaks the rule: SPEC §1: ambit-inpod (ztunnel/inpod) is a nested shared crate and depends on no main crate (ambit-control, ambit-ztunnel, ambit-cni)".to_string()),
        "{problems:?}"
    );
    // ... and cni, which uses the in-pod crate, now reaches ztunnel through it.
    assert!(
        problems.iter().any(|p| p.starts_with("ambit-cni → ambit-inpod (normal) → ambit-ztunnel (normal) breaks the rule: SPEC §1: ambit-cni never depends on")),
        "{problems:?}"
    );
    assert_eq!(problems.len(), 2, "{problems:?}");
}

#[test]
fn paths_through_other_crates_count() {
    // cni → config → control: the edge into the main crate is named, and
    // the config crate is reported for its own edge.
    let problems = check(&with_edge("ambit-config", "ambit-control", "normal"), &[]).unwrap();
    assert!(
        problems.contains(
            &"ambit-cni → ambit-config (normal) → ambit-control (normal) breaks the rule: SPEC §1: ambit-cni never depends on ambit-control or ambit-ztunnel".to_string()
        ),
        "{problems:?}"
    );
    assert!(
        problems
            .iter()
            .any(|p| p.starts_with("ambit-config → ambit-control (normal)")),
        "{problems:?}"
    );
    // proto's tests pulling in the test crate reach every main crate.
    let problems = check(&with_edge("ambit-proto", "ambit-tests", "dev"), &[]).unwrap();
    assert_eq!(problems.len(), 3, "{problems:?}");
    assert!(
        problems
            .iter()
            .all(|p| p.starts_with("ambit-proto → ambit-tests (dev) → ")
                && p.contains("only ambitctl, ambit-tests, ambit-benches may depend")),
        "{problems:?}"
    );
}

#[test]
fn dev_dependencies_are_not_inherited() {
    // control's dev-dependency on a nested crate that dev-depends on ztunnel:
    // ztunnel is not built for control's tests, but the nested crate is
    // still reported for its own dev edge.
    let mut ws = good();
    find(&mut ws, "ambit-control")
        .deps
        .push(("ambit-inpod", "dev"));
    find(&mut ws, "ambit-inpod")
        .deps
        .push(("ambit-ztunnel", "dev"));
    let problems = check(&fake(&ws), &[]).unwrap();
    assert_eq!(problems.len(), 1, "{problems:?}");
    assert!(problems[0].starts_with("ambit-inpod → ambit-ztunnel (dev)"));
}

#[test]
fn pending_edges_are_allowed_only_while_they_exist_and_are_forbidden() {
    let meta = with_edge("ambit-cni", "ambit-control", "normal");
    assert!(check(&meta, &[]).unwrap()[0].starts_with("ambit-cni → ambit-control (normal)"));
    assert_eq!(
        check(&meta, &[("ambit-cni", "ambit-control")]).unwrap(),
        Vec::<String>::new()
    );
    // Gone: the entry is stale.
    let problems = check(&fake(&good()), &[("ambit-cni", "ambit-control")]).unwrap();
    assert_eq!(problems.len(), 1, "{problems:?}");
    assert!(
        problems[0].contains("PENDING_EDGES lists ambit-cni → ambit-control")
            && problems[0].contains("no longer depends"),
        "{problems:?}"
    );
    // Allowed anyway, or naming no package: the entry is wrong.
    let problems = check(
        &fake(&good()),
        &[
            ("ambitctl", "ambit-control"),
            ("ambit-cni", "ambit-nothing"),
        ],
    )
    .unwrap();
    assert_eq!(problems.len(), 2, "{problems:?}");
    assert!(
        problems[0].contains("ambitctl → ambit-control") && problems[0].contains("allows anyway")
    );
    assert!(
        problems[1].contains("ambit-cni → ambit-nothing")
            && problems[1].contains("no such package")
    );
}

#[test]
fn a_moved_main_crate_or_cli_is_reported() {
    let mut ws = good();
    find(&mut ws, "ambit-cni").dir = "node/cni";
    find(&mut ws, "ambitctl").dir = "ctl";
    let problems = check(&fake(&ws), &[]).unwrap();
    assert!(
        problems
            .iter()
            .any(|p| p.starts_with("no workspace package at cni/Cargo.toml")),
        "{problems:?}"
    );
    assert!(
        problems
            .iter()
            .any(|p| p.starts_with("ambitctl is at ctl/")),
        "{problems:?}"
    );
}
