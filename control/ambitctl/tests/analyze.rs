//! `ambitctl analyze` on the corpus: each bad case fires its code (the
//! file name's prefix), the whole good corpus — the demo, the test
//! fixtures, the waypoint routing corpus — stays quiet, and the table,
//! JSON and YAML formats are stable (golden files; `UPDATE_GOLDEN=1`
//! rewrites them).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};
use std::process::Command;

use ambitctl::analyze::{
    self, Files, Report, Severity, Source, Suppression, analyze_documents, documents_from_text,
};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn run(paths: &[PathBuf]) -> Report {
    let files = Files::new(paths.iter().cloned());
    analyze::analyze(&[&files as &dyn Source], &[]).unwrap()
}

fn codes(r: &Report) -> Vec<&str> {
    r.messages.iter().map(|m| m.code).collect()
}

fn bad_dir() -> PathBuf {
    root().join("tests/fixtures/analyze/bad")
}

fn yaml_files(dir: &Path) -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .collect();
    out.sort();
    out
}

#[test]
fn every_bad_case_fires_its_code_and_only_it() {
    let mut seen = std::collections::BTreeSet::new();
    for file in yaml_files(&bad_dir()) {
        let name = file.file_name().unwrap().to_string_lossy().to_string();
        let code = name.split('-').next().unwrap().to_string();
        let r = run(std::slice::from_ref(&file));
        let got = codes(&r);
        assert!(
            got.contains(&code.as_str()),
            "{name}: {code} not reported; got {:#?}",
            r.messages
        );
        assert!(
            got.iter().all(|c| *c == code),
            "{name}: other codes too: {:#?}",
            r.messages
        );
        for m in &r.messages {
            let origin = m.origin.as_ref().expect("file messages carry file:line");
            assert!(origin.file.ends_with(&name) && origin.line >= 1, "{m}");
            assert!(!m.message.is_empty());
        }
        seen.insert(code);
    }
    // Every code has a bad case.
    let all: std::collections::BTreeSet<String> = analyze::message::ALL
        .iter()
        .map(|c| c.id.to_string())
        .collect();
    assert_eq!(
        seen,
        all,
        "codes without a bad case in {}",
        bad_dir().display()
    );
}

/// The waypoint corpus shapes that are mistakes on purpose (the control
/// plane serves them as described and reports them).
const WAYPOINT_BAD_SHAPES: &[(&str, &str)] = &[
    ("45-undefined-subset-falls-back.yaml", "IST0101"),
    ("46-two-virtual-services.yaml", "IST0109"),
];

#[test]
fn the_good_corpus_is_quiet() {
    let r = root();
    for set in [
        vec![r.join("deploy/local/demo")],
        vec![r.join("tests/fixtures/mesh")],
        vec![r.join("tests/fixtures/analyze/good")],
        vec![r.join("tests/fixtures/waypoint/base.yaml")],
        vec![
            r.join("tests/fixtures/waypoint/base.yaml"),
            r.join("tests/fixtures/sidecar/base.yaml"),
        ],
    ] {
        let report = run(&set);
        assert!(
            report.messages.is_empty(),
            "{set:?}: {:#?}",
            report.messages
        );
        assert!(report.objects > 0, "{set:?} read nothing");
    }
    let base = r.join("tests/fixtures/waypoint/base.yaml");
    for shape in yaml_files(&r.join("tests/fixtures/waypoint/corpus")) {
        let name = shape.file_name().unwrap().to_string_lossy().to_string();
        let report = run(&[base.clone(), shape.clone()]);
        match WAYPOINT_BAD_SHAPES.iter().find(|(n, _)| *n == name) {
            Some((_, code)) => {
                assert!(
                    !report.messages.is_empty() && codes(&report).iter().all(|c| c == code),
                    "{name}: {:#?}",
                    report.messages
                )
            }
            None => assert!(report.messages.is_empty(), "{name}: {:#?}", report.messages),
        }
    }
}

/// Every YAML fixture of the repository is in the good corpus above or is
/// a bad case: a new fixture must be classified.
#[test]
fn every_yaml_fixture_is_classified() {
    let r = root();
    let mut stack = vec![r.join("tests/fixtures"), r.join("deploy")];
    while let Some(dir) = stack.pop() {
        for e in std::fs::read_dir(&dir).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                stack.push(p);
                continue;
            }
            if !p.extension().is_some_and(|e| e == "yaml" || e == "yml") {
                continue;
            }
            let rel = p.strip_prefix(&r).unwrap().to_string_lossy().to_string();
            let known = [
                "deploy/local/demo/",
                "tests/fixtures/mesh/",
                "tests/fixtures/analyze/good/",
                "tests/fixtures/analyze/bad/",
                "tests/fixtures/waypoint/",
                "tests/fixtures/sidecar/",
                // The mesh's own install manifests, not mesh config:
                // checked by tests/tests/kube_manifests.rs.
                "deploy/kubernetes/",
            ];
            assert!(
                known.iter().any(|k| rel.starts_with(k)),
                "unclassified YAML fixture {rel}: add it to the good corpus of this test or to tests/fixtures/analyze/bad"
            );
        }
    }
}

/// A report over two bad cases, with stable file names.
fn golden_report() -> Report {
    let mut docs = Vec::new();
    for name in [
        "IST0106-weights-not-100.yaml",
        "AMB0006-strict-with-legacy-clients.yaml",
    ] {
        let text = std::fs::read_to_string(bad_dir().join(name)).unwrap();
        docs.extend(documents_from_text(&format!("bad/{name}"), &text));
    }
    analyze_documents(docs, &[])
}

fn golden(name: &str, got: &str) {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/golden")
        .join(name);
    if std::env::var_os("UPDATE_GOLDEN").is_some() {
        std::fs::write(&path, got).unwrap();
        return;
    }
    let want = std::fs::read_to_string(&path).unwrap_or_else(|e| {
        panic!(
            "{}: {e}; run with UPDATE_GOLDEN=1 to create it",
            path.display()
        )
    });
    assert_eq!(
        got, want,
        "{name} changed; if intended, run with UPDATE_GOLDEN=1"
    );
}

#[test]
fn formats_are_stable() {
    let r = golden_report();
    assert_eq!(codes(&r), ["IST0106", "AMB0006"], "{:#?}", r.messages);
    golden("analyze.table.txt", &analyze::render_table(&r));
    golden("analyze.json", &analyze::render_json(&r).unwrap());
    golden("analyze.yaml", &analyze::render_yaml(&r).unwrap());
    let v: serde_json::Value = serde_json::from_str(&analyze::render_json(&r).unwrap()).unwrap();
    assert_eq!(v["messages"][0]["code"], "IST0106");
    assert_eq!(v["messages"][0]["severity"], "Error");
    assert_eq!(
        v["messages"][0]["origin"]["file"],
        "bad/IST0106-weights-not-100.yaml"
    );
    assert_eq!(v["summary"]["errors"], 1);
}

#[test]
fn suppression_by_flag_and_annotation() {
    let file = bad_dir().join("AMB0006-strict-with-legacy-clients.yaml");
    let files = Files::new([file.clone()]);
    let sup: Suppression = "AMB0006=PeerAuthentication shop/*".parse().unwrap();
    let r = analyze::analyze(&[&files as &dyn Source], &[sup]).unwrap();
    assert!(
        r.messages.is_empty() && r.suppressed == 1,
        "{:#?}",
        r.messages
    );
    assert!("IST9999".parse::<Suppression>().is_err());
    let text = std::fs::read_to_string(&file).unwrap().replace(
        "metadata: {name: strict, namespace: shop}",
        "metadata:\n  name: strict\n  namespace: shop\n  annotations: {galley.istio.io/analyze-suppress: \"AMB0006\"}",
    );
    let r = analyze_documents(documents_from_text("x.yaml", &text), &[]);
    assert!(
        r.messages.is_empty() && r.suppressed == 1,
        "{:#?}",
        r.messages
    );
}

#[test]
fn exit_codes_follow_the_worst_severity() {
    let bin = env!("CARGO_BIN_EXE_ambitctl");
    let status = |args: &[&str]| Command::new(bin).args(args).output().unwrap();
    let warning = bad_dir().join("AMB0003-subset-selects-no-pod.yaml");
    let error = bad_dir().join("IST0101-unknown-host.yaml");
    let w = warning.to_str().unwrap();
    assert!(status(&["analyze", "-f", w]).status.success());
    assert!(
        !status(&["analyze", "-f", w, "--fail-on", "warning"])
            .status
            .success()
    );
    let out = status(&["analyze", "-f", error.to_str().unwrap(), "-o", "yaml"]);
    assert!(!out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("code: IST0101"), "{text}");
    let good = root().join("tests/fixtures/analyze/good");
    let out = status(&["analyze", "--config-dir", good.to_str().unwrap()]);
    assert!(
        out.status.success()
            && String::from_utf8_lossy(&out.stdout).contains("No validation issues")
    );
    let r = run(&[warning]);
    assert!(r.fails(Severity::Warning) && !r.fails(Severity::Error));
    // Nothing to analyze is an error that says what to give.
    let out = status(&["analyze"]);
    assert!(
        !out.status.success()
            && String::from_utf8_lossy(&out.stderr).contains("nothing to analyze")
    );
}
